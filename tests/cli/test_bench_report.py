"""The benchmark report's goal checks and batch table, on a synthetic results file (no
engine): each check must be able to say "no"."""

from __future__ import annotations

import pytest

from vllm_graft.bench.report import batch_section, goal_checks, markdown, method_means


def row(method, dataset, mat, per_step, tps=10.0, batch=None):
    out = {"method": method, "dataset": dataset, "mat": mat, "tokens_per_step": per_step,
           "tokens_per_s": tps, "generated_tokens": 64, "seconds": 64 / tps,
           "verified_tokens_per_step": 1.0, "prompts": 4}
    if batch is not None:
        out["batch"] = batch
    return out


def results(rows, batch_rows=()):
    return {"config": {"target": "t", "head": "h", "budget": 60, "max_tokens": 64,
                       "dtype": "float32", "max_num_seqs": 4},
            "machine": {"cpu": "cpu", "cores": 2, "torch": "x"},
            "rows": list(rows), "batch_rows": list(batch_rows),
            "greedy_agreement_with_plain": {}}


def checks_of(data) -> dict[str, bool | None]:
    means = method_means(data)
    return {text: ok for text, _, ok in goal_checks(means, data["rows"])}


def test_ngram_goals_use_both_measures_and_can_fail():
    rows = [row("ngram", "a", 3.0, 1.5), row("graft", "a", 2.9, 2.5),
            row("ngram", "b", 2.0, 1.1), row("graft", "b", 3.0, 2.0),
            row("graft_no_context", "gsm8k", 2.0, 2.0), row("graft", "gsm8k", 1.9, 1.9)]
    checks = checks_of(results(rows))
    mat = "MAT (vLLM's counters: steps with drafts)"
    per_step = "tokens per step (all decoding steps)"
    assert checks[f"{mat} graft / ngram, lowest dataset"] is False  # 2.9 < 3.0 on a
    assert checks[f"{per_step} graft / ngram, lowest dataset"] is True
    assert checks[f"{per_step} graft / ngram, mean"] is True
    assert checks["MAT graft / graft_no_context on gsm8k"] is False


def test_batch_table_reports_speed_against_plain_at_each_batch():
    batch_rows = [row("plain", "a", 1.0, 1.0, tps=30.0, batch=1),
                  row("graft_auto", "a", 2.0, 2.0, tps=36.0, batch=1),
                  row("plain", "a", 1.0, 1.0, tps=100.0, batch=8),
                  row("graft_auto", "a", 1.5, 1.5, tps=90.0, batch=8)]
    lines = "\n".join(batch_section(results([], batch_rows)))
    assert "| graft_auto | 36.0 (1.20x) | 90.0 (0.90x) |" in lines
    assert "slowest against plain at batch 8 on a (0.90x" in lines
    assert "batch 1 over all datasets: 1.20x" in lines
    assert "## Batch sizes" in markdown(results([row("plain", "a", 1.0, 1.0)], batch_rows))


def test_interleaved_rounds_are_reported_with_their_paired_spread():
    plain = {**row("plain", "a", 1.0, 1.0, tps=30.0, batch=8),
             "round_tokens_per_s": [30.0, 24.0, 33.0], "rounds_identical": 4}
    graft = {**row("graft_auto", "a", 1.5, 1.5, tps=33.0, batch=8),
             "round_tokens_per_s": [33.0, 21.6, 36.3], "rounds_identical": 3}
    lines = "\n".join(batch_section(results([], [plain, graft])))
    assert "stayed alive beside the others and ran each dataset, 3 rounds" in lines
    assert "for 7 / 8 requests" in lines  # one Graft request changed in a later round
    # round 2 slower than plain's
    assert "graft_auto batch 8 0.90-1.10 (median 1.10, mean 1.03 in 0.90-1.10)" in lines
    assert "ran each dataset" not in "\n".join(batch_section(results([], [
        row("plain", "a", 1.0, 1.0, tps=30.0, batch=8)])))


def test_a_second_plain_engine_sets_the_noise_band_and_what_falls_below_it_is_named():
    batch_rows = [row("plain", "a", 1.0, 1.0, tps=100.0, batch=8),
                  row("plain", "b", 1.0, 1.0, tps=100.0, batch=8),
                  row("plain_again", "a", 1.0, 1.0, tps=96.0, batch=8),
                  row("plain_again", "b", 1.0, 1.0, tps=103.0, batch=8),
                  row("graft_auto", "a", 1.0, 1.0, tps=97.0, batch=8),  # inside the band
                  row("graft_auto", "b", 1.0, 1.0, tps=90.0, batch=8)]  # below it
    lines = "\n".join(batch_section(results([], batch_rows)))
    assert ("A/A control at batch 8: a second plain engine measured 0.96-1.03x plain over "
            "the datasets; below that band: graft_auto on b (0.90x)") in lines
    batch_rows[-1] = row("graft_auto", "b", 1.0, 1.0, tps=99.0, batch=8)
    assert "below that band: none" in "\n".join(batch_section(results([], batch_rows)))
    assert "A/A control" not in "\n".join(batch_section(results([], batch_rows[:2])))


def test_a_sweep_with_fresh_engines_each_round_says_so():
    plain = {**row("plain", "a", 1.0, 1.0, tps=30.0, batch=8),
             "round_tokens_per_s": [30.0, 24.0], "rounds_identical": 4}
    engines = [{"method": m, "dataset": "_engine", "batch": 8, "warmup_seconds": 2.0,
                "engine_starts": 2} for m in ("plain", "graft_auto")]
    data = results([], [plain, *engines])
    data["config"]["engine_warmup"] = {"prompts": 8, "offset": 10_000, "tokens": 16}
    lines = "\n".join(batch_section(data))
    assert "was started afresh for each round" in lines and "stayed alive" not in lines
    assert "Before each start (median seconds over its starts)" in lines
    # only the engines that remember earlier requests started afresh: said of them alone
    engines[0]["engine_starts"] = 1
    engines[1]["method"] = "suffix"
    lines = "\n".join(batch_section(data))
    assert "stayed alive beside the others" in lines
    assert "The engines of suffix were started afresh for each round" in lines


def test_the_paired_interval_brackets_the_mean_and_narrows_with_more_rounds():
    from vllm_graft.bench.report import paired_interval

    mean, low, high = paired_interval([0.9, 1.1, 1.0, 0.95, 1.05])
    assert low < mean < high and abs(mean - 0.998) < 0.01
    _, wide_low, wide_high = paired_interval([0.9, 1.1] * 2)
    _, narrow_low, narrow_high = paired_interval([0.9, 1.1] * 50)
    assert narrow_high - narrow_low < (wide_high - wide_low) / 3
    assert paired_interval([0.8] * 6) == pytest.approx((0.8, 0.8, 0.8))


def test_each_sweep_engines_untimed_warm_up_is_reported():
    engines = [{"method": "plain", "dataset": "_engine", "batch": 8, "warmup_seconds": 2.5},
               {"method": "graft_auto", "dataset": "_engine", "batch": 8,
                "warmup_seconds": 4.25}]
    data = results([], [row("plain", "a", 1.0, 1.0, tps=30.0, batch=8), *engines])
    data["config"]["engine_warmup"] = {"prompts": 8, "offset": 10_000, "tokens": 16}
    lines = "\n".join(batch_section(data))
    assert "Before its first round (seconds) each engine generated 16 tokens" in lines
    assert "graft_auto batch 8 4.2; plain batch 8 2.5" in lines
    data["config"]["engine_warmup"]["prompts"] = 0  # no warm-up ran: nothing to report
    assert "Before its first round" not in "\n".join(batch_section(data))


def test_too_few_warm_up_prompts_is_an_error_naming_the_offset(monkeypatch, tmp_path):
    import pytest

    from vllm_graft.bench import engines

    monkeypatch.setattr(engines.datasets, "sharegpt", lambda cache_dir, limit, offset: [])
    with pytest.raises(ValueError, match="ENGINE_WARMUP_OFFSET"):
        engines.engine_warmup_source(tmp_path, 8)


def test_tail_is_checked_against_vllms_chain_and_gets_a_chain_calibration():
    from vllm_graft.bench.methods import methods

    rows = [row("eagle3", "a", 1.4, 1.4, tps=50.0), row("tail", "a", 1.5, 1.5, tps=45.0)]
    checks = checks_of(results(rows))
    assert checks["MAT tail / eagle3 chain"] is True
    assert checks["tokens/s tail / eagle3 chain"] is False  # 45 < 50
    table = methods(60, chain_tokens=3)
    spec = table["tail"].speculative_config("H", "w.bin", "tree.json", "eagle3", "chain.json")
    assert spec["graft"] == {"variant": "tail", "budget": 3, "warmup": "w.bin",
                             "calibration": "chain.json"}
    assert table["eagle3"].speculative_config("H", None, None)["num_speculative_tokens"] == 3
    graft = table["graft"].speculative_config("H", None, "tree.json", "eagle3", "chain.json")
    assert graft["graft"]["calibration"] == "tree.json"


@pytest.mark.parametrize("budget", [60, 30])
def test_budget_auto_rows_are_capped_at_the_benchs_budget(budget):
    """``--budget 30`` fits the calibration at 30: the rows of budget "auto" must run
    with that cap, or the calibration stops their engines at start-up, after the rows
    before them ran."""
    from vllm_graft.bench.methods import methods
    from vllm_graft.core.config import GraftConfig

    table = methods(budget)
    for name in ("graft", "graft_auto", "graft_plain", "graft_chain", "graft_tree"):
        spec = table[name].speculative_config("H", None, "tree.json")
        config = GraftConfig.from_dict(spec["graft"])
        assert config.budget == budget, name
        assert config.auto_size == (name != "graft"), name


def test_a_later_round_that_diverged_fails_greedy_agreement():
    """A sweep's greedy agreement with plain decoding compares every round: a request
    whose later round diverged counts as not identical, whichever engine diverged."""
    from types import SimpleNamespace

    from vllm_graft.bench.runner import greedy_agreement, outputs_of_every_round

    chosen = [SimpleNamespace(name="plain"), SimpleNamespace(name="graft_auto")]
    tokens = [[1, 2], [3, 4], [5, 6]]
    outputs = {("plain", "d"): outputs_of_every_round("plain", tokens, [True, True, False]),
               ("graft_auto", "d"): outputs_of_every_round("graft_auto", tokens,
                                                           [True, False, False])}
    agreement = greedy_agreement(chosen, outputs, {"d": ["a", "b", "c"]})
    assert agreement["graft_auto"] == {"identical": 1, "total": 3}
    assert agreement["plain"] == {"identical": 3, "total": 3}  # compared with itself
    assert outputs_of_every_round("x", tokens, None) == tokens  # a single run


def test_a_finished_engine_is_reused_only_for_the_same_code_and_files(tmp_path):
    """An interrupted bench resumes with the engines that finished, where the job's text
    is the same, and so are Graft's code and the files its spec names: a warm-up built
    again at the same path gets a new run, not the old result."""
    from vllm_graft.bench.engines import resume_stamp

    warmup = tmp_path / "warmup.bin"
    warmup.write_bytes(b"one")
    spec = {"method": "graft", "graft": {"warmup": str(warmup)}}
    first = resume_stamp(spec)
    assert resume_stamp(spec) == first
    warmup.write_bytes(b"two")
    assert resume_stamp(spec) != first
    assert resume_stamp(None) == resume_stamp({"method": "ngram"})


def test_engine_warmup_prompts_are_cut_to_fit_not_dropped():
    from vllm_graft.bench.engines import engine_warmup_prompts

    candidates = [list(range(500)), list(range(20)), list(range(300))]
    datasets = {"a": [[1, 2]] * 2, "b": [[3]]}
    warm = engine_warmup_prompts(candidates, datasets, max_model_len=165, max_tokens=64)
    assert [len(p) for p in warm] == [100, 20]  # as many as the largest dataset
    assert all(len(p) + 64 < 165 for p in warm)
    assert engine_warmup_prompts(candidates, datasets, max_model_len=64, max_tokens=64) == []


def test_prefill_warmups_give_each_dataset_its_prompt_lengths_on_other_text():
    """An engine's untimed warm-up prefills each dataset's prompt lengths (its prefill
    shapes) on warm-up text, a short warm-up prompt repeated to the length."""
    from vllm_graft.bench.engines import prefill_warmups

    candidates = [[7, 8, 9], [5] * 40]
    datasets = {"a": [[1] * 10, [2] * 4, [3] * 6], "b": [[4] * 2]}
    warm = prefill_warmups(candidates, datasets)
    assert [[len(p) for p in batch] for batch in warm] == [[10, 4, 6], [2]]
    assert warm[0][0] == [7, 8, 9] * 3 + [7] and warm[0][1] == [5] * 4
    assert warm[0][2] == [7, 8, 9, 7, 8, 9] and warm[1][0] == [7, 8]
    assert prefill_warmups([], datasets) == []


def test_report_only_rewrites_the_report_from_the_results_file(tmp_path, capsys):
    import json

    from vllm_graft.cli.bench import main

    batch_rows = [row("plain", "a", 1.0, 1.0, tps=100.0, batch=8),
                  row("graft_auto", "a", 1.0, 1.0, tps=97.0, batch=8)]
    (tmp_path / "results.json").write_text(json.dumps(results([], batch_rows)))
    assert main(["--out", str(tmp_path), "--report-only"]) == 0
    assert "| graft_auto | 97.0 (0.97x) |" in (tmp_path / "report.md").read_text()
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "missing"), "--report-only"])
    assert "no results file" in capsys.readouterr().err


def test_step_split_reports_what_each_method_adds_to_plain_besides_the_target():
    def split(method, dataset, step, target, batch=32):
        return {**row(method, dataset, 1.0, 1.0, batch=batch), "step_ms": step,
                "target_ms": target, "other_ms": step - target}

    batch_rows = [split("plain", "a", 100.0, 88.0), split("plain", "b", 110.0, 98.0),
                  # a slower process: more target time, the same rest plus one ms
                  split("graft_auto", "a", 111.0, 98.0), split("graft_auto", "b", 121.0, 108.0)]
    lines = "\n".join(batch_section(results([], batch_rows)))
    assert "- batch 32: plain 105.0 = 93.0 + 12.00" in lines
    assert "graft_auto 116.0 = 103.0 + 13.00 (+1.00 ms, +1.0 % of plain's step)" in lines
    no_split = [row("plain", "a", 1.0, 1.0, batch=8), row("graft_auto", "a", 1.0, 1.0, batch=8)]
    assert "Median decoding step" not in "\n".join(batch_section(results([], no_split)))


def test_budget_autos_speculative_steps_are_reported_round_by_round():
    rounds = [{"chain": 40, "plain": 14}, {"plain": 64}, {"chain": 2, "tree": 1, "plain": 60}]
    batch_rows = [row("plain", "mtbench", 1.0, 1.0, batch=8),
                  {**row("graft_auto", "mtbench", 1.0, 1.0, batch=8),
                   "round_guard_steps": rounds}]
    lines = "\n".join(batch_section(results([], batch_rows)))
    assert "- graft_auto batch 8, mtbench: 40/54 0/64 3/63" in lines
    without = [row("plain", "a", 1.0, 1.0, batch=8), row("graft_auto", "a", 1.0, 1.0, batch=8)]
    assert "steps by round" not in "\n".join(batch_section(results([], without)))


def test_calibrate_and_warmup_budget_defaults_to_the_drafts_kind():
    """``--budget`` unset: 60 tree nodes, or 5 chain tokens for Graft-TAIL (a default of
    60 made ``calibrate --variant tail`` fail with a bare validation error); too long a
    chain is a usage error naming the flag."""
    import argparse

    from vllm_graft.cli.common import add_engine_arguments, engine_budget

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    unset = parser.parse_args(["--head", "h", "--out", "o"])
    assert engine_budget(parser, unset, chains=False) == 60
    assert engine_budget(parser, unset, chains=True) == 5
    too_long = parser.parse_args(["--head", "h", "--out", "o", "--budget", "40"])
    assert engine_budget(parser, too_long, chains=False) == 40
    with pytest.raises(SystemExit):
        engine_budget(parser, too_long, chains=True)
