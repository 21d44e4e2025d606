"""GraftProposer: vLLM's EAGLE proposer, drafting Graft hybrid trees.

One drafting round per engine step, for the whole batch:

1. **Catch-up.** The EAGLE-3 head runs once, causally, over every position the target
   settled this step (a prefill chunk, or the root plus the accepted tree path), with
   inputs shifted by one token as EAGLE does (row at position ``p`` holds token
   ``p + 1`` and the target's fused hidden state at ``p``). This writes the head's KV
   for those positions and yields, at each request's last row, the distribution of the
   root's children.
2. **Tree steps.** :class:`vllm_graft.core.graft.GraftTreeBuilder` drives the head
   through :meth:`_expand`: each step feeds the frontier nodes of all still-active
   requests as one batch; a node at depth ``d`` is fed at position ``root + d - 1``
   with its parent row's pre-norm hidden state, and attends to the cached prefix plus
   its ancestors' rows (tree attention; those rows' K/V stay in a
   :class:`~vllm_graft.vllm.tree_attention.TreeKVStore`, not in the paged cache).
   Calibrated pruning stops unsure requests early; retrieval fills the freed slots.
3. The flattened trees go to the scheduler as each request's draft tokens, and are
   kept (by request id) for the next step's verification.

The same rounds drive an ordinary draft model (:class:`GraftDraftModelProposer`, e.g.
Qwen2.5-Coder-0.5B for the 1.5B): it reads token ``p`` at position ``p`` instead of
EAGLE's shifted input, and has no hidden-state input.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm.forward_context import set_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.dflash import DFlashProposer
from vllm.v1.spec_decode.draft_model import DraftModelProposer
from vllm.v1.spec_decode.eagle import EagleProposer

from vllm_graft.core.budget import (ChainScout, Choice, ThroughputGuard, TreeSizer,
                                    context_scores, copied_prefix)
from vllm_graft.core.chain import HostChains, walk_chains
from vllm_graft.core.config import StepMode, TreeShape
from vllm_graft.core.context import (ContextIndex, RecentOutputsIndex, match_score,
                                     proposals_to_tensors)
from vllm_graft.core.draft_tree import DraftStep
from vllm_graft.core.graft import BuildStats, GraftTreeBuilder
from vllm_graft.core.hybrid import HybridTree, ancestor_ids
from vllm_graft.core.isolation import IsolationMode, MatrixPartitions
from vllm_graft.core.successor import SuccessorMatrix
from vllm_graft.vllm.config import GraftSettings, TokenizerRef
from vllm_graft.vllm.heap import HeapTrimmer
from vllm_graft.vllm.proposal import StepProposal
from vllm_graft.vllm.sampling import plain_decoding_reason
from vllm_graft.vllm.successor_state import (SuccessorStateKeeper, is_state_writer,
                                             load_successor_state, matrix_metadata)
from vllm_graft.vllm.timing import SpanTimer
from vllm_graft.vllm.tp_agreement import agree
from vllm_graft.vllm.tree_attention import (TreeAttentionPlan, TreeKVStore, TreeRequestPlan,
                                            active_plan)

logger = logging.getLogger(__name__)


@dataclass
class PendingTree:
    """A tree sent to the scheduler, waiting for verification (CPU tensors, root first).

    stage / confidence: where drafting stopped and the best-path confidence after each
    draft step (for metrics and calibration). The tensors are rows of the step's batch
    tree (views: every build allocates its own). ``draft_tokens``: ``tokens[1:]`` as the
    scheduler got them, so recognising the tree next step reads no tensor."""

    tokens: torch.Tensor  # [n] int64
    parents: torch.Tensor  # [n]
    depths: torch.Tensor  # [n]
    source: torch.Tensor  # [n] uint8
    stage: int = -1
    confidence: torch.Tensor | None = None  # [max_depth]
    score: torch.Tensor | None = None  # [n] the acceptance model's (HybridTree.score)
    draft_tokens: list[int] | None = None  # None: read from ``tokens``
    chain: bool = False  # known to be a chain (row i's parent is row i - 1)

    def __post_init__(self):
        if self.draft_tokens is None:
            self.draft_tokens = self.tokens[1:].tolist()

    def truncated(self, rows: int) -> PendingTree:
        if rows == self.tokens.numel():
            return self
        return PendingTree(self.tokens[:rows], self.parents[:rows], self.depths[:rows],
                           self.source[:rows], self.stage, self.confidence,
                           None if self.score is None else self.score[:rows],
                           self.draft_tokens[:rows - 1], self.chain)


@dataclass
class HostRows:
    """A host tree's node counts and tokens as Python lists, read once per batch."""

    num_nodes: list[int]
    tokens: list[list[int]]

    @classmethod
    def of(cls, tree: HybridTree) -> HostRows:
        return cls(tree.num_nodes.tolist(), tree.tokens.tolist())


@dataclass
class ShadowChain:
    """A request's whole copy chain (before any cut), kept until decoding has emitted
    every position it proposed: its nodes after the root (tokens, source tags, scores),
    rooted at context position ``root``. ``verified``: its first nodes a chain step
    verified (they taught the acceptance model then)."""

    root: int
    tokens: list[int]
    source: list[int]
    score: list[float]
    verified: int = 0

    def outcome(self, emitted) -> tuple[list[int], list[float], int, int]:
        """What verifying the chain would have accepted, given the tokens decoding
        emitted at its positions (:func:`vllm_graft.core.budget.copied_prefix`), as
        :meth:`AcceptanceModel.observe_chains` takes it: past the ``verified`` nodes."""
        return self.source, self.score, copied_prefix(self.tokens, emitted), self.verified


def check_compiled_ops(backend: str, device) -> None:
    """On a GPU the compiled ops need their CUDA kernels: a library built where torch or
    the CUDA toolkit lacked CUDA has CPU kernels only (its build said so), and its first
    use on the GPU would fail in the middle of a step."""
    from vllm_graft.ops import cuda_ops_available

    if backend == "compiled" and torch.device(device).type == "cuda" \
            and not cuda_ops_available():
        raise RuntimeError(
            "vllm_graft's compiled ops were built without their CUDA kernels, and this "
            "engine runs on a GPU: rebuild them where torch has CUDA and nvcc is found "
            "(VLLM_GRAFT_BUILD_CUDA=1 pip install --no-build-isolation .), or set "
            "graft.ops_backend to \"reference\" (slower)")


def speculates_ever(req_state) -> bool:
    """Whether the request's options allow drafts at some point of its life: all but
    ``min_tokens`` of the reasons for plain decoding last as long as the request."""
    params = req_state.sampling_params
    return params is not None and plain_decoding_reason(params, params.min_tokens) is None


def speculates_now(req_state) -> bool:
    """Whether the request's options allow drafts at its next position."""
    return plain_decoding_reason(req_state.sampling_params,
                                 len(req_state.output_token_ids)) is None


@dataclass
class DeferredRows:
    """Drafter inputs of positions a request settled without drafting (decoded plainly
    or by a copy chain), kept until its next tree feeds them to the drafter in one
    forward.
    Positions are contiguous and increasing (the catch-up attends causally).

    The hidden inputs (the target's hidden rows, not yet projected by the drafter) are
    kept as one chunk per step and joined only when fed: a plain step costs a list
    append, not a copy of everything kept."""

    tokens: list[int]
    positions: list[int]
    chunks: list[torch.Tensor] = field(default_factory=list)  # [n_i, H] per append

    @property
    def hidden(self) -> torch.Tensor | None:
        """``[len(positions), H]``: the kept positions' hidden inputs (None: none)."""
        return torch.cat(self.chunks) if self.chunks else None

    def append(self, tokens: list[int], positions: list[int], hidden: torch.Tensor | None,
               limit: int) -> None:
        """Add one step's rows; a position fed again replaces the earlier copy, a gap
        drops what came before it, and only the last ``limit`` positions stay."""
        start = positions[0]
        keep = bisect.bisect_left(self.positions, start)  # the rows before this step's
        if keep and self.positions[keep - 1] != start - 1:
            keep = 0  # not contiguous: start again from here
        kept = len(self.positions)
        self.tokens = self.tokens[:keep] + tokens
        self.positions = self.positions[:keep] + positions
        if hidden is not None:
            if keep < kept:  # rows replaced or dropped: cut the chunks to the first keep
                self.chunks = _drop_rows(self.chunks, kept - keep, from_end=True)
            self.chunks.append(hidden)
        overflow = len(self.positions) - limit
        if overflow > 0:
            self.tokens, self.positions = self.tokens[overflow:], self.positions[overflow:]
            self.chunks = _drop_rows(self.chunks, overflow, from_end=False)


def _drop_rows(chunks: list[torch.Tensor], rows: int, from_end: bool) -> list[torch.Tensor]:
    """``chunks`` without ``rows`` rows of their concatenation, taken from its end or
    its start; only the chunks that lose rows are touched."""
    chunks, edge = list(chunks), -1 if from_end else 0
    while rows > 0 and chunks:
        size = chunks[edge].shape[0]
        if size <= rows:
            chunks.pop(edge)
        else:
            chunks[edge] = chunks[edge][:size - rows] if from_end else chunks[edge][rows:]
        rows -= size
    return chunks


@dataclass
class SettledRows:
    """Per request: the target rows whose positions became final this step.

    rows: flattened-batch rows in position order; next_tokens: the token at position
    + 1 of each row; first_position / first_token: position and token of rows[0];
    decoding: whether the rows are a decoding step's (one row, or a verified tree's or
    chain's accepted path) rather than a prompt's chunk; a request that does not draft
    next step keeps a decoding step's rows for its next tree, and a prompt's chunk is
    fed at once."""

    batch_row: int
    rows: list[int]
    next_tokens: list[int]
    first_position: int
    first_token: int
    drafts: bool  # whether this request gets a new tree
    decoding: bool = True


class GraftTreeDrafting:
    """The drafting rounds, shared by both drafters; subclasses say how their model is
    fed (``_catch_up_inputs``, ``_forward``, ``_top_k``) and where its tree rows sit:
    a node at depth ``d`` under a root at position ``R`` is fed at position
    ``R + d + EXPANSION_OFFSET`` and sees the cached positions ``[0, R + PREFIX_EXTRA)``.
    """

    EXPANSION_OFFSET: int
    PREFIX_EXTRA: int
    USES_HIDDEN: bool

    def _init_graft(self, vllm_config, device) -> None:
        settings = GraftSettings.from_vllm_config(vllm_config)
        if settings is None:
            raise ValueError("GraftProposer needs additional_config['graft']")
        self.settings = settings
        config = settings.config
        check_compiled_ops(config.ops_backend, device)
        vocab_size = vllm_config.model_config.get_vocab_size()
        # the saved state holds what the warm-up taught and what serving taught since;
        # the ops skip their per-call id checks (device syncs on a GPU): every id the
        # engine passes is in range by construction (SuccessorMatrix's doc)
        load = dict(vocab_size=vocab_size, k=config.successor_k,
                    tokenizer_fingerprint=TokenizerRef.fingerprint_of(vllm_config.model_config),
                    device=device, backend=config.ops_backend, check=False)
        writer = config.successor_state is not None and is_state_writer(vllm_config)
        matrix = source = None
        if config.successor_state is not None:  # a file it cannot use: on_corrupt decides
            matrix = load_successor_state(config.successor_state, writer=writer, fallback=(
                f"the warm-up file {config.warmup}" if config.warmup else "an empty matrix"),
                **load)
            source = config.successor_state.path
        if matrix is None and config.warmup is not None:
            matrix, source = SuccessorMatrix.load(config.warmup, **load), config.warmup
        if matrix is not None:
            logger.info("Graft: successor matrix from %s (%d rows)", source,
                        int(matrix.touched_rows().numel()))
        else:
            matrix = SuccessorMatrix.empty(vocab_size, config.successor_k, device=device,
                                           backend=config.ops_backend, check=False)
        self.state_keeper: SuccessorStateKeeper | None = None
        if config.successor_state is not None:
            self.state_keeper = SuccessorStateKeeper(
                config.successor_state, lambda: self.matrix, matrix_metadata(vllm_config),
                writer=writer)
        # the worker's heap, handed back now and then (graft.heap_trim_s)
        self.heap_trimmer = HeapTrimmer(config.heap_trim_s)
        # budget "auto": the sizer exists once the runner measured the cost profile
        self.auto_size = config.auto_size and settings.tree_shape is TreeShape.DYNAMIC
        # trees carry their nodes' scores: the sizer's acceptance model tells nodes apart
        # by them, and a calibration's tree records tally them (for fixed budgets too)
        self.tree_builder = GraftTreeBuilder(config, matrix, settings.thresholds, device,
                                             tree_shape=settings.tree_shape,
                                             score_nodes=True)
        # which matrix partition each request reads and teaches (graft.isolation)
        self.isolation = MatrixPartitions(
            IsolationMode(config.isolation.mode), matrix,
            config.isolation.max_matrices or vllm_config.scheduler_config.max_num_seqs + 16)
        self.tenant_field = config.isolation.tenant_field
        self.pending: dict[str, PendingTree] = {}
        if config.auto_size and not self.auto_size:
            logger.warning("Graft: budget \"auto\" is off: fixed-shape trees always "
                           "hold budget nodes")
        self.sizer: TreeSizer | None = None
        # budget "auto": each step runs the mode measured fastest (set with the sizer);
        # a round's choice travels in its StepProposal
        self.guard: ThroughputGuard | None = None
        # per request, decided once at its first sight (:meth:`admit`): whether the
        # drafter reads its positions at all
        self.drafter_follows: dict[str, bool] = {}
        self.chain_tokens, self.chain_walk = config.chain_tokens, config.chain_walk
        # budget "auto": looks at the batch's copy chains while the guard decodes plainly
        # (set with the guard)
        self.scout: ChainScout | None = None
        # per request, the whole chain of the last chain build (a scout's look or a chain
        # step) until decoding has emitted the positions it proposed
        self.shadows: dict[str, ShadowChain] = {}
        # requests whose last tree was cut to nothing: steps since, while they skip drafting
        self.plain_steps: dict[str, int] = {}
        self.max_model_len = vllm_config.model_config.max_model_len
        self.forward_timer = SpanTimer(device)  # head forwards (for the overhead metrics)
        # the drafter's catch-up (its forwards included); outside tree steps it serves
        # only trees to come, and budget "auto" charges it to them
        # (StepProposal.tree_preparation)
        self.catch_up_timer = SpanTimer(device)
        # drafter inputs deferred while the throughput guard decodes plainly; the tree
        # step that feeds them carries their cost in the guard's measurement (the
        # switch from a cheaper mode to trees costs that much)
        self.deferred: dict[str, DeferredRows] = {}
        # context retrieval: one index per request over its prompt and output, and,
        # when configured, one over recent outputs of finished requests
        self.context_config = config.context_settings  # resolved once: read per request, step
        self.uses_context = config.uses_context and self.context_config.max_nodes > 0
        self.context_indexes: dict[str, ContextIndex] = {}
        self.prompt_lengths: dict[str, int] = {}
        self.shared_context = None
        if self.uses_context and self.context_config.cross_request:
            context = self.context_config
            self.shared_context = RecentOutputsIndex(
                max_tokens=context.cross_request_tokens, min_ngram=context.min_ngram,
                max_ngram=context.max_ngram)

    @property
    def matrix(self) -> SuccessorMatrix:
        return self.tree_builder.matrix

    # ---- vLLM hooks -----------------------------------------------------------------
    def dummy_run(self, num_tokens: int, *args, **kwargs) -> None:
        """One forward is enough to warm the drafter up (vLLM's loops once per draft
        token, 60 times for a 60-node budget)."""
        saved = self.num_speculative_tokens
        self.num_speculative_tokens = 1
        try:
            super().dummy_run(num_tokens, *args, **kwargs)
        finally:
            self.num_speculative_tokens = saved

    def partitions(self, runner, req_ids: list[str]) -> torch.Tensor | None:
        """[B] the successor-matrix partition of each request (assigned at first sight
        from its tenant: the front end wrote it into the tenant field from the source the
        operator chose, ``graft.isolation.tenant_source``); ``None`` while every request
        reads the one matrix."""
        unnamed = self.settings.config.isolation.unnamed
        for req_id in req_ids:
            if req_id not in self.isolation.partition_of:
                extra = runner.requests[req_id].sampling_params.extra_args or {}
                tenant = extra.get(self.tenant_field)
                self.isolation.assign(req_id, None if tenant is None else str(tenant),
                                      unnamed)
        if all(self.isolation.partition_of.get(r) == 0 for r in req_ids):
            return None  # partition 0 is the table's first rows: the plain lookup
        return self.isolation.partitions(req_ids, self.device)

    def request_state_counts(self) -> dict[str, int]:
        """How many requests each per-request table holds (all zero once the batch has
        emptied: a finished, aborted or preempted request leaves nothing behind)."""
        return {"pending_trees": len(self.pending), "plain_steps": len(self.plain_steps),
                "deferred_rows": len(self.deferred),
                "context_indexes": len(self.context_indexes),
                "prompt_lengths": len(self.prompt_lengths),
                "matrix_partitions": len(self.isolation.partition_of),
                "drafter_follows": len(self.drafter_follows),
                "shadow_chains": len(self.shadows),
                "matrix_refusals": self.isolation.refusals}

    def forget(self, req_ids, finished=()) -> None:
        """Drop the state of requests that left the batch; the outputs of ``finished``
        ones feed the cross-request context index when it is on."""
        for req_id in req_ids:
            self.isolation.release(req_id)
            self.pending.pop(req_id, None)
            self.plain_steps.pop(req_id, None)
            self.deferred.pop(req_id, None)
            self.drafter_follows.pop(req_id, None)
            self.shadows.pop(req_id, None)
            index = self.context_indexes.pop(req_id, None)
            prompt_len = self.prompt_lengths.pop(req_id, 0)
            if index is not None and self.shared_context is not None and req_id in finished:
                self.shared_context.add(list(index.tokens[prompt_len:]))

    # ---- one drafting round -----------------------------------------------------------
    @torch.inference_mode()
    def propose_trees(self, runner, scheduler_output, settled: list[SettledRows],
                      aux_hidden_states: list[torch.Tensor], proposal: StepProposal) -> None:
        """Run catch-up and drafting in ``proposal.mode``; the drafts (in persistent-batch
        order), what ran and what was built go into ``proposal``."""
        req_ids = runner.input_batch.req_ids
        drafts: list[list[int]] = [[] for _ in req_ids]
        proposal.drafts = drafts
        if not settled:
            return
        uses_drafter = self.settings.config.variant.drafts  # retrieval_only does not
        drafting = [i for i, s in enumerate(settled) if s.drafts]
        catchup = None
        if uses_drafter:  # only a request about to draft a tree needs its rows fed now
            feeds = proposal.mode is StepMode.TREE
            with self.catch_up_timer.span():
                catchup = self._catch_up(runner, settled, aux_hidden_states,
                                         [feeds and s.drafts for s in settled])
        proposal.ran = proposal.mode if drafting else StepMode.PLAIN
        if not drafting:
            return
        if proposal.mode is StepMode.CHAIN:
            self._propose_chains(runner, settled, drafting, proposal)
            return
        roots = torch.tensor([settled[i].next_tokens[-1] for i in drafting], dtype=torch.long)
        expander = None
        if uses_drafter:
            fed, last_rows, last_hidden, next_hidden = catchup
            index = torch.tensor([fed[i] for i in drafting], dtype=torch.long)
            root_positions = torch.tensor(
                [settled[i].first_position + len(settled[i].rows) for i in drafting])
            batch_rows = torch.tensor([settled[i].batch_row for i in drafting],
                                      dtype=torch.long)
            expander = _TreeExpansion(
                self, root_logprobs=self._top_k(last_hidden[last_rows[index]]),
                root_hidden=None if next_hidden is None else next_hidden[last_rows[index]],
                root_positions=root_positions,
                block_tables=self._kv_layout(runner).kernel_block_table(
                    self._block_table(runner)[batch_rows.to(self.device)]))
        context = None
        if self.uses_context:
            config = self.context_config
            proposals = [self._context_index(runner, settled[i]).propose(
                max_nodes=config.max_nodes, max_depth=config.max_depth,
                max_matches=config.max_matches, shared=self.shared_context,
                lead_nodes=config.lead_nodes) for i in drafting]
            tokens, parents, depths, _ = proposals_to_tensors(
                proposals, config.max_nodes, self.device)
            context = (tokens, parents, depths)
        partitions = self.partitions(runner, [req_ids[settled[i].batch_row] for i in drafting])
        tree, stats = self.tree_builder.build(roots.to(self.device), expander, context,
                                              partitions)
        if context is not None and self.sizer is not None:  # the acceptance model's input
            tree = self._scored_by_match(tree, [p.match_length for p in proposals])
        proposal.build = stats
        if self.sizer is not None:
            tree, proposal.choice = self.sizer.trim(tree)
        # the ranks of a tensor-parallel engine verify one tree; a copy of the build's
        # (the next build reuses its buffers)
        tree = agree(tree.to("cpu"))
        stages, confidence = stats.stage.tolist(), stats.confidence.cpu().clone()
        rows = HostRows.of(tree)
        for t, i in enumerate(drafting):
            req_id = req_ids[settled[i].batch_row]
            n = self._schedule(tree, rows, t, req_id, settled[i].batch_row, drafts,
                               stages[t], confidence[t])
            if proposal.choice is not None:
                if n == 1:  # nothing worth verifying: decode plainly for a while
                    self.plain_steps[req_id] = 1
                else:
                    self.plain_steps.pop(req_id, None)

    @staticmethod
    def pass_plainly(req_ids: list[str], proposal: StepProposal) -> None:
        """:meth:`propose_trees` for a plain step when the drafter follows none of the
        step's requests: no drafts, and no drafter input to feed or defer, so the
        step's settled rows are never read."""
        proposal.drafts = [[] for _ in req_ids]

    def _schedule(self, tree, rows: HostRows, t: int, req_id: str, batch_row: int,
                  drafts: list[list[int]], stage: int = -1,
                  confidence: torch.Tensor | None = None, chain: bool = False) -> int:
        """Keep row ``t`` of the (host) ``tree`` for verification and hand its nodes to
        the scheduler as the request's draft tokens; returns its rows (root included).
        ``rows``: the tree's sizes and tokens read once for the whole batch."""
        n = rows.num_nodes[t]
        drafts[batch_row] = rows.tokens[t][1:n]
        self.pending[req_id] = PendingTree(
            tree.tokens[t, :n], tree.parents[t, :n], tree.depths[t, :n], tree.source[t, :n],
            stage, confidence, None if tree.score is None else tree.score[t, :n],
            list(drafts[batch_row]), chain)  # its own list: the scheduler gets the other
        return n

    def _scored_by_match(self, tree, match_lengths: list[int]):
        """``tree`` with its copied nodes scored by their request's context match
        (:func:`vllm_graft.core.context.match_score`), its other nodes keeping the score
        the build gave them, for the sizer's acceptance model."""
        min_ngram = self.context_config.min_ngram
        return tree.with_score(context_scores(tree.source, torch.tensor(
            [match_score(length, min_ngram) for length in match_lengths]), tree.score))

    def _propose_chains(self, runner, settled: list[SettledRows], drafting: list[int],
                        proposal: StepProposal) -> None:
        """The guard's cheap tier: a copy chain per request (:mod:`vllm_graft.core.chain`),
        no drafter forward; the chains the scout built for this batch when it ran them."""
        scouted, proposal.scouted = proposal.scouted, None
        rows = [settled[i].batch_row for i in drafting]
        if scouted is not None and scouted[0] is settled and scouted[1] == rows:
            chains, proposal.choice = scouted[2], scouted[3]
        else:
            chains, proposal.choice, trials = self._build_chains(runner, settled, drafting)
            proposal.shadow_trials += trials
        chains = agree(chains)
        drafts = proposal.drafts
        tree = chains.to_tree()
        req_ids = runner.input_batch.req_ids
        rows = HostRows([len(tokens) for tokens in chains.tokens], chains.tokens)
        nodes = 0
        for t, i in enumerate(drafting):
            req_id = req_ids[settled[i].batch_row]
            kept = self._schedule(tree, rows, t, req_id, settled[i].batch_row, drafts,
                                  chain=True) - 1
            self._mark_verified(req_id, kept)
            nodes += kept
        proposal.chains = (len(drafting), nodes)

    def _build_chains(self, runner, settled: list[SettledRows], drafting: list[int]
                      ) -> tuple[HostChains, Choice | None, int]:
        """Each drafting request's copy chain, on the host, cut by the sizer (with its
        choice) when budget "auto" is on; the whole chains teach the acceptance model
        once decoding has passed them (:meth:`_shadow_chains`: the nodes it learned from
        come third)."""
        matches = [(0, [])] * len(drafting)
        if self.uses_context:
            matches = [self._context_index(runner, settled[i]).best_match(
                self.chain_tokens, self.shared_context) for i in drafting]
        req_ids = runner.input_batch.req_ids
        matrix = self.matrix.for_batch(
            self.partitions(runner, [req_ids[settled[i].batch_row] for i in drafting]))
        min_ngram = self.context_config.min_ngram
        chains = walk_chains([settled[i].next_tokens[-1] for i in drafting],
                             [tokens for _, tokens in matches], matrix, self.chain_tokens,
                             self.chain_walk,
                             [match_score(length, min_ngram) for length, _ in matches])
        if self.sizer is None:
            return chains, None, 0
        trials = self._shadow_chains(runner, settled, drafting, chains) \
            if self.uses_context else 0
        return (*self.sizer.trim_chains(chains), trials)

    def _shadow_chains(self, runner, settled: list[SettledRows], drafting: list[int],
                       chains: HostChains) -> int:
        """Teach the chain acceptance model from chain nodes no step verified: each
        drafting request's chain of an earlier build, once decoding has emitted every
        position it proposed (:func:`vllm_graft.core.budget.copied_prefix`), past the
        nodes a chain step verified; and keep this build's whole chain (before any cut)
        for a request with none waiting. A scout's look teaches what plain steps would
        have accepted; a chain step, the odds of the nodes its cut left out, which the
        sizer would otherwise only learn by verifying them (a class once measured poor,
        or never tried, such as the matrix's walk after a copy, would stay cut). Returns
        how many chain nodes it learned from."""
        req_ids = runner.input_batch.req_ids
        outcomes = []
        for t, i in enumerate(drafting):
            req_id = req_ids[settled[i].batch_row]
            context = self.context_indexes[req_id].tokens
            waiting = self.shadows.get(req_id)
            if waiting is not None:
                end = waiting.root + 1 + len(waiting.tokens)
                if len(context) < end:
                    continue  # not every position it proposed was emitted yet
                outcomes.append(waiting.outcome(context[waiting.root + 1:end]))
            self.shadows[req_id] = ShadowChain(len(context) - 1, chains.tokens[t][1:],
                                               chains.source[t][1:], chains.score[t][1:])
        return self.sizer.chain_acceptance.observe_chains(outcomes) if outcomes else 0

    def _mark_verified(self, req_id: str, nodes: int) -> None:
        """A chain step verifies the first ``nodes`` nodes of the chain built this step
        for ``req_id``: its shadow (if chains keep shadows) leaves them to verification's
        lesson."""
        shadow = self.shadows.get(req_id)
        if shadow is not None and shadow.root == len(self.context_indexes[req_id].tokens) - 1:
            shadow.verified = nodes

    def scout_chains(self, runner, settled: list[SettledRows], plain_rate: float | None,
                     proposal: StepProposal) -> bool:
        """Whether this step, which the guard would decode plainly, should verify copy
        chains instead (:class:`vllm_graft.core.budget.ChainScout`); the chains built to
        decide go into ``proposal`` for :meth:`_propose_chains`."""
        proposal.scouted = None
        drafting = [i for i, s in enumerate(settled) if s.drafts and self.may_draft(
            runner.requests[runner.input_batch.req_ids[s.batch_row]],
            s.first_position + len(s.rows), StepMode.CHAIN)]
        if not drafting:
            return False
        chains, choice, trials = self._build_chains(runner, settled, drafting)
        proposal.shadow_trials += trials
        if not self.scout.promising(self.predicted_credit(choice, len(settled)),
                                    choice.step_ms, plain_rate):
            return False
        proposal.scouted = (settled, [settled[i].batch_row for i in drafting], chains, choice)
        return True

    def predicted_credit(self, choice: Choice, batch: int) -> float:
        """The tokens the throughput guard will credit a chain step of ``batch`` requests
        with, as ``choice`` predicts them: the median request's times the batch
        (:meth:`ThroughputGuard.credited_tokens`), not the requests' sum. Predicting
        the sum, the scout fired on a batch where a few requests copied and the median
        one could gain nothing: one chain step a run on gsm8k at batch 32, at 1.5 plain
        steps' time, each emitting one token for most requests (a 2-core CPU). A choice
        that kept no tokens per request (a tree's) is predicted by its sum."""
        if choice.request_tokens is None:
            return choice.step_tokens(batch)
        return self.guard.credited_tokens(choice.tokens_by_request(batch))

    #: with budget "auto", a request whose tree was cut to nothing skips drafting (the
    #: drafter's cost with it) and tries again after this many plain steps
    REPROBE_STEPS = 8

    def admit(self, req_states, trees_in_reach: bool) -> None:
        """Decide, for each request seen for the first time, whether the drafter reads
        its positions, for its whole life: not when the throughput guard had measured
        trees well below the fastest mode at the batch size it arrived in
        (``trees_in_reach`` false), nor when the request's options forbid speculation
        for its whole life (:func:`speculates_ever`). The drafter's pass over such a
        request's prompt, the projection of its rows and their deferral would serve
        only trees, which it then never drafts (copy chains and plain decoding need no
        drafter). The runner admits a round's requests before anything asks
        :meth:`follows`."""
        for req_state in req_states:
            if req_state.req_id not in self.drafter_follows:
                self.drafter_follows[req_state.req_id] = self._would_follow(
                    req_state, trees_in_reach)

    def follows(self, req_state) -> bool:
        """Whether the drafter reads this request's positions (decided by :meth:`admit`)."""
        return self.drafter_follows[req_state.req_id]

    def would_follow_any(self, req_states, trees_in_reach: bool) -> bool:
        """Whether the drafter follows (or, at first sight, would follow) any of
        ``req_states``: without one, no request can draft a tree this step."""
        return any(self._would_follow(state, trees_in_reach) for state in req_states)

    def _would_follow(self, req_state, trees_in_reach: bool) -> bool:
        """:meth:`follows` as it is, or at first sight would be, decided with
        ``trees_in_reach``."""
        follows = self.drafter_follows.get(req_state.req_id)
        if follows is None:
            return trees_in_reach and speculates_ever(req_state)
        return follows

    def unavailable_modes(self, req_states, trees_in_reach: bool) -> tuple[StepMode, ...]:
        """The speculative modes no request of the batch can draft in this step: trees
        without a request that the drafter follows and whose options allow drafting
        now, chains without any such request. A mode the guard chose that drafts
        nothing runs as plain decoding and measures nothing of its own, so its first
        probe would be asked for at every step."""
        now = [state for state in req_states if speculates_now(state)]
        if not now:
            return StepMode.TREE, StepMode.CHAIN
        if not any(self._would_follow(state, trees_in_reach) for state in now):
            return (StepMode.TREE,)
        return ()

    #: :meth:`drafting_obstacle` of a request waiting after its tree was cut to nothing
    WAITING = "waiting after a tree cut to nothing"

    def may_draft(self, req_state, root_position: int, mode: StepMode) -> bool:
        """Whether the request may draft in a step of ``mode`` (no obstacle)."""
        return self.drafting_obstacle(req_state, root_position, mode) is None

    def drafting_obstacle(self, req_state, root_position: int, mode: StepMode) -> str | None:
        """Why the request may not draft in a step of ``mode``, or None: no mode drafts
        while the throughput guard decodes plainly; a tree needs a request the drafter
        follows; the drafts (and the drafter's rows) must fit in the context; a request
        whose last tree budget "auto" found not worth verifying waits
        (:data:`WAITING`: the runner counts its waits with :meth:`wait_a_step`); a
        request whose options depend on earlier tokens is decoded plainly."""
        config = self.settings.config
        if mode is StepMode.PLAIN:
            return "plain step"
        if mode is StepMode.TREE and not self.follows(req_state):
            return "not followed"
        if root_position + max(config.budget, config.max_depth, self.chain_tokens) + 1 \
                > self.max_model_len:
            return "context"
        plain = self.plain_steps.get(req_state.req_id)
        if mode is StepMode.TREE and plain is not None and plain < self.REPROBE_STEPS:
            return self.WAITING
        return None if speculates_now(req_state) else "options"

    def wait_a_step(self, req_id: str) -> None:
        """A waiting request (:data:`WAITING`) sat out one more tree step."""
        self.plain_steps[req_id] += 1

    #: context positions a request's index takes in per step at most: a long prompt is
    #: indexed over several steps (a 128K-token one over 64, each a few ms on a 2-core
    #: CPU, where indexing it at once stalled every stream's step for about 1 s)
    CONTEXT_INDEX_STEP = 2048

    def _context_index(self, runner, settled: SettledRows) -> ContextIndex:
        """The request's context index, holding its context up to the last settled token
        (the source of its copied continuations). The context grows by the positions
        settled since the last call: everything up to this step's first position is
        final in the runner's token table, the rest is ``next_tokens``. The index takes
        in at most :data:`CONTEXT_INDEX_STEP` of the positions not yet indexed per
        step, newest first (:meth:`ContextIndex.catch_up`); until it has caught up it
        proposes from the part indexed (copies are only proposals: verification keeps
        the output plain decoding's). A rewound history is cut back where it still
        agrees with the runner's table, not rebuilt."""
        req_id = runner.input_batch.req_ids[settled.batch_row]
        index = self.context_indexes.get(req_id)
        first, next_tokens = settled.first_position, settled.next_tokens
        if index is not None and len(index) > first + 1:  # asked again, or rewound
            if index.tokens[first] != settled.first_token:
                index = None  # not this history: start again
            elif index.tokens[first + 1:] == next_tokens:
                return index  # this step's positions are in already
            else:
                index.truncate(first + 1)
        if index is None:
            config = self.context_config
            index = ContextIndex(min_ngram=config.min_ngram, max_ngram=config.max_ngram)
            self.context_indexes[req_id] = index
            self.prompt_lengths[req_id] = runner.requests[req_id].num_prompt_tokens
        if len(index) <= first:
            index.append(runner.input_batch.token_ids_cpu[settled.batch_row,
                                                          len(index):first + 1])
        index.append(next_tokens)
        index.catch_up(self.CONTEXT_INDEX_STEP)
        return index

    @staticmethod
    def _kv_layout(runner):
        return runner._graft_kv_layout

    def _block_table(self, runner) -> torch.Tensor:
        """Manager block ids of the persistent batch (the target's and drafter's group)."""
        return self._kv_layout(runner).block_table(runner)

    #: positions per request whose drafter inputs wait while it does not draft;
    #: older ones are dropped (the drafter's cache keeps stale entries there, which can
    #: only cost acceptance, never correctness)
    MAX_DEFERRED = 64

    def _target_rows(self, settled: list[SettledRows], indices: list[int],
                     aux_hidden_states: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """The target's hidden rows of the ``settled`` requests at ``indices``, copied
        into one tensor and split per request."""
        if not indices:
            return {}
        rows = torch.tensor([r for i in indices for r in settled[i].rows],
                            dtype=torch.long, device=self.device)
        target_hidden = torch.cat([h[rows] for h in aux_hidden_states], dim=-1) \
            if self.eagle3_use_aux_hidden_state else aux_hidden_states[-1][rows]
        return dict(zip(indices, target_hidden.split([len(settled[i].rows)
                                                      for i in indices])))

    def _catch_up(self, runner, settled: list[SettledRows],
                  aux_hidden_states: list[torch.Tensor], feeds: list[bool]):
        """Causal drafter forward over the settled positions of the requests that
        ``feeds`` names (each with the rows kept for it since its last feed) and over
        prefill chunks; the decode rows of every other request are kept for later
        (:class:`DeferredRows`): a request decoded plainly, or by a copy chain, costs no
        drafter forward. Returns None when nothing was fed, else (the catch-up batch
        index of each fed request by its index in ``settled``, last row of each fed
        request in the catch-up batch, hidden for logits, hidden for the next step)."""
        req_ids = runner.input_batch.req_ids
        followed = [i for i, s in enumerate(settled)
                    if self.follows(runner.requests[req_ids[s.batch_row]])]
        per_request = {i: self._catch_up_inputs(settled[i]) for i in followed}
        hidden_rows: dict[int, torch.Tensor | None] = dict.fromkeys(followed)
        if self.USES_HIDDEN and followed:
            # the target's rows as they are (a copy: vLLM reuses its buffers); the
            # drafter's projection of them runs when they are fed (:meth:`_feed`), so a
            # row deferred by a plain or chain step costs no matrix product. Rows to be
            # kept get a copy of their own: kept as views of the step's copy, a
            # request's one row would hold every prompt chunk fed beside it in memory
            # for as long as the request keeps its rows (up to MAX_DEFERRED steps)
            kept = [i for i in followed if not feeds[i] and settled[i].decoding]
            fed = [i for i in followed if feeds[i] or not settled[i].decoding]
            for group in (kept, fed):
                hidden_rows.update(self._target_rows(settled, group, aux_hidden_states))
        now: list[tuple[int, tuple]] = []  # (index in settled, rows fed now)
        for i in followed:
            s, (tokens, positions), hidden = settled[i], per_request[i], hidden_rows[i]
            req_id = req_ids[s.batch_row]
            if feeds[i]:
                entry = self.deferred.pop(req_id, None)
                if entry is not None:
                    entry.append(tokens, positions, hidden, self.MAX_DEFERRED + len(positions))
                    tokens, positions, hidden = entry.tokens, entry.positions, entry.hidden
                now.append((i, (tokens, positions, hidden)))
            elif s.decoding:  # a decode step, its chain's accepted rows too: wait for the
                # request's next tree
                self.deferred.setdefault(req_id, DeferredRows([], [])).append(
                    tokens, positions, hidden, self.MAX_DEFERRED)
            else:  # a prefill chunk is fed at once: the prompt's drafter KV stays whole
                now.append((i, (tokens, positions, hidden)))
        if not now:
            return None
        fed = {i: k for k, (i, _) in enumerate(now)}
        return (fed, *self._feed(runner, [settled[i] for i, _ in now], [x for _, x in now]))

    def _feed(self, runner, settled: list[SettledRows], inputs: list[tuple]):
        """One drafter forward over each request's (tokens, positions, hidden) rows."""
        per_request = [(tokens, positions) for tokens, positions, _ in inputs]
        counts = np.array([len(tokens) for tokens, _ in per_request], dtype=np.int32)
        input_ids = torch.tensor([t for tokens, _ in per_request for t in tokens],
                                 dtype=torch.int32, device=self.device)
        positions = torch.tensor([p for _, pos in per_request for p in pos],
                                 dtype=torch.long, device=self.device)
        hidden = None
        if self.USES_HIDDEN:
            hidden = self.model.combine_hidden_states(torch.cat([h for _, _, h in inputs]))

        batch_rows = torch.tensor([s.batch_row for s in settled], dtype=torch.long)
        block_table = self._block_table(runner)[batch_rows.to(self.device)]
        req_of_row = torch.from_numpy(np.repeat(np.arange(len(settled)), counts)).to(self.device)
        slot_mapping = self._kv_layout(runner).slots(
            block_table[req_of_row], positions.unsqueeze(-1)).squeeze(-1)
        query_start = np.zeros(len(settled) + 1, dtype=np.int32)
        np.cumsum(counts, out=query_start[1:])
        seq_lens = np.array([pos[-1] + 1 for _, pos in per_request], dtype=np.int32)
        common = CommonAttentionMetadata(
            query_start_loc=torch.from_numpy(query_start).to(self.device),
            query_start_loc_cpu=torch.from_numpy(query_start),
            seq_lens=torch.from_numpy(seq_lens).to(self.device),
            num_reqs=len(settled),
            num_actual_tokens=int(counts.sum()),
            max_query_len=int(counts.max()),
            max_seq_len=int(seq_lens.max()),
            block_table_tensor=block_table,
            slot_mapping=slot_mapping,
            causal=True,
            positions=positions,
            seq_lens_cpu_upper_bound=torch.from_numpy(seq_lens),
        )
        metadata = {}
        for group in self.draft_attn_groups:
            built = group.build_metadata_for_drafting(common, draft_index=0)
            for name in group.layer_names:
                metadata[name] = built
        with self.forward_timer.span(), set_forward_context(
                metadata, self.vllm_config, num_tokens=int(counts.sum()),
                slot_mapping={name: slot_mapping for name in self._draft_attn_layer_names}):
            last_hidden, next_hidden = self._forward(input_ids, positions, hidden)
        last_rows = torch.from_numpy(query_start[1:].astype(np.int64) - 1).to(self.device)
        return last_rows, last_hidden, next_hidden

    def _top_k_of_logits(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return logits.float().log_softmax(dim=-1).topk(self.settings.config.draft_top_k,
                                                        dim=-1)


class GraftProposer(GraftTreeDrafting, EagleProposer):
    """EAGLE-3 head + successor matrix -> one hybrid tree per request per step.

    EAGLE reads token ``p + 1`` with the target's hidden state at ``p``: the catch-up
    row of position ``p`` carries the next token, and a tree node of depth ``d`` is fed
    at ``root + d - 1`` with its parent row's pre-norm output."""

    EXPANSION_OFFSET = -1
    PREFIX_EXTRA = 0
    USES_HIDDEN = True

    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner)
        self._init_graft(vllm_config, device)

    def _catch_up_inputs(self, settled: SettledRows) -> tuple[list[int], list[int]]:
        first = settled.first_position
        return settled.next_tokens, list(range(first, first + len(settled.rows)))

    def _forward(self, input_ids, positions, hidden):
        return self.model(input_ids=input_ids, positions=positions, hidden_states=hidden,
                          inputs_embeds=None)

    def _top_k(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k over the head's (reduced) vocabulary, ids mapped to the target's."""
        values, ids = self._top_k_of_logits(
            self.model.logits_processor(self.model.lm_head, hidden))
        offsets = getattr(self.model, "draft_id_to_target_id", None)
        if offsets is not None:
            ids = ids + offsets[ids]
        return values, ids


class GraftDraftModelProposer(GraftTreeDrafting, DraftModelProposer):
    """An ordinary draft model (same tokenizer as the target) drafting Graft trees.

    It reads token ``p`` at position ``p``: the catch-up feeds the tokens of the settled
    positions shifted by one (the new root included, the very first position added for
    a fresh prompt), and a tree node of depth ``d`` is fed at ``root + d``."""

    EXPANSION_OFFSET = 0
    PREFIX_EXTRA = 1
    USES_HIDDEN = False

    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner)
        if self.use_heterogeneous_vocab:
            raise ValueError("Graft's draft model must share the target's vocabulary")
        self._init_graft(vllm_config, device)

    def _catch_up_inputs(self, settled: SettledRows) -> tuple[list[int], list[int]]:
        # The first settled position is fed again: after a fresh prompt, a prefix-cache
        # hit or a resume the drafter has not seen it; otherwise it rewrites equal KV.
        first = settled.first_position
        tokens = [settled.first_token, *settled.next_tokens]
        return tokens, list(range(first, first + 1 + len(settled.rows)))

    def _forward(self, input_ids, positions, hidden):
        return self.model(input_ids=input_ids, positions=positions, inputs_embeds=None), None

    def _top_k(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._top_k_of_logits(self.model.compute_logits(hidden))


class GraftDFlashProposer(GraftTreeDrafting, DFlashProposer):
    """vLLM's DFlash block drafter under Graft-TAIL (``"drafter": "dflash"``, variant
    ``tail``).

    vLLM prepares and runs DFlash as usual: one forward proposes a block of ``budget``
    tokens per request. Its sampling keeps each block token's log-probability, and
    :meth:`graft_blocks` keeps each block's confident prefix (cumulative confidence
    against the calibrated thresholds) and continues it with the successor matrix's
    top-1 walk, padded to the block's length. The chains are verified with the
    target's causal attention and Graft's lossless acceptance, and every verified row
    teaches the matrix, as for Graft's own chains."""

    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner)
        if self.use_heterogeneous_vocab:
            raise ValueError("Graft's DFlash drafter must share the target's vocabulary")
        self._init_graft(vllm_config, device)
        self.block_logprobs: torch.Tensor | None = None

    def dummy_run(self, *args, **kwargs) -> None:
        """DFlash's own: its one forward already covers the whole block."""
        return DFlashProposer.dummy_run(self, *args, **kwargs)

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        """Greedy block tokens, and each one's log-probability (what Graft-TAIL gates);
        drafts are deterministic, so Graft's acceptance is exact for sampled requests."""
        logprobs = self.model.compute_logits(hidden_states).float().log_softmax(dim=-1)
        values, ids = logprobs.max(dim=-1)
        self.block_logprobs = values
        return ids, None

    @torch.inference_mode()
    def graft_blocks(self, runner, blocks: torch.Tensor, sampled_token_ids: torch.Tensor
                     ) -> tuple[list[list[int]], BuildStats | None]:
        """Graft-TAIL chains from this step's DFlash blocks: drafts in persistent-batch
        order (none for requests that decode plainly), and the build's facts (None: no
        chain built)."""
        req_ids = runner.input_batch.req_ids
        drafts: list[list[int]] = [[] for _ in req_ids]
        batch, length = blocks.shape
        if length != self.settings.config.budget:  # vLLM asked for another block size
            logger.warning("Graft: DFlash proposed blocks of %d tokens, not %d: decoding "
                           "plainly this step", length, self.settings.config.budget)
            return drafts, None
        sampled = sampled_token_ids[:batch].cpu()
        valid = (sampled >= 0).sum(1)
        rows = []
        for row in range(batch):
            req_state = runner.requests[req_ids[row]]
            if valid[row] == 0 or runner.discard_request_mask.np[row] or plain_decoding_reason(
                    req_state.sampling_params, len(req_state.output_token_ids)) is not None:
                continue
            rows.append(row)
        if not rows:
            return drafts, None
        index = torch.tensor(rows, dtype=torch.long)
        roots = sampled[index, valid[index] - 1].long()
        device_index = index.to(blocks.device)
        logprobs = self.block_logprobs.view(batch, length)[device_index]
        chain, stats = self.tree_builder.build_from_block(
            roots.to(self.device), blocks[device_index], logprobs,
            self.partitions(runner, [req_ids[row] for row in rows]))
        chain = agree(chain.to("cpu"))  # the ranks of a tensor-parallel engine verify one
        stages, confidence = stats.stage.tolist(), stats.confidence.cpu()
        host_rows = HostRows.of(chain)
        for t, row in enumerate(rows):
            self._schedule(chain, host_rows, t, req_ids[row], row, drafts, stages[t],
                           confidence[t], chain=True)
        return drafts, stats


class _TreeExpansion:
    """The drafter callback of :class:`GraftTreeBuilder` for one round (see module doc).

    Keeps, for every expanded node (a pool slot), the row of its forward in the
    drafter's K/V store and (EAGLE) its pre-norm output, which its children take as
    their hidden input.
    """

    def __init__(self, proposer: GraftTreeDrafting, *, root_logprobs, root_hidden,
                 root_positions: torch.Tensor, block_tables: torch.Tensor):
        self.proposer = proposer
        self.root_logprobs = root_logprobs  # ([D, top_k], [D, top_k])
        self.root_hidden = root_hidden  # [D, H], None for drafters without hidden input
        self.root_positions = root_positions.to(proposer.device)  # [D]
        self.root_positions_host = root_positions.tolist()  # read per request, no sync
        self.block_tables = block_tables  # [D, max_blocks]
        self.store = TreeKVStore()
        self.hidden_rows: list[torch.Tensor] = []  # pre-norm outputs, store row order
        self.row_of_slot: torch.Tensor | None = None  # [D, pool] store row or -1
        self.expanded: list[torch.Tensor] = []  # per step: [D, W] expanded slots

    def __call__(self, step: DraftStep) -> tuple[torch.Tensor, torch.Tensor]:
        if step.step == 0:
            values, ids = self.root_logprobs
            return values[step.active].unsqueeze(1), ids[step.active].unsqueeze(1)
        return self._expand(step)

    def _expand(self, step: DraftStep) -> tuple[torch.Tensor, torch.Tensor]:
        proposer = self.proposer
        device = proposer.device
        active, slots = step.active, step.node_ids  # [A], [A, W]
        num_active, width = slots.shape
        pool = step.pool
        if self.row_of_slot is None:
            self.row_of_slot = torch.full(pool.tokens.shape, -1, dtype=torch.long, device=device)
        parents = pool.parents[active].gather(1, slots)  # [A, W]
        depths = pool.depths[active].gather(1, slots)
        tokens = step.tokens.clamp(min=0)
        positions = (self.root_positions[active].unsqueeze(1) + depths
                     + proposer.EXPANSION_OFFSET).reshape(-1)

        hidden = None
        if self.root_hidden is not None:
            # hidden input: the pre-norm output of the row that proposed each node
            parent_rows = torch.where(
                parents >= 0, self.row_of_slot[active].gather(1, parents.clamp(min=0)), -1)
            hidden = self.root_hidden[active].unsqueeze(1).expand(-1, width, -1).clone()
            if self.hidden_rows:
                all_hidden = torch.cat(self.hidden_rows)
                has = parent_rows >= 0
                hidden[has] = all_hidden[parent_rows[has]]
            hidden = hidden.reshape(num_active * width, -1)

        # context: this request's earlier expansion rows that are ancestors of the node
        first_new_row = self.store.num_rows
        plans = []
        # nodes expanded at step s sit at depth s: the ancestor walk needs no device read
        ancestors = ancestor_ids(pool.parents[active], slots, step.step)
        for a, b in enumerate(active.tolist()):  # one device read per draft step
            if self.expanded:
                ctx_slots = torch.cat([e[b] for e in self.expanded])  # [C]
                ctx_rows = self.row_of_slot[b, ctx_slots]
                visible_ctx = (ancestors[a].unsqueeze(-1) == ctx_slots).any(dim=1)  # [W, C]
            else:
                ctx_rows = torch.empty(0, dtype=torch.long, device=device)
                visible_ctx = torch.zeros((width, 0), dtype=torch.bool, device=device)
            mask = torch.cat([visible_ctx, torch.eye(width, dtype=torch.bool, device=device)], 1)
            plans.append(TreeRequestPlan(
                query_start=a * width, num_rows=width,
                prefix_len=self.root_positions_host[b] + proposer.PREFIX_EXTRA,
                block_table=self.block_tables[b],
                mask=mask, context_rows=ctx_rows))
        plan = TreeAttentionPlan(requests=plans, store=self.store, replace_all=True,
                                 store_rows=torch.arange(num_active * width, device=device))
        with proposer.forward_timer.span(), active_plan(plan), set_forward_context(
                {name: None for name in proposer._draft_attn_layer_names},
                proposer.vllm_config, num_tokens=num_active * width, slot_mapping={}):
            last_hidden, next_hidden = proposer._forward(
                tokens.reshape(-1).to(torch.int32), positions, hidden)
        self.store.num_rows += num_active * width
        if next_hidden is not None:
            self.hidden_rows.append(next_hidden)
        new_rows = torch.arange(first_new_row, first_new_row + num_active * width,
                                device=device).view(num_active, width)
        self.row_of_slot[active.unsqueeze(1), slots] = new_rows
        expanded = torch.full((self.row_of_slot.shape[0], width), -1, dtype=torch.long,
                              device=device)
        expanded[active] = slots
        self.expanded.append(expanded)
        values, ids = proposer._top_k(last_hidden)
        k = values.shape[-1]
        return values.view(num_active, width, k), ids.view(num_active, width, k)
