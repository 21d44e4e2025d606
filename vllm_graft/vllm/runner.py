"""Tree verification inside vLLM's V1 model runner.

The patches in :mod:`vllm_graft.vllm.patches` call into this module at four points of
a runner step:

* after ``_prepare_inputs``: :func:`prepare_tree_verification` recognises the requests
  whose scheduled drafts are the tree Graft proposed last step, gives each tree row the
  position ``prefix + depth`` (after vLLM computed slots from the linear positions, so
  every row keeps its own KV slot), and builds the tree attention plan. A tree that is
  a chain (every node the child of the row before it, as a trimmed tree of copied
  context often is) needs no plan: the backend's own causal attention is its tree
  attention, and its accepted rows already sit in their final slots;
* around the target forward (the ``_model_forward`` patch): the plan is active;
* instead of the rejection sampler: :func:`sample_with_trees` runs lossless tree
  acceptance, moves the accepted rows' KV into contiguous slots in every layer, and
  lets every verified row teach the successor matrix;
* instead of the EAGLE drafting call: :func:`propose_with_trees`.

The output keeps vLLM's contract: ``[batch, max_len]`` sampled ids padded with -1, so
the scheduler rolls back exactly the rejected rows.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from torch.nn.utils.rnn import pad_sequence
from vllm.v1.outputs import SamplerOutput

from vllm_graft import ops
from vllm_graft.core.acceptance import (AcceptanceResult, greedy_chain_walk,
                                        greedy_chain_walk_lists, greedy_walk,
                                        walk_tree)
from vllm_graft.core.budget import UNKNOWN_SCORE
from vllm_graft.core.config import StepMode
from vllm_graft.core.graft import accepted_by_source, count_accepted_sources
from vllm_graft.core.hybrid import SOURCE_PAD, HybridTree, ancestor_mask
from vllm_graft.vllm.proposal import StepProposal, last_proposal
from vllm_graft.vllm.proposer import GraftProposer, PendingTree, SettledRows
from vllm_graft.vllm.sampling import argmax_is_the_sample, filters_are_plain_sampling
from vllm_graft.vllm.tp_agreement import agree
from vllm_graft.vllm.timing import SpanTimer, device_clock
from vllm_graft.vllm.tree_attention import (TreeAttentionPlan, TreeRequestPlan, kv_reader,
                                            read_slots)


logger = logging.getLogger(__name__)

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

    def take_forward_ms(self) -> float | None:
        """The forward's time in ms, once (None: not timed); call it after a
        :func:`device_clock`, so the device has finished the forward."""
        timer, self.forward_timer = self.forward_timer, None
        return None if timer is None else timer.take_seconds() * 1e3


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
        # no drafts: nothing to verify, so nothing to time (the device clock syncs a GPU)
        return _prepare_tree_verification(runner, scheduler_output)
    start = device_clock(runner.device)
    try:
        return _prepare_tree_verification(runner, scheduler_output)
    finally:
        runner._graft_stats.add_seconds("bookkeeping", device_clock(runner.device) - start)


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
    requests = []
    for t in branching:
        n = t.tree.tokens.numel()
        rows = torch.arange(t.query_start, t.query_start + n, device=runner.positions.device)
        runner.positions[rows] = t.prefix_len + t.tree.depths.to(runner.positions.device)
        mask = ancestor_mask(t.tree.parents.view(1, -1), torch.ones(1, n, dtype=torch.bool),
                             int(t.tree.depths.max()))[0]
        requests.append(TreeRequestPlan(
            query_start=t.query_start, num_rows=n, prefix_len=t.prefix_len,
            block_table=block_table[t.batch_row], mask=mask.to(runner.device)))
    # when tree rows are all the step computes, the backend's own (causal) attention
    # over them would be thrown away: the plan then replaces it
    every_row = sum(r.num_rows for r in requests) == scheduler_output.total_num_scheduled_tokens
    return GraftStep(trees=trees, plan=TreeAttentionPlan(requests=requests,
                                                         replace_all=every_row))


def is_chain(parents: torch.Tensor) -> bool:
    """Whether a flattened tree (host tensor, root first) is a chain: row ``i``'s parent
    is row ``i - 1`` for every node."""
    return bool(torch.equal(parents[1:], torch.arange(parents.numel() - 1)))


def _batch_trees(trees: list[VerifiedTree], batch: int) -> HybridTree:
    """One tree per request of the persistent batch, on the host: the verified trees,
    and a bare root for every other request (it emits one token and stops)."""
    rows = max([1] + [t.tree.tokens.numel() for t in trees])
    tokens = torch.full((batch, rows), -1, dtype=torch.long)
    parents = torch.full((batch, rows), -1, dtype=torch.long)
    depths = torch.zeros((batch, rows), dtype=torch.long)
    source = torch.zeros((batch, rows), dtype=torch.uint8)
    scored = [t for t in trees if t.tree.score is not None]
    score = torch.full((batch, rows), UNKNOWN_SCORE) if scored else None
    tokens[:, 0] = 0  # the root token itself is never matched

    def place(out: torch.Tensor, among: list[VerifiedTree], name: str, fill) -> None:
        # one padded copy of every tree's rows, not one copy per tree and field
        padded = pad_sequence([getattr(t.tree, name) for t in among], batch_first=True,
                              padding_value=fill)
        out[[t.batch_row for t in among], :padded.shape[1]] = padded.to(out.dtype)

    if trees:
        place(tokens, trees, "tokens", -1)
        place(parents, trees, "parents", -1)
        place(depths, trees, "depths", 0)
        place(source, trees, "source", 0)
    if scored:
        place(score, scored, "score", UNKNOWN_SCORE)
    valid = tokens >= 0
    return HybridTree(tokens=tokens, parents=parents, depths=depths, valid=valid,
                      source=source, num_nodes=valid.sum(1),
                      score=score)


def _to_host(result: AcceptanceResult) -> AcceptanceResult:
    """The acceptance result on the host, read once per step: every per-request loop
    after acceptance uses this copy, so the device is synchronised a fixed number of
    times per step rather than once per request."""
    return AcceptanceResult(accepted_rows=result.accepted_rows.cpu(),
                            output_tokens=result.output_tokens.cpu(),
                            num_accepted=result.num_accepted.cpu())


@contextlib.contextmanager
def _frozen_generators(generators: dict[int, torch.Generator], rows) -> None:
    """Restore the generators of ``rows`` after the block: requests that stopped walking
    must not consume random numbers, so a seeded request draws exactly once per emitted
    token, as in plain decoding."""
    saved = {row: generators[row].get_state() for row in rows if row in generators}
    try:
        yield
    finally:
        for row, state in saved.items():
            generators[row].set_state(state)


def sample_contained(runner, logits: torch.Tensor, spec_decode_metadata) -> SamplerOutput:
    """:func:`sample_with_trees`, or, when it fails or a hook before it failed in this
    step, plain decoding of every request's first row (its root) by vLLM's sampler,
    with seeded requests' random streams as they were before the failed attempt
    (:mod:`vllm_graft.vllm.faults`)."""
    step: GraftStep | None = runner._graft_step
    faults = runner._graft_faults
    generators = runner.input_batch.sampling_metadata.generators
    if step is None or not step.failed:
        saved = {row: generator.get_state() for row, generator in generators.items()}
        try:
            faults.inject("sample")
            return sample_with_trees(runner, logits, spec_decode_metadata)
        except Exception as error:
            faults.failed("sample", error, runner._graft_stats)
            for row, state in saved.items():
                generators[row].set_state(state)
    if step is not None:  # nothing of this step was verified
        step.failed, step.trees, step.plan, step.result = True, [], None, None
    num_sampled = torch.as_tensor(spec_decode_metadata.num_draft_tokens,
                                  device=logits.device) + 1
    roots = torch.cumsum(num_sampled, 0) - num_sampled
    return runner.sampler(logits=logits[roots],
                          sampling_metadata=runner.input_batch.sampling_metadata)


def propose_nothing(runner) -> list[list[int]]:
    """No drafts for any request this step (a plain step to come), what a failed or
    switched-off drafting round proposes."""
    runner._graft_step = None
    runner._graft_proposal = StepProposal(mode=StepMode.PLAIN, ran=StepMode.PLAIN,
                                          drafts=[[] for _ in runner.input_batch.req_ids])
    return runner._graft_proposal.drafts


def sample_with_trees(runner, logits: torch.Tensor, spec_decode_metadata) -> SamplerOutput:
    """Replacement of ``GPUModelRunner._sample`` when Graft is on.

    Walks every request's tree (a bare root for requests without one) with vLLM's own
    sampler choosing the token at each node: the emitted token at every node is exactly
    what plain decoding would sample there (every sampling option, the same random
    stream for seeded requests), and a child is accepted when it carries that token.
    When that sample is the plain argmax at every row (:func:`argmax_is_the_sample`:
    a greedy batch with no logit-editing option), one top-k pass over the tree rows'
    logits gives both the walk (its first column) and the successor matrix's lesson,
    with no per-level sampler call; a step whose drafts are all chains does that over
    host lists (:func:`_sample_chains`). vLLM's chain rejection sampler is never used
    (its CPU path is not lossless in 0.32).
    """
    step: GraftStep = runner._graft_step
    sampling_metadata = runner.input_batch.sampling_metadata
    trees = step.trees if step is not None else []
    num_draft_tokens = spec_decode_metadata.num_draft_tokens
    proposal = last_proposal(runner)
    if not trees and proposal.mode is StepMode.PLAIN and not any(num_draft_tokens):
        # the guard's plain mode with no request carrying drafts: nothing to walk or to
        # teach the matrix, so this is plain decoding's one sampler call on its logits
        # (such steps reach here only where they keep vLLM's speculative path:
        # patches.takes_plain_path)
        return runner.sampler(logits=logits, sampling_metadata=sampling_metadata)
    stats: GraftStats = runner._graft_stats
    start = device_clock(logits.device)
    chains = {t.batch_row: t for t in trees}
    if (step is None or step.plan is None) and _walks_as_chains(chains, num_draft_tokens) \
            and argmax_is_the_sample(sampling_metadata):
        return _sample_chains(runner, logits, spec_decode_metadata, trees, chains, start)
    device = logits.device
    num_sampled = torch.as_tensor(num_draft_tokens, device=device) + 1
    starts = torch.cumsum(num_sampled, 0) - num_sampled  # first logits row per request
    batch = num_sampled.numel()
    if not trees and proposal.mode is StepMode.PLAIN:
        # drafts that are not ours (e.g. padding after a resume): one sampler call on
        # each request's first row, as when no request carried drafts
        return runner.sampler(logits=logits[starts], sampling_metadata=sampling_metadata)
    host_tree = _batch_trees(trees, batch)
    tree = host_tree.to(device)
    row_topk = None
    learned = False  # whether the acceptance taught the matrix already
    fused = runner.drafter.tree_builder.fused is not None  # the compiled ops
    greedy = argmax_is_the_sample(sampling_metadata)
    if greedy or (fused and filters_are_plain_sampling(sampling_metadata)):
        rows = starts.unsqueeze(1) + torch.arange(tree.tokens.shape[1], device=device)
        rows = torch.where(tree.valid, rows, -1)
        pass_start = device_clock(device)
        row_topk = runner.drafter.matrix.target_topk(logits, rows.reshape(-1)).view(
            batch, tree.tokens.shape[1], -1)
        # plain decoding reads each request's one row too: that share is not Graft's
        level_zero_seconds = (device_clock(device) - pass_start) * batch \
            / max(int(host_tree.valid.sum()), 1)
        if fused:
            result = _accept_and_learn(runner, tree, host_tree, row_topk,
                                       spec_decode_metadata, starts, trees,
                                       None if greedy else (logits, rows, sampling_metadata))
            learned = True
        else:
            # without a tree attention plan every tree of the step is a chain
            walk = greedy_chain_walk if step is None or step.plan is None else greedy_walk
            result = walk(tree, row_topk[..., 0])
        logprobs = None
        stats.counts["one_pass_verifications" if greedy else "fused_sampled_verifications"] += 1
    else:
        result, level_zero_seconds, logprobs = _walk_with_sampler(
            runner, tree, logits, starts, sampling_metadata)
    output = result.output_tokens
    if trees:
        host = _to_host(result)
        step.result = host
        _move_accepted_kv(runner, step, host)
        stats.counts["verified_trees"] += len(trees)
        stats.counts["verified_nodes"] += sum(t.tree.tokens.numel() - 1 for t in trees)
        for source, n in accepted_by_source(host_tree, host).items():
            stats.counts[f"accepted_{source}"] += n
        if runner.drafter.sizer is not None:
            # the trees were proposed in the mode of the drafter's last proposal
            runner.drafter.sizer.observe(host_tree, host, mode=proposal.ran)
        for observer in TREE_OBSERVERS:
            for t in trees:
                count = int(host.num_accepted[t.batch_row])
                observer(t, host.accepted_rows[t.batch_row, :count].tolist())
    if proposal.mode is not StepMode.PLAIN and not learned:
        _learn(runner, logits, spec_decode_metadata, starts, trees, row_topk)
    if step is not None and step.plan is not None:
        stats.add_seconds("tree_attention", step.plan.seconds)
    stats.add_seconds("bookkeeping", device_clock(device) - start - level_zero_seconds)
    return SamplerOutput(sampled_token_ids=output.to(torch.int32), logprobs_tensors=logprobs)


def _walks_as_chains(chains: dict[int, VerifiedTree], num_draft_tokens: list[int]) -> bool:
    """Whether every request that carries drafts carries one of our chains (``chains``:
    the step's verified trees by batch row), whole: then its logits rows are the
    chain's rows, in order, and :func:`_sample_chains` applies."""
    for row, drafts in enumerate(num_draft_tokens):
        chain = chains.get(row)
        if chain is None and drafts:
            return False
        if chain is not None and (not chain.chain or len(chain.tree.draft_tokens) != drafts):
            return False
    return True


def _sample_chains(runner, logits: torch.Tensor, spec_decode_metadata,
                   trees: list[VerifiedTree], chains: dict[int, VerifiedTree],
                   start: float) -> SamplerOutput:
    """:func:`sample_with_trees` for a greedy step whose drafts are all chains (copy
    chains, or no drafts at all), walked on the host: one top-k pass over every logits
    row gives each row's argmax (what plain decoding emits there) and the successor
    matrix's lesson; each chain is accepted up to its first token that is not the argmax
    of the row before it. The walk, the acceptance model's lesson and the counts run
    over Python lists: a chain step's few dozen numbers cost more as tensor operations,
    each a dispatch on caches the forward has just flushed."""
    stats: GraftStats = runner._graft_stats
    drafter = runner.drafter
    proposal = last_proposal(runner)
    device = logits.device
    num_draft_tokens = spec_decode_metadata.num_draft_tokens
    pass_start = device_clock(device)
    row_topk = drafter.matrix.target_topk(logits)  # every logits row is a verified row
    best = row_topk[:, 0].tolist()
    # plain decoding reads each request's one row too: that share is not Graft's
    level_zero_seconds = (device_clock(device) - pass_start) * len(num_draft_tokens) \
        / max(len(best), 1)
    drafts = [chains[row].tree.draft_tokens if row in chains else []
              for row in range(len(num_draft_tokens))]
    accepted = greedy_chain_walk_lists(drafts, best)
    outputs, tags, padding_rows = [], {}, []
    first = 0  # each request's first logits row
    for row, count in enumerate(accepted):
        outputs.append(best[first:first + count + 1])
        if row in chains:
            tags[row] = chains[row].tree.source.tolist()
            padding_rows += [first + j for j, tag in enumerate(tags[row]) if tag == SOURCE_PAD]
        first += len(drafts[row]) + 1
    width = max(num_draft_tokens, default=0) + 1  # the longest chain (vLLM's layout)
    output = torch.tensor([tokens + [-1] * (width - len(tokens)) for tokens in outputs],
                          dtype=torch.int32)
    stats.counts["one_pass_verifications"] += 1
    if trees:
        accepted_rows = [list(range(1, count + 1)) + [-1] * (width - 1 - count)
                         for count in accepted]
        step: GraftStep = runner._graft_step
        step.result = AcceptanceResult(
            accepted_rows=torch.tensor(accepted_rows, dtype=torch.long),
            output_tokens=output.long(), num_accepted=torch.tensor(accepted))
        stats.counts["verified_trees"] += len(trees)
        stats.counts["verified_nodes"] += sum(len(t.tree.draft_tokens) for t in trees)
        for source, n in count_accepted_sources(
                [tags[t.batch_row] for t in trees],
                [accepted_rows[t.batch_row] for t in trees]).items():
            stats.counts[f"accepted_{source}"] += n
        if drafter.sizer is not None:
            drafter.sizer.observe_chains(
                [(tags[t.batch_row][1:],
                  None if t.tree.score is None else t.tree.score[1:].tolist(),
                  accepted[t.batch_row], 0) for t in trees], mode=proposal.ran)
        for observer in TREE_OBSERVERS:
            for t in trees:
                observer(t, accepted_rows[t.batch_row][:accepted[t.batch_row]])
    if proposal.mode is not StepMode.PLAIN:  # the guard's plain mode learns nothing
        _learn_every_row(runner, logits, spec_decode_metadata, row_topk, padding_rows)
    stats.add_seconds("bookkeeping", device_clock(device) - start - level_zero_seconds)
    return SamplerOutput(sampled_token_ids=output.to(device), logprobs_tensors=None)


def _learn_every_row(runner, logits: torch.Tensor, spec_decode_metadata,
                     row_topk: torch.Tensor, padding_rows: list[int]) -> None:
    """:func:`_learn` when every logits row is a verified row (each request's drafts
    are its chain, or it has none): the row's input token learns the target's top-k
    there, but for the ``padding_rows`` of fixed-shape chains."""
    drafter = runner.drafter
    tokens = runner.input_ids.gpu[spec_decode_metadata.logits_indices].long()
    if padding_rows:
        tokens[torch.tensor(padding_rows, device=tokens.device)] = -1
    num_draft_tokens = spec_decode_metadata.num_draft_tokens
    partitions = _row_partitions(runner, [drafts + 1 for drafts in num_draft_tokens])
    drafter.matrix.update_from_logits_(tokens, logits, None, partitions, next_tokens=row_topk)


def _row_partitions(runner, counts: list[int]) -> torch.Tensor | None:
    """The matrix partition each learned row teaches: request ``b``'s, repeated for its
    ``counts[b]`` rows (None: every request shares partition 0)."""
    partitions = runner.drafter.partitions(runner, runner.input_batch.req_ids[:len(counts)])
    if partitions is None:
        return None
    # each request teaches its own matrix (graft.isolation)
    return partitions.repeat_interleave(torch.tensor(counts, device=partitions.device))


def _walk_with_sampler(runner, tree: HybridTree, logits: torch.Tensor, starts: torch.Tensor,
                       sampling_metadata):
    """The tree walk with vLLM's sampler emitting the token at each level's nodes:
    ``(result, seconds of level 0, logprobs in vLLM's spec layout or None)``. Level 0
    is what plain decoding samples too, so its time is not Graft's overhead."""
    device = logits.device
    batch = starts.numel()
    level_logprobs = []
    level_zero_seconds = 0.0
    all_rows = torch.arange(batch, device=device)

    def sample_level(level: int, rows: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        nonlocal level_zero_seconds
        level_start = device_clock(device) if level == 0 else 0.0
        node = torch.zeros(batch, dtype=torch.long, device=device)
        node[rows] = current
        walking = torch.zeros(batch, dtype=torch.bool, device=device)
        walking[rows] = True
        stopped = all_rows[~walking].tolist() if sampling_metadata.generators else ()
        with _frozen_generators(sampling_metadata.generators, stopped):
            out = runner.sampler(logits=logits[starts + node],
                                 sampling_metadata=sampling_metadata)
        level_logprobs.append(out.logprobs_tensors)
        if level == 0:  # plain decoding samples this row too: not Graft's overhead
            level_zero_seconds += device_clock(device) - level_start
        return out.sampled_token_ids.view(-1)[rows].long()

    result = walk_tree(tree, sample_level)
    logprobs = None
    if level_logprobs[0] is not None:
        logprobs = _stack_levels(level_logprobs, result.output_tokens.shape[1])
    return result, level_zero_seconds, logprobs


def _stack_levels(levels: list, width: int):
    """Per-level sampler logprobs ([B, ...] each) as vLLM's spec layout [B * width, ...];
    entries of tokens never emitted are dropped by vLLM's parse_output."""
    from vllm.v1.outputs import LogprobsTensors

    levels = levels + [levels[0]] * (width - len(levels))

    def stack(name):
        return torch.stack([getattr(level, name) for level in levels], dim=1).flatten(0, 1)

    return LogprobsTensors(stack("logprob_token_ids"), stack("logprobs"),
                           stack("selected_token_ranks"))


def _accept_and_learn(runner, tree: HybridTree, host_tree: HybridTree, row_topk: torch.Tensor,
                      spec_decode_metadata, starts: torch.Tensor,
                      trees: list[VerifiedTree], sampled=None) -> AcceptanceResult:
    """The walk of every request's tree and :func:`_learn`'s lesson in one op, from the
    target's top-k at the tree rows (``row_topk`` [B, rows, k]): greedy
    (:func:`vllm_graft.ops.graft_accept_greedy`), or, given ``sampled`` = (logits, the
    logits row of each tree row [B, rows], vLLM's sampling metadata), sampled from
    temperature, top-k and top-p (:func:`vllm_graft.ops.graft_accept_sampled`; the
    batch passed :func:`filters_are_plain_sampling`)."""
    batch, rows = tree.tokens.shape
    device = tree.tokens.device
    levels = host_tree.max_depth
    out = {"accepted_rows": torch.empty((batch, levels), dtype=torch.long, device=device),
           "output_tokens": torch.empty((batch, levels + 1), dtype=torch.long, device=device),
           "num_accepted": torch.empty(batch, dtype=torch.long, device=device),
           "accepted_sources": torch.empty((batch, 5), dtype=torch.long, device=device)}
    matrix = runner.drafter.matrix
    learned = _learned_rows(runner, host_tree, spec_decode_metadata, starts, trees)
    row_topk = row_topk.view(batch * rows, -1)
    if sampled is None:
        ops.graft_accept_greedy(tree.tokens, tree.parents, tree.valid, tree.source, row_topk,
                                learned, matrix.vocab_size, matrix.table, out)
    else:
        logits, logits_rows, metadata = sampled
        temperature, top_k, top_p = _filters(metadata, batch, logits.shape[1], device)
        uniforms = torch.rand((batch, levels + 1, rows + 1), device=device)
        ops.graft_accept_sampled(logits, logits_rows, tree.tokens, tree.parents, tree.valid,
                                 tree.source, temperature, top_k, top_p, uniforms, row_topk,
                                 learned, matrix.vocab_size, matrix.table, out)
    return AcceptanceResult(out["accepted_rows"], out["output_tokens"], out["num_accepted"])


#: vLLM's sampler treats a temperature below this as greedy
_GREEDY_BELOW = 1e-5


def _filters(metadata, batch: int, vocab: int, device: torch.device):
    """(temperature, top_k, top_p) ``[B]`` as the fused sampled acceptance takes them
    from vLLM's sampling metadata: greedy rows at temperature 0, filters a request does
    not use switched off (top-k 0, top-p 1)."""
    temperature = metadata.temperature[:batch].float()
    temperature = torch.where(temperature < _GREEDY_BELOW, 0.0, temperature).contiguous()
    top_k = torch.zeros(batch, dtype=torch.long, device=device) if metadata.top_k is None \
        else metadata.top_k[:batch].long().contiguous()
    top_p = torch.ones(batch, device=device) if metadata.top_p is None \
        else metadata.top_p[:batch].float().contiguous()
    return temperature, top_k, top_p


def _learned_rows(runner, host_tree: HybridTree, spec_decode_metadata, starts: torch.Tensor,
                  trees: list[VerifiedTree]) -> torch.Tensor:
    """``[B, rows]`` the matrix row each verified row teaches (-1: none), as
    :func:`_learn` teaches them: every row of each tree but padding, and the sampled row
    of every other request; nothing in the guard's plain mode."""
    batch, rows = host_tree.tokens.shape
    device = starts.device
    if last_proposal(runner).mode is StepMode.PLAIN:  # the guard's plain mode learns nothing
        return torch.full((batch, rows), -1, dtype=torch.long, device=device)
    tokens = torch.where(host_tree.valid & (host_tree.source != SOURCE_PAD),
                         host_tree.tokens, -1).to(device)
    with_tree = {t.batch_row for t in trees}
    plain = [b for b in range(batch) if b not in with_tree]
    if plain:
        index = torch.tensor(plain, dtype=torch.long, device=device)
        logits_rows = spec_decode_metadata.logits_indices[starts[index]]
        tokens[index, 0] = runner.input_ids.gpu[logits_rows].long()
    partitions = runner.drafter.partitions(runner, runner.input_batch.req_ids[:batch])
    if partitions is None:
        return tokens
    return runner.drafter.matrix.partition_rows(tokens, partitions.unsqueeze(1))


def _learn(runner, logits, spec_decode_metadata, starts, trees, row_topk=None) -> None:
    """Every verified row teaches the successor matrix: all rows of each tree, and the
    sampled row of every other request (its decode or last prefill row). One update in
    persistent-batch order, so the last-writer rule is the same on every rank.
    ``row_topk`` [B, rows, k]: the target's top-k at every tree row when acceptance has
    read it already (row 0 of a request without a tree is its sampled row)."""
    device = starts.device
    batch = starts.numel()
    tree_of_row = {t.batch_row: t for t in trees}
    # the learned rows, in batch order, indexed on the host: a few tensor ops per step
    # rather than a few per request
    counts = [tree_of_row[b].tree.tokens.numel() if b in tree_of_row else 1
              for b in range(batch)]
    first_logits_row = 0  # ``starts[b]``
    width = 0 if row_topk is None else row_topk.shape[1]
    ordered = [tree_of_row[b] for b in range(batch) if b in tree_of_row]
    plain = [b for b in range(batch) if b not in tree_of_row]
    rows, topk_rows, plain_at, tree_at = [], [], [], []
    for b, count in enumerate(counts):
        (tree_at if b in tree_of_row else plain_at).extend(range(len(rows), len(rows) + count))
        rows.extend(range(first_logits_row, first_logits_row + count))
        topk_rows.extend(range(b * width, b * width + count))
        first_logits_row += spec_decode_metadata.num_draft_tokens[b] + 1
    tokens = torch.empty(len(rows), dtype=torch.long, device=device)
    if plain:
        logits_rows = spec_decode_metadata.logits_indices[starts[plain]]
        tokens[plain_at] = runner.input_ids.gpu[logits_rows].long()
    if ordered:
        tree_tokens = torch.cat([t.tree.tokens for t in ordered])
        # padding nodes of fixed-shape trees teach nothing (-1 skips the row)
        tree_tokens[torch.cat([t.tree.source for t in ordered]) == SOURCE_PAD] = -1
        tokens[tree_at] = tree_tokens.to(device)
    known = None
    if row_topk is not None:
        known = row_topk.flatten(0, 1)[torch.tensor(topk_rows, device=row_topk.device)]
    drafter = runner.drafter
    partitions = _row_partitions(runner, counts)
    drafter.matrix.update_from_logits_(tokens, logits, torch.tensor(rows, device=device),
                                       partitions, next_tokens=known)


def _move_accepted_kv(runner, step: GraftStep, result: AcceptanceResult) -> None:
    """Copy the accepted rows' K/V to positions ``prefix + 1 .. prefix + L`` in every
    target layer, so the cache is what a chain of the same tokens would have left; RoPE
    already used those positions. vLLM wrote tree row ``r``'s K/V at the slot of position
    ``prefix + r``. In each layer all sources are read before any destination is
    written, since a destination may be another accepted row's source.
    ``result`` is the host copy (:func:`_to_host`)."""
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


def settled_rows(runner, scheduler_output, sampled: torch.Tensor, step: GraftStep | None
                 ) -> list[SettledRows]:
    """For every request, the rows whose positions became final this step, with the
    tokens that follow them (the drafter's shifted inputs). ``drafts`` says only whether
    the request may get drafts at all; :func:`_decide_drafting` settles it per mode."""
    batch = runner.input_batch
    by_row = set()
    if step is not None and step.result is not None:
        by_row = {verified.batch_row for verified in step.trees}
    # read once as Python lists: per-row tensor and numpy element reads cost more than
    # the rest of this loop at batch 32, and it runs every step
    num_rows = len(batch.req_ids)
    first_sampled = sampled[:, 0].tolist() if sampled.numel() else []
    query_starts = runner.query_start_loc.np[:num_rows].tolist()
    computed = batch.num_computed_tokens_cpu[:num_rows].tolist()
    discard = runner.discard_request_mask.np[:num_rows].tolist()
    token_table = batch.token_ids_cpu
    last_column = token_table.shape[1] - 1  # rows not scheduled are read, not used
    first_tokens = [token_table.item(row, min(position, last_column))
                    for row, position in enumerate(computed)]
    scheduled = scheduler_output.num_scheduled_tokens
    spec = scheduler_output.scheduled_spec_decode_tokens
    out = []
    for row, req_id in enumerate(batch.req_ids):
        num_scheduled = scheduled.get(req_id, 0)
        if num_scheduled == 0:
            continue
        start, prefix, discarded = query_starts[row], computed[row], bool(discard[row])
        decoding = True
        if row in by_row:
            count = int(step.result.num_accepted[row])
            path = [0] + step.result.accepted_rows[row, :count].tolist()
            rows = [start + r for r in path]
            next_tokens = step.result.output_tokens[row, :count + 1].tolist()
        else:
            real = num_scheduled - len(spec.get(req_id, ()))
            rows = list(range(start, start + real))
            if real == 1 and not discarded:  # a decode row: the token sampled after it
                next_tokens = [first_sampled[row]]
            else:
                decoding = False
                token_ids = token_table[row]
                next_tokens = token_ids[prefix + 1:prefix + real].tolist()
                next_tokens.append(int(token_ids[prefix + real]) if discarded
                                   else first_sampled[row])
        out.append(SettledRows(batch_row=row, rows=rows, next_tokens=next_tokens,
                               first_position=prefix, first_token=first_tokens[row],
                               drafts=not discarded, decoding=decoding))
    return out


def _decide_drafting(runner, settled: list[SettledRows], mode: StepMode) -> None:
    """Which settled requests get new drafts in the coming step's ``mode``; a request
    waiting after its tree was cut to nothing sits out one more tree step."""
    proposer: GraftProposer = runner.drafter
    for s in settled:
        if not s.drafts:
            continue
        req_id = runner.input_batch.req_ids[s.batch_row]
        obstacle = proposer.drafting_obstacle(runner.requests[req_id],
                                              s.first_position + len(s.rows), mode)
        if obstacle == proposer.WAITING:
            proposer.wait_a_step(req_id)
        s.drafts = obstacle is None


def propose_with_trees(runner, scheduler_output, sampled_token_ids, aux_hidden_states
                       ) -> list[list[int]]:
    proposer: GraftProposer = runner.drafter
    stats: GraftStats = runner._graft_stats
    step: GraftStep | None = runner._graft_step
    runner._graft_step = None
    start = device_clock(runner.device)
    proposer.forward_timer.take_seconds()  # spans of earlier steps (e.g. dummy runs)
    proposer.catch_up_timer.take_seconds()
    settled: list[SettledRows] | None = None

    def read_settled() -> list[SettledRows]:
        nonlocal settled
        if settled is None:
            settled = settled_rows(runner, scheduler_output, sampled_token_ids, step)
        return settled

    # a step that verified no tree settled one row per scheduled request: its rows are
    # read only if this step's proposal needs them
    if step is not None and step.result is not None:
        read_settled()
    _observe_step(runner, scheduler_output, settled, step)  # before choosing the next
    proposal = StepProposal()
    runner._graft_proposal = proposal  # what the step to come verifies
    requests = list(scheduler_output.num_scheduled_tokens)
    states = [runner.requests[req_id] for req_id in requests]
    following = True
    if proposer.guard is not None:
        # every rank must draft (or not) alike: the first rank's timing decides
        joined = len(scheduler_output.scheduled_new_reqs)
        if joined:  # new text: what chains measured on the old one counts for less
            proposer.guard.requests_joined(joined, len(requests),
                                           scouted=proposer.scout is not None)
            if proposer.scout is not None:
                proposer.scout.text_changed(joined, len(requests))
        reach = proposer.guard.within_reach(len(requests), StepMode.TREE)
        mode = proposer.guard.choose(len(requests), proposer.unavailable_modes(states, reach))
        if (mode is StepMode.PLAIN and not proposer.guard.measuring
                and proposer.scout is not None and proposer.scout.due()):
            stats.counts["chain_scout_looks"] += 1
            if proposer.scout_chains(runner, read_settled(), proposer.guard.rate_of(
                    len(requests), StepMode.PLAIN), proposal):
                mode = StepMode.CHAIN
                proposal.scout_fired = True
                stats.counts["chain_scout_steps"] += 1
        proposal.mode, proposal.trees_in_reach = agree((mode, reach))
        # from the agreed reach: ranks that disagreed on it must still all feed the
        # drafter (its forward's collectives), or all pass plainly
        following = proposer.would_follow_any(states, proposal.trees_in_reach)
    proposer.admit(states, proposal.trees_in_reach)
    if proposal.mode is StepMode.PLAIN and not following:
        # nothing to draft, and no drafter input to feed or keep
        proposer.pass_plainly(runner.input_batch.req_ids, proposal)
    else:
        _decide_drafting(runner, read_settled(), proposal.mode)
        proposer.propose_trees(runner, scheduler_output, read_settled(), aux_hidden_states,
                               proposal)
    stats.counts["chain_shadow_trials"] += proposal.shadow_trials
    if proposer.guard is not None:
        stats.counts[f"guard_{proposal.ran.value}_steps"] += 1
    end = device_clock(runner.device)
    forward_seconds = proposer.forward_timer.take_seconds()
    stats.add_seconds("draft_forward", forward_seconds)
    stats.add_seconds("bookkeeping", end - start - forward_seconds)
    catch_up = proposer.catch_up_timer.take_seconds()
    # a catch-up that followed no request did no work for trees (its span is the call)
    proposal.tree_preparation = catch_up if (
        following and proposal.ran is not StepMode.TREE) else 0.0
    if proposer.guard is not None and proposal.tree_preparation:
        stats.add_seconds("tree_preparation", proposal.tree_preparation)
    _count_proposal(stats, proposal, proposer.settings.config.checkpoints)
    return proposal.drafts


def _count_proposal(stats: GraftStats, proposal: StepProposal, checkpoints) -> None:
    """A proposal's build, chains and sizing in the counters."""
    if proposal.build is not None:
        _count_build(stats, proposal.build, checkpoints)
    if proposal.chains is not None:
        stats.counts["chains_built"] += proposal.chains[0]
        stats.counts["chain_nodes"] += proposal.chains[1]
    choice = proposal.choice
    if choice is not None:
        stats.counts["auto_chosen_nodes"] += int(choice.nodes_per_request.sum())
        predicted = choice.expected_tokens - choice.nodes_per_request.numel()
        stats.counts["auto_predicted_accepted_milli"] += int(round(predicted * 1000))


def profile_tree_step(runner, hidden_states: torch.Tensor) -> dict[str, int]:
    """A full verification step of trees in vLLM's start-up profile run, so the KV cache
    is sized around what serving trees needs besides it: the target's logits at every
    row a step of trees can verify (``max_num_seqs`` trees of ``budget + 1`` rows, at
    most ``max_num_batched_tokens``), their top-k, and the fused step's buffers for
    ``max_num_seqs`` requests (allocated here and kept). Returns, and keeps as
    ``runner._graft_profile``, the rows and bytes it allocated."""
    drafter: GraftProposer = runner.drafter
    config = drafter.settings.config
    max_seqs = runner.scheduler_config.max_num_seqs
    rows = min(runner.scheduler_config.max_num_batched_tokens, max_seqs * (config.budget + 1))
    hidden = torch.rand((rows, hidden_states.shape[-1]), dtype=hidden_states.dtype,
                        device=hidden_states.device)
    logits = runner.model.compute_logits(hidden)
    top = drafter.matrix.target_topk(logits)
    buffer_bytes = 0
    fused = drafter.tree_builder.fused
    if fused is not None:
        buffers = fused.reserve(max_seqs)
        buffer_bytes = sum(value.numel() * value.element_size()
                           for value in vars(buffers).values()
                           if isinstance(value, torch.Tensor))
        _run_fused_ops_once(drafter, max_seqs, logits)
    profile = {"rows": rows, "logits_bytes": logits.numel() * logits.element_size(),
               "topk_bytes": top.numel() * top.element_size(), "buffer_bytes": buffer_bytes}
    runner._graft_profile = profile
    logger.info("Graft: profiled a step of trees at %d requests: %d verified rows, logits "
                "%.1f MiB, top-k %.1f MiB, step buffers %.1f MiB", max_seqs, rows,
                profile["logits_bytes"] / 2**20, profile["topk_bytes"] / 2**20,
                buffer_bytes / 2**20)
    del hidden, logits, top
    return profile


def _run_fused_ops_once(drafter: GraftProposer, batch: int, logits: torch.Tensor) -> None:
    """Every fused op once, on the engine's device at ``batch`` requests, within the
    start-up profile: an op that refuses this engine's shapes, dtypes or device stops
    start-up naming itself, and GPU kernels compile now rather than in a served step.
    The drafter's answers are uniform over the first ``top_k`` tokens; the matrix learns
    nothing (the learned rows are cleared)."""
    from vllm_graft.core import fused as fused_step

    fused = drafter.tree_builder.fused
    recipe = fused.recipe
    device = logits.device
    k = max(recipe.top_k, 1)

    def uniform(step):
        shape = (step.tokens.shape[0], step.tokens.shape[1], k)
        return (torch.full(shape, -math.log(k), device=device),
                torch.arange(k, device=device).expand(shape).contiguous())

    context = None
    if drafter.uses_context:
        width = drafter.context_config.max_nodes
        empty = torch.full((batch, width), -1, dtype=torch.long, device=device)
        context = (empty, empty, torch.zeros_like(empty))
    matrix = drafter.matrix
    buffers = fused.build(torch.zeros(batch, dtype=torch.long, device=device),
                          uniform if recipe.max_depth else None, context,
                          successors=matrix.table)
    buffers.learn_rows.fill_(-1)
    rows = buffers.row_index.clamp(max=logits.shape[0] - 1)
    fused_step.accept_greedy(buffers, logits, matrix.table, matrix.vocab_size, rows)
    sampling = fused_step.SamplingTensors(
        temperature=torch.ones(batch, device=device),
        top_k=torch.zeros(batch, dtype=torch.long, device=device),
        top_p=torch.full((batch,), 0.9, device=device))
    fused_step.accept_sampled(buffers, logits, sampling, matrix.table, matrix.vocab_size, rows)


def propose_with_blocks(runner, sampled_token_ids, propose_blocks) -> list[list[int]]:
    """Graft-TAIL on DFlash: ``propose_blocks()`` runs vLLM's own DFlash proposal (its
    input preparation, context K/V and one forward); the blocks become Graft-TAIL
    chains (:meth:`GraftDFlashProposer.graft_blocks`)."""
    runner._graft_step = None
    stats: GraftStats = runner._graft_stats
    start = device_clock(runner.device)
    blocks = propose_blocks()
    drafted = device_clock(runner.device)
    drafts, build = runner.drafter.graft_blocks(runner, blocks, sampled_token_ids)
    runner._graft_proposal = StepProposal(ran=StepMode.CHAIN if build is not None
                                          else StepMode.PLAIN, drafts=drafts, build=build)
    stats.add_seconds("draft_forward", drafted - start)
    stats.add_seconds("bookkeeping", device_clock(runner.device) - drafted)
    _count_proposal(stats, runner._graft_proposal, runner.drafter.settings.config.checkpoints)
    return drafts


def _observe_step(runner, scheduler_output, settled: list[SettledRows] | None,
                  step: GraftStep | None) -> None:
    """Time this engine step (from the last step's drafting to this one's) and count its
    emitted tokens (as the guard credits them: :meth:`ThroughputGuard.credited_tokens`)
    and verified nodes, for the throughput guard and for the sizer's
    step costs (:meth:`CostModel.observe_step`); steps with prefill chunks are skipped
    (their time is not the decoding cost of any mode). A tree step after chain or plain
    steps includes feeding the drafter the positions those steps deferred: switching to
    trees costs that, and a guard that did not see it would switch to trees more often
    than they pay. The drafter's catch-up in the last proposal, when that was no tree
    step's, served only trees to come: it is charged to trees
    (:meth:`ThroughputGuard.charge`), not to the step's mode, whether the step is
    measured or not."""
    proposer: GraftProposer = runner.drafter
    measured = last_proposal(runner)  # the proposal the step now ending verified
    forward_ms = None if step is None else step.take_forward_ms()
    if forward_ms is not None:  # the profile follows what a forward really costs
        proposer.sizer.cost.observe(1, step.num_tokens, forward_ms)
    preparation = measured.tree_preparation
    if proposer.guard is None and proposer.sizer is None:
        return
    now = time.perf_counter()
    last, runner._graft_step_clock = getattr(runner, "_graft_step_clock", None), now
    spec = scheduler_output.scheduled_spec_decode_tokens
    scheduled = scheduler_output.num_scheduled_tokens
    if proposer.guard is not None and preparation and scheduled:
        proposer.guard.charge(StepMode.TREE, len(scheduled), preparation)
    prefill = any(count - len(spec.get(req_id, ())) > 1 for req_id, count in scheduled.items())
    if last is None or prefill or not scheduled:
        return
    mode, seconds = measured.ran, max(now - last - preparation, 0.0)
    # without settled rows (no tree verified) every scheduled request emitted one token
    batch = len(scheduled) if settled is None else len(settled)
    if proposer.guard is not None:
        guard = proposer.guard
        credited = float(batch) if settled is None else guard.credited_tokens(
            [len(s.next_tokens) for s in settled])  # the median request's, times the batch
        choice = measured.choice
        if proposer.scout is not None and mode is StepMode.CHAIN and choice is not None:
            # the scout's correction learns how the sizer's predictions, credited as the
            # guard credits a step, fare as the guard counts them (a batch's chain step
            # charged, a stall capped)
            proposer.scout.observe(proposer.predicted_credit(choice, batch), choice.step_ms,
                                   credited, guard.counted_seconds(mode, batch, seconds))
            if measured.scout_fired:
                proposer.scout.fired_step(gained=credited > batch)
        guard.observe(mode, batch, credited, seconds)
    if forward_ms is not None:
        nodes = max(scheduler_output.total_num_scheduled_tokens - batch, 0)
        cost = proposer.sizer.cost
        cost.observe_step(mode, batch, nodes, seconds * 1e3, forward_ms)
        if cost.steps.observed % LOG_STEP_COSTS_EVERY == 0 and cost.steps.observed:
            logger.info("Graft: step costs besides the forward, learned over %d steps: %s",
                        cost.steps.observed, cost.steps.describe())


#: measured decoding steps between two log lines of what budget "auto" learned they cost
LOG_STEP_COSTS_EVERY = 500


#: BuildStats fields summed into the counter of the same meaning
_BUILD_TOTALS = {"draft_forwards": "draft_steps", "draft_nodes": "draft_nodes",
                 "retrieved_nodes": "retrieved_nodes", "merged_nodes": "both_nodes",
                 "retrieval_lookups": "retrieval_lookups", "retrieval_hits": "retrieval_hits",
                 "padded_nodes": "padded_nodes", "replaced_nodes": "replaced_nodes",
                 "context_nodes": "context_nodes"}


def _count_build(stats: GraftStats, build, checkpoints) -> None:
    """Add one tree build's facts to the counters with a single device read."""
    totals = [getattr(build, field).sum() for field in _BUILD_TOTALS.values()]
    values = torch.cat([torch.stack(totals), build.stage.long()]).tolist()
    for name, value in zip(_BUILD_TOTALS, values):
        stats.counts[name] += int(value)
    stages = values[len(_BUILD_TOTALS):]
    stats.counts["trees_built"] += len(stages)
    names = [f"stage_{cp}" for cp in checkpoints] + ["stage_full"]
    for stage in stages:
        stats.counts["stage_none" if stage < 0 else names[stage]] += 1
