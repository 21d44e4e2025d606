"""A Graft step as a dozen fused ops over preallocated buffers.

The tree build and the verification bookkeeping of :mod:`vllm_graft.core.graft` and
:mod:`vllm_graft.core.acceptance`, one op per launch and no read of the device between
the first draft step and the end of acceptance:

1. :func:`vllm_graft.ops.graft_draft_step` once per draft depth, between the drafter's
   forwards: children scores, the candidate pool, confidence, checkpoint pruning as a
   mask (a stopped request stays in the batch), the next frontier;
2. :func:`vllm_graft.ops.graft_tree_finalize`: the hybrid tree of every request;
3. after the target's forward, :func:`vllm_graft.ops.logits_topk` over the tree rows and
   :func:`vllm_graft.ops.graft_accept_greedy` (or ``torch.rand`` and
   :func:`vllm_graft.ops.graft_accept_sampled`): the accepted paths and the successor
   matrix's update;
4. one copy of :attr:`StepBuffers.packed` to the host: what the scheduler, the guard and
   the metrics need (:data:`PACKED_COLUMNS`).

Every tensor the ops write lives in :class:`StepBuffers`, allocated once for the largest
batch (fixed addresses, as CUDA graphs need); a step of ``B`` requests works on views of
the first ``B`` rows. The semantics are the pure-torch path's, element for element
(``tests/core/test_fused.py``); only ties between equal draft scores may be broken
differently (the fused ops break them by the lower pool slot).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from vllm_graft import ops
from vllm_graft.core.acceptance import AcceptanceResult, SamplingBatch
from vllm_graft.core.config import num_draft_candidates
from vllm_graft.core.draft_tree import DraftPool, DraftStep, Drafter
from vllm_graft.core.hybrid import HybridTree

#: the int64 columns of :attr:`StepBuffers.packed`, per request (name, width);
#: ``R`` = rows per tree, ``L`` = the acceptance walk's depth bound
PACKED_COLUMNS = (("stage", "1"), ("steps", "1"), ("num_nodes", "1"), ("stats", "8"),
                  ("num_accepted", "1"), ("accepted_sources", "5"), ("tree_tokens", "R"),
                  ("output_tokens", "L+1"), ("accepted_rows", "L"))
#: :attr:`StepBuffers.stats` columns (:class:`vllm_graft.core.graft.BuildStats` fields)
STATS_COLUMNS = ("draft_nodes", "retrieved_nodes", "both_nodes", "context_nodes",
                 "padded_nodes", "replaced_nodes", "retrieval_lookups", "retrieval_hits")
#: :attr:`StepBuffers.accepted_sources` columns (``accepted_by_source``'s classes)
SOURCE_CLASSES = ("context", "draft", "retrieved", "both", "padding")


@dataclass(frozen=True)
class TreeRecipe:
    """Everything a fused build needs besides the batch: the settings of a
    :class:`~vllm_graft.core.graft.GraftTreeBuilder`, as sizes and small tensors.

    top_k / max_depth: the drafter's branching and steps (0 / 0: no drafter);
    checkpoint_steps: the draft steps a threshold judges (empty: no pruning);
    keep_by_stage: ``[S + 1]`` drafted nodes kept per stage; retrieval_keep: ``[S + 1]``
    (or ``[1]`` without a drafter) template nodes used per stage, empty without
    retrieval; template_*: ``[T]``; levels: the depth bound of every tree (the
    acceptance walk's levels)."""

    budget: int
    top_k: int
    max_depth: int
    checkpoint_steps: tuple[int, ...]
    thresholds: torch.Tensor
    keep_by_stage: torch.Tensor
    draft_capacity: int
    retrieval_keep: torch.Tensor
    template_parents: torch.Tensor
    template_ranks: torch.Tensor
    template_scores: torch.Tensor
    replace_below: float
    replace_keep: int
    spare: bool
    fixed_shape: bool
    vocab_size: int
    successor_k: int
    levels: int

    @property
    def rows(self) -> int:
        return self.budget + 1

    @property
    def pool(self) -> int:
        return num_draft_candidates(self.top_k, self.max_depth) if self.max_depth else 0


def _packed_width(name: str, width: str, recipe: TreeRecipe) -> int:
    return {"1": 1, "5": 5, "8": 8, "R": recipe.rows, "L+1": recipe.levels + 1,
            "L": recipe.levels}[width]


@dataclass
class StepBuffers:
    """The tensors one fused step writes, for ``max_batch`` requests.

    Draft state: pool_* ``[B, C]``, frontier_* ``[B, k]``, lineage ``[B, k, D]``,
    going ``[B]``, confidence ``[B, D]``. Tree: tree_* ``[B, R]``, ancestor_bits
    ``[B, R, ceil(R / 64)]``, learn_rows ``[B, R]``. Work: draft_logprobs / draft_tokens
    ``[B, k, k]`` (a compacted drafter's answers spread back over the batch),
    uniforms ``[B, L + 1, R + 1]``, row_index ``[B, R]`` (row ``b * R + r``, the logits
    layout of :func:`bench_core`'s step). packed ``[B, P]`` int64: what the host reads,
    one copy (:data:`PACKED_COLUMNS`; its columns are the properties of the same name);
    host: its pinned mirror on a GPU."""

    pool_tokens: torch.Tensor
    pool_parents: torch.Tensor
    pool_scores: torch.Tensor
    frontier_ids: torch.Tensor
    frontier_tokens: torch.Tensor
    frontier_scores: torch.Tensor
    lineage: torch.Tensor
    going: torch.Tensor
    confidence: torch.Tensor
    tree_parents: torch.Tensor
    tree_depths: torch.Tensor
    tree_valid: torch.Tensor
    tree_source: torch.Tensor
    tree_score: torch.Tensor
    ancestor_bits: torch.Tensor
    learn_rows: torch.Tensor
    draft_logprobs: torch.Tensor
    draft_tokens: torch.Tensor
    uniforms: torch.Tensor
    row_index: torch.Tensor
    packed: torch.Tensor
    host: torch.Tensor | None
    columns: dict[str, slice]

    @classmethod
    def allocate(cls, recipe: TreeRecipe, max_batch: int,
                 device: torch.device | str) -> StepBuffers:
        device = torch.device(device)
        b, k, depth, rows = max_batch, max(recipe.top_k, 1), recipe.max_depth, recipe.rows
        i64, f32 = dict(dtype=torch.long, device=device), dict(device=device)
        columns, start = {}, 0
        for name, width in PACKED_COLUMNS:
            size = _packed_width(name, width, recipe)
            columns[name] = slice(start, start + size)
            start += size
        packed = torch.full((b, start), -1, **i64)
        host = torch.empty_like(packed, device="cpu").pin_memory() \
            if device.type == "cuda" else None
        return cls(
            pool_tokens=torch.full((b, recipe.pool), -1, **i64),
            pool_parents=torch.full((b, recipe.pool), -1, **i64),
            pool_scores=torch.full((b, recipe.pool), float("-inf"), **f32),
            frontier_ids=torch.full((b, k), -1, **i64),
            frontier_tokens=torch.full((b, k), -1, **i64),
            frontier_scores=torch.zeros((b, k), **f32),
            lineage=torch.full((b, k, depth), -1, **i64),
            going=torch.zeros(b, dtype=torch.bool, device=device),
            confidence=torch.full((b, depth), float("nan"), **f32),
            tree_parents=torch.full((b, rows), -1, **i64),
            tree_depths=torch.zeros((b, rows), **i64),
            tree_valid=torch.zeros((b, rows), dtype=torch.bool, device=device),
            tree_source=torch.zeros((b, rows), dtype=torch.uint8, device=device),
            tree_score=torch.zeros((b, rows), **f32),
            ancestor_bits=torch.zeros((b, rows, (rows + 63) // 64), **i64),
            learn_rows=torch.full((b, rows), -1, **i64),
            draft_logprobs=torch.full((b, k, k), float("-inf"), **f32),
            draft_tokens=torch.full((b, k, k), -1, **i64),
            uniforms=torch.zeros((b, recipe.levels + 1, rows + 1), **f32),
            row_index=torch.arange(b * rows, **i64).view(b, rows),
            packed=packed, host=host, columns=columns)

    @property
    def max_batch(self) -> int:
        return self.packed.shape[0]

    def view(self, batch: int) -> StepBuffers:
        """The same buffers for the first ``batch`` requests (views, no op)."""
        if batch > self.max_batch:
            raise ValueError(f"a step of {batch} requests does not fit buffers for "
                             f"{self.max_batch}")
        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            values[f.name] = value[:batch] if isinstance(value, torch.Tensor) else value
        return StepBuffers(**values)

    def column(self, name: str) -> torch.Tensor:
        """A column group of :attr:`packed` (``[B]`` for the per-request counts, else
        ``[B, w]``)."""
        part = self.packed[:, self.columns[name]]
        return part[:, 0] if name in _SCALAR_COLUMNS else part

    stage = property(lambda self: self.column("stage"))
    steps = property(lambda self: self.column("steps"))
    num_nodes = property(lambda self: self.column("num_nodes"))
    stats = property(lambda self: self.column("stats"))
    num_accepted = property(lambda self: self.column("num_accepted"))
    accepted_sources = property(lambda self: self.column("accepted_sources"))
    tree_tokens = property(lambda self: self.column("tree_tokens"))
    output_tokens = property(lambda self: self.column("output_tokens"))
    accepted_rows = property(lambda self: self.column("accepted_rows"))

    def tree(self, with_score: bool = True) -> HybridTree:
        """The built trees as a :class:`HybridTree` (views of these buffers: the next
        build overwrites them)."""
        return HybridTree(tokens=self.tree_tokens, parents=self.tree_parents,
                          depths=self.tree_depths, valid=self.tree_valid,
                          source=self.tree_source, num_nodes=self.num_nodes,
                          score=self.tree_score if with_score else None)

    def acceptance(self) -> AcceptanceResult:
        return AcceptanceResult(accepted_rows=self.accepted_rows,
                                output_tokens=self.output_tokens,
                                num_accepted=self.num_accepted)

    def to_host(self) -> torch.Tensor:
        """The packed results on the host: one copy (non-blocking into pinned memory
        on a GPU: synchronise on the current stream, or an event recorded after it,
        before reading it)."""
        if self.host is None:
            return self.packed.cpu()
        self.host.copy_(self.packed, non_blocking=True)
        return self.host


_SCALAR_COLUMNS = {"stage", "steps", "num_nodes", "num_accepted"}


class FusedTreeBuild:
    """Runs :class:`TreeRecipe` builds over :class:`StepBuffers` grown to the largest
    batch seen (or reserved up front with :meth:`reserve`, as a CUDA graph needs)."""

    def __init__(self, recipe: TreeRecipe, device: torch.device | str):
        self.recipe = recipe
        self.device = torch.device(device)
        self.buffers: StepBuffers | None = None
        depth = torch.tensor([1] * recipe.top_k + [
            2 + s // (recipe.top_k ** 2) for s in range(max(recipe.pool - recipe.top_k, 0))],
            dtype=torch.long)
        self.slot_depths = depth[:recipe.pool].to(self.device)  # [C]
        self.checkpoint_of_step = {step: i for i, step in enumerate(recipe.checkpoint_steps)}
        self.root_ids = torch.full((1, 1), -1, dtype=torch.long, device=self.device)
        self.batch_index = torch.empty(0, dtype=torch.long, device=self.device)
        self.empty = torch.empty(0, dtype=torch.long, device=self.device)
        self.empty_context = torch.empty((0, 0), dtype=torch.long, device=self.device)
        #: runs a build's draft loop in its place when it returns True (the engine's
        #: CUDA graphs, :mod:`vllm_graft.vllm.draft_graphs`); never asked in compact mode
        self.draft_loop: Callable[[torch.Tensor, Drafter, StepBuffers], bool] | None = None

    def reserve(self, max_batch: int) -> StepBuffers:
        """Buffers for at least ``max_batch`` requests (allocated now if smaller)."""
        if self.buffers is None or self.buffers.max_batch < max_batch:
            grown = max_batch if self.buffers is None else max(max_batch,
                                                               2 * self.buffers.max_batch)
            self.buffers = StepBuffers.allocate(self.recipe, grown, self.device)
            self.batch_index = torch.arange(grown, device=self.device)
        return self.buffers

    def build(self, roots: torch.Tensor, drafter: Drafter | None,
              context: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
              partitions: torch.Tensor | None = None, successors: torch.Tensor | None = None,
              compact: bool = False) -> StepBuffers:
        """Draft and finalize the trees of ``roots`` ([B] int64); returns the buffers'
        view for the batch. ``compact``: ask the drafter only about requests still
        drafting (a read of the device at each checkpoint; what a CPU wants, where
        reads are free and drafter rows are not), else about every request at every
        depth (no read; a stopped request's answers are masked)."""
        recipe = self.recipe
        batch = roots.shape[0]
        buffers = self.reserve(batch).view(batch)
        if recipe.max_depth:
            if drafter is None:
                raise ValueError("this tree recipe drafts: it needs a drafter")
            if compact or self.draft_loop is None \
                    or not self.draft_loop(roots, drafter, buffers):
                self._draft(roots, drafter, buffers, compact)
        context_tokens, context_parents, context_depths = context if context is not None \
            else (self.empty_context,) * 3
        ops.graft_tree_finalize(
            roots, buffers.pool_tokens, buffers.pool_parents, buffers.pool_scores,
            buffers.stage, recipe.keep_by_stage, recipe.retrieval_keep,
            successors if successors is not None else self.empty.int().view(0, 1),
            self.empty if partitions is None else partitions,
            recipe.template_parents, recipe.template_ranks, recipe.template_scores,
            context_tokens, context_parents, context_depths,
            draft_top_k=recipe.top_k, draft_capacity=recipe.draft_capacity,
            replace_below=recipe.replace_below, replace_keep=recipe.replace_keep,
            spare=recipe.spare, fixed_shape=recipe.fixed_shape,
            vocab_size=recipe.vocab_size,
            out={name: getattr(buffers, name) for name in ops.TREE_OUTPUTS})
        return buffers

    def draft(self, roots: torch.Tensor, drafter: Drafter, buffers: StepBuffers) -> None:
        """The draft loop alone, every request at every depth (no read of the device):
        the drafter's forwards and :func:`vllm_graft.ops.graft_draft_step` per depth,
        into ``buffers`` (a :meth:`reserve` view of ``roots``' batch)."""
        self._draft(roots, drafter, buffers, compact=False)

    def _draft(self, roots: torch.Tensor, drafter: Drafter, buffers: StepBuffers,
               compact: bool) -> None:
        recipe = self.recipe
        batch = roots.shape[0]
        pool = DraftPool(tokens=buffers.pool_tokens, parents=buffers.pool_parents,
                         scores=buffers.pool_scores,
                         depths=self.slot_depths.expand(batch, -1))
        everyone = self.batch_index[:batch]
        active, active_host = everyone, None
        for step in range(recipe.max_depth):
            if step == 0:
                node_ids, node_tokens = self.root_ids.expand(batch, 1), roots.view(batch, 1)
            else:
                node_ids, node_tokens = buffers.frontier_ids, buffers.frontier_tokens
            if compact and active_host is not None and len(active_host) < batch:
                if not active_host:
                    break  # nobody drafts on: the state already says so
                logprobs, tokens = drafter(DraftStep(
                    step=step, active=active, node_ids=node_ids[active],
                    tokens=node_tokens[active], pool=pool))
                width = logprobs.shape[1]
                full_logprobs = buffers.draft_logprobs[:, :width]
                full_tokens = buffers.draft_tokens[:, :width]
                full_logprobs[active] = logprobs.float()
                full_tokens[active] = tokens.long()
                logprobs, tokens = full_logprobs, full_tokens
            else:
                logprobs, tokens = drafter(DraftStep(
                    step=step, active=everyone, node_ids=node_ids, tokens=node_tokens,
                    pool=pool))
            _check_drafter_answer(logprobs, tokens, batch, 1 if step == 0 else recipe.top_k,
                                  recipe.top_k, step)
            checkpoint = self.checkpoint_of_step.get(step, -1)
            ops.graft_draft_step(
                logprobs, tokens, recipe.thresholds, step, checkpoint, buffers.pool_tokens,
                buffers.pool_parents, buffers.pool_scores, buffers.frontier_ids,
                buffers.frontier_tokens, buffers.frontier_scores, buffers.lineage,
                buffers.going, buffers.stage, buffers.steps, buffers.confidence)
            if compact and checkpoint >= 0:  # who drafts on: the checkpoint's one read
                active_host = [b for b, going in enumerate(buffers.going.tolist()) if going]
                active = torch.tensor(active_host, dtype=torch.long, device=self.device)


def _check_drafter_answer(logprobs: torch.Tensor, tokens: torch.Tensor, batch: int,
                          width: int, top_k: int, step: int) -> None:
    expected = (batch, width, top_k)
    if tuple(logprobs.shape) != expected or tuple(tokens.shape) != expected:
        raise ValueError(f"drafter returned {tuple(logprobs.shape)} / {tuple(tokens.shape)} "
                         f"at step {step}, expected {expected}")


def accept_greedy(buffers: StepBuffers, logits: torch.Tensor, successors: torch.Tensor,
                  vocab_size: int, logit_rows: torch.Tensor | None = None) -> StepBuffers:
    """Greedy acceptance of the trees in ``buffers`` and the matrix update: one top-k
    pass over the tree rows of ``logits`` (``[N, V]``; ``logit_rows`` ``[B, R]`` the row
    of each tree row, default ``b * R + r``) and one walk."""
    rows = _valid_rows(buffers, logit_rows)
    row_topk = ops.logits_topk(logits, successors.shape[1], rows.view(-1), check=False)
    ops.graft_accept_greedy(buffers.tree_tokens, buffers.tree_parents, buffers.tree_valid,
                            buffers.tree_source, row_topk, buffers.learn_rows, vocab_size,
                            successors, _accept_out(buffers))
    return buffers


def accept_sampled(buffers: StepBuffers, logits: torch.Tensor, sampling: SamplingTensors,
                   successors: torch.Tensor, vocab_size: int,
                   logit_rows: torch.Tensor | None = None) -> StepBuffers:
    """:func:`accept_greedy` for sampled requests (greedy ones in the batch follow the
    argmax): uniforms drawn in one op, then one lossless walk."""
    rows = _valid_rows(buffers, logit_rows)
    row_topk = ops.logits_topk(logits, successors.shape[1], rows.view(-1), check=False)
    torch.rand(buffers.uniforms.shape, out=buffers.uniforms)
    ops.graft_accept_sampled(logits, rows, buffers.tree_tokens, buffers.tree_parents,
                             buffers.tree_valid, buffers.tree_source, sampling.temperature,
                             sampling.top_k, sampling.top_p, buffers.uniforms, row_topk,
                             buffers.learn_rows, vocab_size, successors,
                             _accept_out(buffers))
    return buffers


def _valid_rows(buffers: StepBuffers, logit_rows: torch.Tensor | None) -> torch.Tensor:
    """``[B, R]`` the logits row of every valid tree row, -1 elsewhere (one op)."""
    rows = buffers.row_index if logit_rows is None else logit_rows
    return torch.where(buffers.tree_valid, rows, _MINUS_ONE.get(rows.device))


class _DeviceConstants(dict):
    """One 0-d tensor per device, made once: a Python scalar in ``torch.where`` is an
    op of its own (``scalar_tensor``)."""

    def __init__(self, value: int):
        super().__init__()
        self.value = value

    def get(self, device: torch.device) -> torch.Tensor:  # type: ignore[override]
        if device not in self:
            self[device] = torch.tensor(self.value, device=device)
        return self[device]


_MINUS_ONE = _DeviceConstants(-1)


def _accept_out(buffers: StepBuffers) -> dict[str, torch.Tensor]:
    return {name: getattr(buffers, name) for name in ops.ACCEPT_OUTPUTS}


@dataclass(frozen=True)
class SamplingTensors:
    """:class:`SamplingBatch` as the sampled acceptance op takes it: every filter a
    tensor (``top_k`` 0 and ``top_p`` 1 switch them off). Built once per batch, outside
    the step."""

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64
    top_p: torch.Tensor  # [B] float32

    @classmethod
    def of(cls, sampling: SamplingBatch) -> SamplingTensors:
        if sampling.generators:
            raise ValueError("seeded requests (their own generators) walk the per-level "
                             "path, not the fused acceptance")
        temperature = sampling.temperature.float()
        batch, device = temperature.shape[0], temperature.device
        top_k = sampling.top_k.long() if sampling.top_k is not None else torch.zeros(
            batch, dtype=torch.long, device=device)
        top_p = sampling.top_p.float() if sampling.top_p is not None else torch.ones(
            batch, device=device)
        return cls(temperature.contiguous(), top_k.contiguous(), top_p.contiguous())
