"""The runner's drafting hook: the rows each request settled this step, the throughput
guard's mode for the step to come, the proposer's round (trees, copy chains, or
Graft-TAIL's blocks), and the step's observation and counters."""

from __future__ import annotations

import logging
import time

import torch

from vllm_graft.core.budget.scout import fired_step_gained
from vllm_graft.core.config import StepMode
from vllm_graft.step_clock import StepClock
from vllm_graft.vllm.draft_records import SettledRows
from vllm_graft.vllm.proposal import StepProposal, last_proposal
from vllm_graft.vllm.proposer import GraftProposer
from vllm_graft.vllm.tp_agreement import agree
from vllm_graft.vllm.tree_verification import GraftStats, GraftStep

logger = logging.getLogger(__name__)


def propose_nothing(runner) -> list[list[int]]:
    """No drafts for any request this step (a plain step to come), what a failed or
    switched-off drafting round proposes."""
    runner._graft_step = None
    runner._graft_proposal = StepProposal(mode=StepMode.PLAIN, ran=StepMode.PLAIN,
                                          drafts=[[] for _ in runner.input_batch.req_ids])
    return runner._graft_proposal.drafts


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
    # the first token sampled for every row: from the step's host acceptance result
    # where a tree was verified (its rows follow the persistent batch), so such a step
    # reads the device once, in acceptance
    if by_row:
        first_sampled = step.result.output_tokens[:num_rows, 0].tolist()
    else:
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
    clock: StepClock = runner._graft_clock
    start = clock.mark()
    proposer.forward_timer.take()  # spans of earlier steps (e.g. dummy runs)
    proposer.catch_up_timer.take()
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
        if proposer.scout is not None and proposer.scout.looks_at(proposer.guard, mode):
            stats.counts["chain_scout_looks"] += 1
            if proposer.scout_chains(runner, read_settled(), proposer.guard.rate_of(
                    len(requests), mode), proposal):
                proposal.scout_replaced, mode = mode, StepMode.CHAIN
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
    forward = proposer.forward_timer.take()
    clock.phase(lambda seconds: stats.add_seconds("bookkeeping", seconds), start, (forward,))
    clock.later(lambda: stats.add_seconds("draft_forward", forward.seconds()), forward)
    catch_up = proposer.catch_up_timer.take()
    # a catch-up that followed no request did no work for trees (its span is the call)
    if following and proposal.ran is not StepMode.TREE and catch_up.pairs:
        proposal.tree_preparation_spans = catch_up
        if proposer.guard is not None:
            clock.later(lambda: stats.add_seconds("tree_preparation", catch_up.seconds()),
                        catch_up)
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


def propose_with_blocks(runner, sampled_token_ids, propose_blocks) -> list[list[int]]:
    """Graft-TAIL on DFlash: ``propose_blocks()`` runs vLLM's own DFlash proposal (its
    input preparation, context K/V and one forward); the blocks become Graft-TAIL
    chains (:meth:`GraftDFlashProposer.graft_blocks`)."""
    runner._graft_step = None
    stats: GraftStats = runner._graft_stats
    clock: StepClock = runner._graft_clock
    start = clock.mark()
    blocks = propose_blocks()
    drafted = clock.phase(lambda seconds: stats.add_seconds("draft_forward", seconds), start)
    drafts, build = runner.drafter.graft_blocks(runner, blocks, sampled_token_ids)
    runner._graft_proposal = StepProposal(ran=StepMode.CHAIN if build is not None
                                          else StepMode.PLAIN, drafts=drafts, build=build)
    clock.phase(lambda seconds: stats.add_seconds("bookkeeping", seconds), drafted)
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
    # the forward's time, read once the device has passed it (the step's own read of
    # its result makes sure of that), teaches the sizer's cost profile
    forward = None if step is None else step.take_forward()
    clock: StepClock = runner._graft_clock
    if forward is not None:  # the profile follows what a forward really costs
        clock.later(lambda: proposer.sizer.cost.observe(
            1, step.num_tokens, forward.seconds() * 1e3), forward)
    preparation = measured.tree_preparation
    if proposer.guard is None and proposer.sizer is None:
        return
    now = time.perf_counter()
    last, runner._graft_step_clock = getattr(runner, "_graft_step_clock", None), now
    spec = scheduler_output.scheduled_spec_decode_tokens
    scheduled = scheduler_output.num_scheduled_tokens
    if proposer.guard is not None and preparation and scheduled:
        proposer.guard.charge(StepMode.TREE, len(scheduled), preparation)
    req_ids, emitted = _emitted_tokens(runner, scheduled, settled)
    prefill = any(count - len(spec.get(req_id, ())) > 1 for req_id, count in scheduled.items())
    timed = last is not None and not prefill and bool(scheduled)
    credited = None if proposer.guard is None or not timed \
        else proposer.guard.credited_tokens(emitted, req_ids)  # read before the advance
    if proposer.guard is not None:  # every step, prefill or not, moves the gains
        proposer.guard.advance(req_ids, emitted)
    if not timed:
        return
    mode, seconds = measured.ran, max(now - last - preparation, 0.0)
    batch = len(emitted)
    if proposer.guard is not None:
        guard = proposer.guard
        choice = measured.choice
        if proposer.scout is not None and mode is StepMode.CHAIN \
                and measured.predicted_credit is not None:
            # the scout's correction learns how the sizer's predictions, credited as the
            # guard credits a step, fare as the guard counts them (a batch's chain step
            # charged, a stall capped)
            counted = guard.counted_seconds(mode, batch, seconds)
            proposer.scout.observe(measured.predicted_credit, choice.step_ms, credited,
                                   counted)
            if measured.scout_replaced is not None:
                proposer.scout.fired_step(gained=fired_step_gained(
                    guard, measured.scout_replaced, batch, credited, counted))
        guard.observe(mode, batch, credited, seconds)
    if forward is not None:
        nodes = max(scheduler_output.total_num_scheduled_tokens - batch, 0)
        clock.later(lambda: _learn_step_cost(proposer.sizer.cost, mode, batch, nodes,
                                             seconds * 1e3, forward.seconds() * 1e3),
                    forward)


def _learn_step_cost(cost, mode: StepMode, batch: int, nodes: int, step_ms: float,
                     forward_ms: float) -> None:
    """A timed step's cost besides its forward in the sizer's cost profile."""
    cost.observe_step(mode, batch, nodes, step_ms, forward_ms)
    if cost.steps.observed % LOG_STEP_COSTS_EVERY == 0 and cost.steps.observed:
        logger.info("Graft: step costs besides the forward, learned over %d steps: %s",
                    cost.steps.observed, cost.steps.describe())


def _emitted_tokens(runner, scheduled: dict[str, int], settled: list[SettledRows] | None
                    ) -> tuple[list[str], list[int]]:
    """The step's requests and the decoding tokens each emitted (a prompt chunk's row
    counts one): without settled rows (no tree verified) every scheduled request
    emitted one."""
    if settled is None:
        return list(scheduled), [1] * len(scheduled)
    req_ids = runner.input_batch.req_ids
    return ([req_ids[s.batch_row] for s in settled],
            [len(s.next_tokens) if s.decoding else 1 for s in settled])


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
