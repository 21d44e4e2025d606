"""Sampling with trees: Graft's replacement of vLLM's rejection sampler.

:func:`sample_with_trees` runs lossless acceptance over every request's tree (the
emitted token at every node is what plain decoding samples there), moves the accepted
rows' KV into place and lets every verified row teach the successor matrix;
:func:`sample_contained` falls back to plain decoding of every request's root when it
fails. The output keeps vLLM's contract: ``[batch, max_len]`` sampled ids padded with
-1, so the scheduler rolls back exactly the rejected rows.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from torch.nn.utils.rnn import pad_sequence
from vllm.v1.outputs import SamplerOutput

from vllm_graft import ops
from vllm_graft.core.acceptance import (AcceptanceResult, greedy_chain_walk,
                                        greedy_chain_walk_lists, greedy_walk,
                                        walk_tree)
from vllm_graft.core.budget import UNKNOWN_SCORE
from vllm_graft.core.config import StepMode
from vllm_graft.core.graft import count_accepted_sources
from vllm_graft.core.hybrid import HybridTree
from vllm_graft.core.transfer import dataclasses_to_host
from vllm_graft.step_clock import Spans, StepClock
from vllm_graft.vllm import matrix_learning
from vllm_graft.vllm.proposal import last_proposal
from vllm_graft.vllm.sampling import argmax_is_the_sample, filters_are_plain_sampling
from vllm_graft.vllm.tree_verification import (TREE_OBSERVERS, GraftStats, GraftStep,
                                               VerifiedTree, move_accepted_kv)


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


def to_host(result: AcceptanceResult) -> AcceptanceResult:
    """The acceptance result on the host, read once per step in one copy
    (:func:`~vllm_graft.core.transfer.dataclasses_to_host`): every per-request loop
    after acceptance uses it, so the device is waited for once per step rather than
    once per request or per tensor."""
    return dataclasses_to_host(result)[0]


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


def sample_with_trees(runner, logits: torch.Tensor, spec_decode_metadata) -> SamplerOutput:
    """Replacement of ``GPUModelRunner._sample`` when Graft is on.

    Walks every request's tree (a bare root for requests without one; a chain is a tree
    of width 1) with vLLM's own sampler choosing the token at each node: the emitted
    token at every node is exactly what plain decoding would sample there (every
    sampling option, the same random stream for seeded requests), and a child is
    accepted when it carries that token. When that sample is the plain argmax at every
    row (:func:`argmax_is_the_sample`: a greedy batch with no logit-editing option), one
    top-k pass over the tree rows' logits gives both the walk (its first column) and the
    successor matrix's lesson, with no per-level sampler call; a step whose drafts are
    all chains walks them over host lists (:func:`_walk_chains_on_host`). Whatever the
    walk, the step's verification is recorded and taught the same way. vLLM's chain
    rejection sampler is never used (its CPU path is not lossless in 0.32).
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
    clock: StepClock = runner._graft_clock
    start = clock.mark()
    greedy = argmax_is_the_sample(sampling_metadata)
    if greedy and (step is None or step.plan is None) \
            and _walks_as_chains(trees, num_draft_tokens):
        walk = _walk_chains_on_host(runner, logits, num_draft_tokens, trees)
    else:
        num_sampled = torch.as_tensor(num_draft_tokens, device=logits.device) + 1
        starts = torch.cumsum(num_sampled, 0) - num_sampled  # first logits row per request
        if not trees and proposal.mode is StepMode.PLAIN:
            # drafts that are not ours (e.g. padding after a resume): one sampler call on
            # each request's first row, as when no request carried drafts
            return runner.sampler(logits=logits[starts], sampling_metadata=sampling_metadata)
        walk = _walk_trees(runner, logits, spec_decode_metadata, starts, trees, greedy)
    if trees:
        _record_verification(runner, step, walk, proposal)
    if proposal.mode is not StepMode.PLAIN and not walk.learned:
        # the guard's plain mode learns nothing
        matrix_learning.learn(runner, logits, spec_decode_metadata, trees, walk.row_topk)
    if step is not None and step.plan is not None:
        stats.add_seconds("tree_attention", step.plan.seconds)
    clock.phase(lambda seconds: stats.add_seconds("bookkeeping", seconds), start,
                (walk.level_zero,))
    return SamplerOutput(sampled_token_ids=walk.result.output_tokens.to(device=logits.device,
                                                                        dtype=torch.int32),
                         logprobs_tensors=walk.logprobs)


@dataclass
class _Walk:
    """One step's acceptance walk over every request's tree."""

    result: AcceptanceResult  # rows follow the persistent batch
    #: the target's top-k where the walk read it: [B, rows, k] at each request's tree
    #: rows, or [logits rows, k] at every logits row (None: not read)
    row_topk: torch.Tensor | None
    level_zero: Spans  # the share plain decoding spends too: not Graft's overhead
    logprobs: object = None  # vLLM's LogprobsTensors in its spec layout, or None
    learned: bool = False  # whether the walk taught the matrix already
    #: the step's trees as one host batch (None: walked as host lists, all chains)
    host_tree: HybridTree | None = None


def _walks_as_chains(trees: list[VerifiedTree], num_draft_tokens: list[int]) -> bool:
    """Whether every request that carries drafts carries one of our chains (``trees``:
    the step's verified trees), whole: then its logits rows are the chain's rows, in
    order, and :func:`_walk_chains_on_host` applies."""
    chains = {t.batch_row: t for t in trees}
    for row, drafts in enumerate(num_draft_tokens):
        chain = chains.get(row)
        if chain is None and drafts:
            return False
        if chain is not None and (not chain.chain or len(chain.tree.draft_tokens) != drafts):
            return False
    return True


def _walk_chains_on_host(runner, logits: torch.Tensor, num_draft_tokens: list[int],
                         trees: list[VerifiedTree]) -> _Walk:
    """The greedy walk of a step whose drafts are all chains (copy chains, or no drafts
    at all), on the host: one top-k pass over every logits row gives each row's argmax
    (what plain decoding emits there) and the successor matrix's lesson; each chain is
    accepted up to its first token that is not the argmax of the row before it. The walk
    runs over Python lists: a chain step's few dozen numbers cost more as tensor
    operations, each a dispatch on caches the forward has just flushed."""
    clock: StepClock = runner._graft_clock
    pass_start = clock.mark()
    row_topk = runner.drafter.matrix.target_topk(logits)  # every logits row is a verified row
    # plain decoding reads each request's one row too: that share is not Graft's
    level_zero = Spans([(pass_start, clock.mark())],
                       scale=len(num_draft_tokens) / max(row_topk.shape[0], 1))
    best = row_topk[:, 0].tolist()
    chains = {t.batch_row: t for t in trees}
    drafts = [chains[row].tree.draft_tokens if row in chains else []
              for row in range(len(num_draft_tokens))]
    accepted = greedy_chain_walk_lists(drafts, best)
    width = max(num_draft_tokens, default=0) + 1  # the longest chain (vLLM's layout)
    outputs, accepted_rows = [], []
    first = 0  # each request's first logits row
    for row, count in enumerate(accepted):
        outputs.append(best[first:first + count + 1] + [-1] * (width - 1 - count))
        accepted_rows.append(list(range(1, count + 1)) + [-1] * (width - 1 - count))
        first += len(drafts[row]) + 1
    runner._graft_stats.counts["one_pass_verifications"] += 1
    result = AcceptanceResult(accepted_rows=torch.tensor(accepted_rows, dtype=torch.long),
                              output_tokens=torch.tensor(outputs, dtype=torch.long),
                              num_accepted=torch.tensor(accepted))
    return _Walk(result, row_topk, level_zero)


def _walk_trees(runner, logits: torch.Tensor, spec_decode_metadata, starts: torch.Tensor,
                trees: list[VerifiedTree], greedy: bool) -> _Walk:
    """The walk of every request's tree on the device: from one top-k pass over the tree
    rows when the sample is the argmax (``greedy``) or the compiled ops sample the batch
    (the fused walk also teaches the matrix), else level by level with vLLM's sampler."""
    step: GraftStep | None = runner._graft_step
    sampling_metadata = runner.input_batch.sampling_metadata
    device = logits.device
    batch = starts.numel()
    host_tree = _batch_trees(trees, batch)
    tree = host_tree.to(device)
    fused = runner.drafter.tree_builder.fused is not None  # the compiled ops
    if not greedy and not (fused and filters_are_plain_sampling(sampling_metadata)):
        result, level_zero, logprobs = _walk_with_sampler(
            runner, tree, logits, starts, sampling_metadata)
        return _Walk(result, None, level_zero, logprobs, host_tree=host_tree)
    rows = starts.unsqueeze(1) + torch.arange(tree.tokens.shape[1], device=device)
    rows = torch.where(tree.valid, rows, -1)
    clock: StepClock = runner._graft_clock
    pass_start = clock.mark()
    row_topk = runner.drafter.matrix.target_topk(logits, rows.reshape(-1)).view(
        batch, tree.tokens.shape[1], -1)
    # plain decoding reads each request's one row too: that share is not Graft's
    level_zero = Spans([(pass_start, clock.mark())],
                       scale=batch / max(int(host_tree.valid.sum()), 1))
    if fused:
        result = _accept_and_learn(runner, tree, host_tree, row_topk, spec_decode_metadata,
                                   starts, trees,
                                   None if greedy else (logits, rows, sampling_metadata))
    else:
        # without a tree attention plan every tree of the step is a chain
        walk = greedy_chain_walk if step is None or step.plan is None else greedy_walk
        result = walk(tree, row_topk[..., 0])
    runner._graft_stats.counts[
        "one_pass_verifications" if greedy else "fused_sampled_verifications"] += 1
    return _Walk(result, row_topk, level_zero, learned=fused, host_tree=host_tree)


def _record_verification(runner, step: GraftStep, walk: _Walk, proposal) -> None:
    """The step's verified trees after the walk: the host copy of the result
    (:attr:`GraftStep.result`), the accepted rows' KV moved into place, the counters,
    the sizer's acceptance model (the trees were proposed in the mode of the drafter's
    last proposal) and the tree observers."""
    stats: GraftStats = runner._graft_stats
    trees = step.trees
    host = to_host(walk.result)
    step.result = host
    move_accepted_kv(runner, step, host)
    accepted_rows, accepted = host.accepted_rows.tolist(), host.num_accepted.tolist()
    tags = [t.tree.source.tolist() for t in trees]
    stats.counts["verified_trees"] += len(trees)
    stats.counts["verified_nodes"] += sum(len(t.tree.draft_tokens) for t in trees)
    for source, n in count_accepted_sources(
            tags, [accepted_rows[t.batch_row] for t in trees]).items():
        stats.counts[f"accepted_{source}"] += n
    sizer = runner.drafter.sizer
    if sizer is not None and walk.host_tree is None:  # chains, walked as host lists
        sizer.observe_chains([(tree_tags[1:],
                               None if t.tree.score is None else t.tree.score[1:].tolist(),
                               accepted[t.batch_row], 0)
                              for t, tree_tags in zip(trees, tags)], mode=proposal.ran)
    elif sizer is not None:
        sizer.observe(walk.host_tree, host, mode=proposal.ran)
    for observer in TREE_OBSERVERS:
        for t in trees:
            observer(t, accepted_rows[t.batch_row][:accepted[t.batch_row]])


def _walk_with_sampler(runner, tree: HybridTree, logits: torch.Tensor, starts: torch.Tensor,
                       sampling_metadata):
    """The tree walk with vLLM's sampler emitting the token at each level's nodes:
    ``(result, the span of level 0, logprobs in vLLM's spec layout or None)``. Level 0
    is what plain decoding samples too, so its time is not Graft's overhead."""
    device = logits.device
    batch = starts.numel()
    level_logprobs = []
    level_zero = Spans()
    all_rows = torch.arange(batch, device=device)
    clock: StepClock = runner._graft_clock

    def sample_level(level: int, rows: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        level_start = clock.mark() if level == 0 else None
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
            level_zero.pairs.append((level_start, clock.mark()))
        return out.sampled_token_ids.view(-1)[rows].long()

    result = walk_tree(tree, sample_level)
    logprobs = None
    if level_logprobs[0] is not None:
        logprobs = _stack_levels(level_logprobs, result.output_tokens.shape[1])
    return result, level_zero, logprobs


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
    """The walk of every request's tree and :func:`vllm_graft.vllm.matrix_learning.learn`'s lesson in one op, from the
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
    learned = matrix_learning.learned_rows(runner, host_tree, spec_decode_metadata, starts, trees)
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

