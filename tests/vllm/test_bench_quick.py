"""``vllm-graft bench --quick`` on the real SmolLM2-135M-Instruct with the committed
EAGLE-3 head: every method runs on real prompts and every method's greedy output is
token-identical to plain decoding (fp32)."""

from __future__ import annotations

import json

from vllm_graft.cli.bench import main as bench_main


def test_bench_quick_runs_every_method_losslessly(tmp_path):
    out = tmp_path / "quick"
    code = bench_main(["--quick", "--out", str(out), "--max-num-seqs", "8",
                       "--batch-sizes", "3", "--batch-methods", "plain", "graft_auto",
                       "--batch-rounds", "2", "--batch-fresh-engines"])
    results = json.loads((out / "results.json").read_text())
    methods = {r["method"] for r in results["rows"] if r["dataset"] != "_engine"}
    assert {"plain", "eagle3", "ngram", "dense_tree", "prune_only", "retrieval_only",
            "graft_no_context", "graft", "graft_auto"} <= methods
    agreement = results["greedy_agreement_with_plain"]
    assert all(a["identical"] == a["total"] > 0 for a in agreement.values()), agreement
    assert code == 0
    graft = [r for r in results["rows"] if r["method"] == "graft" and r["dataset"] != "_engine"]
    assert all(r["mat"] > 1.0 for r in graft), graft
    assert (out / "report.md").is_file() and (out / "mat_vs_speed.png").is_file()
    # the batch sweep: 3 prompts per dataset at max_num_seqs 3, both methods lossless
    swept = [r for r in results["batch_rows"] if r["dataset"] != "_engine"]
    assert {(r["method"], r["batch"]) for r in swept} == {("plain", 3), ("graft_auto", 3)}
    assert all(r["prompts"] == 3 for r in swept), swept
    # budget auto's rows say what its guard ran and what its chain scout did
    auto = [r for r in swept if r["method"] == "graft_auto"]
    assert all(sum(r["guard_steps"].values()) > 0 and set(r["chain_scout"]) ==
               {"looks", "steps", "shadow_trials"} for r in auto), auto
    # and round by round, the first round's being the row's
    assert all(len(r["round_guard_steps"]) == 2 and r["round_guard_steps"][0] ==
               r["guard_steps"] for r in auto), auto
    assert not any("round_guard_steps" in r for r in swept if r["method"] == "plain")
    # the sweep's engines took turns, twice each, each round in a fresh process, and
    # repeated their greedy output
    assert all(len(r["round_tokens_per_s"]) == 2 and r["rounds_identical"] == 3
               for r in swept), swept
    assert agreement["graft_auto@batch3"]["total"] == 3 * len(results["datasets"])
    assert "## Batch sizes" in (out / "report.md").read_text()
    # every engine warmed up, untimed, on ShareGPT prompts before its first dataset (an
    # offset past the file's end once left every engine without a warm-up)
    assert results["config"]["engine_warmup"]["prompts"] >= 3
    engines = [r for r in results["rows"] + results["batch_rows"] if r["dataset"] == "_engine"]
    assert engines and all(r["warmup_seconds"] > 0 for r in engines), engines
    assert all(r["engine_starts"] == 2 for r in results["batch_rows"]
               if r["dataset"] == "_engine")
    report = (out / "report.md").read_text()
    assert "Before each start (median seconds over its starts) each engine generated" in report
    assert "was started afresh for each round" in report
    # every row splits its median decoding step into the target's compute and the rest
    rows = [r for r in results["rows"] + swept if r["dataset"] != "_engine"]
    assert all(0 < r["target_ms"] < r["step_ms"] and r["other_ms"] > 0 for r in rows), rows
    assert "Median decoding step (ms, mean over datasets)" in report
    # and times its prefill phase, which a decoding step's split cannot show
    assert all(r["prefill_ms"] > 0 for r in rows), rows
    assert "Prefill phase (s, median over rounds" in report
