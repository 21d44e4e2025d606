"""``vllm-graft bench --quick`` on the real SmolLM2-135M-Instruct with the committed
EAGLE-3 head: every method runs on real prompts and every method's greedy output is
token-identical to plain decoding (fp32)."""

from __future__ import annotations

import json

from vllm_graft.cli.bench import main as bench_main


def test_bench_quick_runs_every_method_losslessly(tmp_path):
    out = tmp_path / "quick"
    code = bench_main(["--quick", "--out", str(out), "--max-num-seqs", "8"])
    results = json.loads((out / "results.json").read_text())
    methods = {r["method"] for r in results["rows"] if r["dataset"] != "_engine"}
    assert {"plain", "eagle3", "ngram", "dense_tree", "prune_only", "retrieval_only",
            "graft"} <= methods
    agreement = results["greedy_agreement_with_plain"]
    assert all(a["identical"] == a["total"] > 0 for a in agreement.values()), agreement
    assert code == 0
    graft = [r for r in results["rows"] if r["method"] == "graft" and r["dataset"] != "_engine"]
    assert all(r["mat"] > 1.0 for r in graft), graft
    assert (out / "report.md").is_file() and (out / "mat_vs_speed.png").is_file()
