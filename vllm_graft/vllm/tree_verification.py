"""The records of a runner step's tree verification and its two ends around acceptance.

Before the target forward, :func:`prepare_tree_verification` recognises the requests
whose scheduled drafts are the tree Graft proposed last step, gives each tree row the
position ``prefix + depth`` (after vLLM computed slots from the linear positions, so
every row keeps its own KV slot), and builds the tree attention plan. A tree that is a
chain (every node the child of the row before it, as a trimmed tree of copied context
often is) needs no plan: the backend's own causal attention is its tree attention, and
its accepted rows already sit in their final slots. After acceptance,
:func:`move_accepted_kv` moves the accepted rows' KV into contiguous slots.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from vllm_graft.core.acceptance import AcceptanceResult
from vllm_graft.core.hybrid import ancestor_mask
from vllm_graft.step_clock import Spans, SpanTimer, StepClock
from vllm_graft.vllm.draft_records import PendingTree
from vllm_graft.vllm.proposer import GraftProposer
from vllm_graft.vllm.tree_attention import (TreeAttentionPlan, TreeRequestPlan, kv_reader,
                                            read_slots)


#: Callbacks ``observer(tree: VerifiedTree, accepted_rows: list[int])`` called in the
#: worker after every tree verification (calibration records trees this way).
TREE_OBSERVERS: list = []


@dataclass
class VerifiedTree:
    req_id: str
    batch_row: int
    query_start: int  # first row (the root) in the flattened batch
    prefix_len: int  # position of the root
    tree: PendingTree  # truncated to the scheduled rows
    chain: bool = False  # every row the child of the row before (no tree attention)


@dataclass
class GraftStep:
    """One runner step's tree verification."""

    trees: list[VerifiedTree]
    plan: TreeAttentionPlan | None
    result: AcceptanceResult | None = None  # rows follow the persistent batch
    num_tokens: int = 0  # query tokens of the step's forward
    #: times the forward with budget "auto" (CUDA events on a GPU: no synchronisation)
    forward_timer: SpanTimer | None = None
    #: a Graft hook of this step failed: the step decodes plainly (vllm_graft.vllm.faults)
    failed: bool = False

    def take_forward(self) -> Spans | None:
        """The forward's span, once (None: not timed), to read once it has passed."""
        timer, self.forward_timer = self.forward_timer, None
        return None if timer is None else timer.take()


@dataclass
class GraftStats:
    """Counters accumulated by the worker and shipped with each ModelRunnerOutput.
    Times are in microseconds (``*_us``): bookkeeping (Graft's own work outside model
    forwards), draft-head forwards, and the tree-row attention recomputation."""

    counts: Counter = field(default_factory=Counter)

    def take(self) -> dict[str, int]:
        out = dict(self.counts)
        self.counts.clear()
        return out

    def add_seconds(self, name: str, seconds: float) -> None:
        self.counts[f"{name}_us"] += int(seconds * 1e6)


def prepare_tree_verification(runner, scheduler_output) -> GraftStep:
    if not scheduler_output.scheduled_spec_decode_tokens:
        # no drafts: nothing to verify, so nothing to time
        return _prepare_tree_verification(runner, scheduler_output)
    clock: StepClock = runner._graft_clock
    start = clock.mark()
    try:
        return _prepare_tree_verification(runner, scheduler_output)
    finally:
        clock.phase(lambda seconds: runner._graft_stats.add_seconds("bookkeeping", seconds),
                    start)


def _prepare_tree_verification(runner, scheduler_output) -> GraftStep:
    proposer: GraftProposer = runner.drafter
    batch = runner.input_batch
    trees: list[VerifiedTree] = []
    for row, req_id in enumerate(batch.req_ids):
        drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
        pending = proposer.pending.pop(req_id, None)
        if not drafts or pending is None:
            continue
        rows = len(drafts) + 1
        if rows > len(pending.draft_tokens) + 1 or pending.draft_tokens[:rows - 1] != list(drafts):
            continue  # not our tree (e.g. padding after a resume): plain rejection of all
        tree = pending.truncated(rows)
        trees.append(VerifiedTree(
            req_id=req_id, batch_row=row,
            query_start=int(runner.query_start_loc.np[row]),
            prefix_len=int(batch.num_computed_tokens_cpu[row]),
            tree=tree, chain=tree.chain or is_chain(tree.parents)))
    if not trees:
        return GraftStep(trees=[], plan=None)

    branching = [t for t in trees if not t.chain]
    if not branching:
        return GraftStep(trees=trees, plan=None)
    layout = runner._graft_kv_layout
    block_table = layout.kernel_block_table(layout.block_table(runner))
    masks = tree_masks([t.tree for t in branching])
    # the tree rows' positions, written in one copy and one scatter whatever the batch
    rows = torch.cat([torch.arange(t.query_start, t.query_start + t.tree.tokens.numel())
                      for t in branching])
    depths = torch.cat([t.prefix_len + t.tree.depths for t in branching])
    positions = runner.positions
    positions[rows.to(positions.device)] = depths.to(positions.device, positions.dtype)
    requests = [TreeRequestPlan(query_start=t.query_start, num_rows=t.tree.tokens.numel(),
                                prefix_len=t.prefix_len, block_table=block_table[t.batch_row],
                                mask=mask)
                for t, mask in zip(branching, masks)]
    # when tree rows are all the step computes, the backend's own (causal) attention
    # over them would be thrown away: the plan then replaces it
    every_row = sum(r.num_rows for r in requests) == scheduler_output.total_num_scheduled_tokens
    return GraftStep(trees=trees, plan=TreeAttentionPlan(requests=requests,
                                                         replace_all=every_row))


def tree_masks(trees) -> list[torch.Tensor]:
    """Each flattened host tree's ``[N, N]`` ancestor mask (row sees itself and its
    ancestors), on the host, built for all of them at once: the attention plan copies
    them to the device packed, in one copy (:meth:`KernelBatch.from_plan`)."""
    sizes = [tree.tokens.numel() for tree in trees]
    parents = torch.nn.utils.rnn.pad_sequence([tree.parents.long() for tree in trees],
                                              batch_first=True, padding_value=-1)
    valid = torch.arange(max(sizes)) < torch.tensor(sizes).unsqueeze(1)
    depth = max(int(tree.depths.max()) for tree in trees)
    masks = ancestor_mask(parents, valid, depth)
    return [mask[:n, :n] for mask, n in zip(masks, sizes)]


def is_chain(parents: torch.Tensor) -> bool:
    """Whether a flattened tree (host tensor, root first) is a chain: row ``i``'s parent
    is row ``i - 1`` for every node."""
    return bool(torch.equal(parents[1:], torch.arange(parents.numel() - 1)))


def move_accepted_kv(runner, step: GraftStep, result: AcceptanceResult) -> None:
    """Copy the accepted rows' K/V to positions ``prefix + 1 .. prefix + L`` in every
    target layer, so the cache is what a chain of the same tokens would have left; RoPE
    already used those positions. vLLM wrote tree row ``r``'s K/V at the slot of position
    ``prefix + r``. In each layer all sources are read before any destination is
    written, since a destination may be another accepted row's source.
    ``result`` is the host copy (:func:`vllm_graft.vllm.tree_sampling.to_host`)."""
    requests, sources, destinations = [], [], []
    for verified in step.trees:
        count = int(result.num_accepted[verified.batch_row])
        if count and not verified.chain:  # a chain's rows are in place
            requests.append(torch.full((count,), verified.batch_row))
            sources.append(verified.prefix_len + result.accepted_rows[verified.batch_row, :count])
            destinations.append(verified.prefix_len + torch.arange(1, count + 1))
    if not requests:
        return
    layout = runner._graft_kv_layout
    table = layout.block_table(runner)
    device = table.device
    tables = table[torch.cat(requests).to(device)]
    src = layout.slots(tables, torch.cat(sources).to(device).unsqueeze(-1)).squeeze(-1)
    dst = layout.slots(tables, torch.cat(destinations).to(device).unsqueeze(-1)).squeeze(-1)
    for layer in step.plan.layers.values():
        reader = kv_reader(layer.impl, layer, layer.kv_cache)
        keys, values = read_slots(reader, layer.kv_cache, src)
        layer.impl.do_kv_cache_update(layer, keys, values, layer.kv_cache, dst)

