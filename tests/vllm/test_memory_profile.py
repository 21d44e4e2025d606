"""vLLM sizes the KV cache around the memory its start-up profile run peaks at; a step
of Graft trees verifies ``budget + 1`` rows per request, so the profile must include
their logits (``runner.profile_tree_step``), or a busy server runs out of memory
mid-step."""

from __future__ import annotations

from tests.vllm.conftest import graft_spec, running_llm

MAX_SEQS = 4


def profile_run(worker) -> dict:
    """vLLM's own profile run, and what Graft's part of it allocated."""
    runner = worker.model_runner
    runner._graft_profile = None
    runner.profile_run()
    return runner._graft_profile


def test_the_start_up_profile_includes_a_step_of_trees_and_grows_with_the_budget(tiny_models):
    profiles = {}
    for budget in (8, 60):
        with running_llm(tiny_models.target, graft_spec(tiny_models.head, budget=budget),
                         max_num_seqs=MAX_SEQS, max_num_batched_tokens=1024,
                         max_model_len=512) as llm:
            profiles[budget] = llm.collective_rpc(profile_run)[0]
    small, large = profiles[8], profiles[60]
    assert small["rows"] == MAX_SEQS * 9 and large["rows"] == MAX_SEQS * 61
    assert large["logits_bytes"] == small["logits_bytes"] * 61 // 9
    assert large["topk_bytes"] > small["topk_bytes"]
    # the fused step's buffers are allocated for max_num_seqs requests, and grow too
    assert 0 < small["buffer_bytes"] < large["buffer_bytes"]


def test_the_profile_stops_at_what_a_step_can_schedule(tiny_models):
    with running_llm(tiny_models.target, graft_spec(tiny_models.head, budget=60),
                     max_num_seqs=MAX_SEQS, max_num_batched_tokens=128,
                     max_model_len=512) as llm:
        assert llm.collective_rpc(profile_run)[0]["rows"] == 128
