"""The summary figures: speed over plain decoding by batch with the A/A band, tokens per
step by source, both drawn from the committed canonical results; no figure of one point."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from vllm_graft.bench.figures import (SOURCES, plain_band, plot_sources, plot_speedup,
                                      speedups, tokens_by_source)
from vllm_graft.bench.report import plots

ROOT = Path(__file__).resolve().parents[2]


def batch_row(method, dataset, batch, tps):
    return {"method": method, "dataset": dataset, "batch": batch, "tokens_per_s": tps,
            "generated_tokens": 64, "seconds": 64 / tps}


def run(batch, **methods):
    rows = [batch_row(method, dataset, batch, tps) for method, by in methods.items()
            for dataset, tps in by.items()]
    return {"config": {"chain_tokens": 3}, "rows": [], "batch_rows": rows}


def test_speedups_are_against_plain_of_the_same_run_and_the_band_holds_one():
    runs = [run(1, plain={"a": 10, "b": 10}, plain_again={"a": 9, "b": 10.5},
                graft_auto={"a": 13, "b": 12}, eagle3={"a": 8, "b": 8}),
            run(8, plain={"a": 50, "b": 50}, plain_again={"a": 52, "b": 51},
                graft_auto={"a": 50, "b": 51})]
    series = speedups(runs)
    assert set(series) == {"Graft, budget auto", "vLLM EAGLE-3 chain (3 tokens)"}
    assert series["Graft, budget auto"] == pytest.approx({1: 1.25, 8: 1.01}, abs=0.005)
    band = plain_band(runs)
    assert list(band) == [1, 8]
    assert band[1] == pytest.approx((0.9, 1.05)) and band[8] == pytest.approx((1.0, 1.04))


def test_tokens_by_source_split_the_accepted_tokens_and_add_the_bonus():
    results = {"rows": [{"method": "graft", "dataset": "a", "mat": 3.0,
                         "accepted_share_retrieved": 0.25, "accepted_share_both": 0.25,
                         "accepted_share_context": 0.0},
                        {"method": "graft", "dataset": "_engine", "mat": 9.0}]}
    [(dataset, name, tokens)] = tokens_by_source(results, ("graft",))
    assert (dataset, set(tokens)) == ("a", set(SOURCES))
    assert tokens == pytest.approx({"drafted": 1.0, "retrieved": 0.5, "both": 0.5,
                                    "context": 0.0, "bonus": 1.0})


def test_no_figure_of_one_point(tmp_path):
    one = [run(1, plain={"a": 10}, graft_auto={"a": 12})]
    assert plot_speedup(one, tmp_path / "speed.png") is None
    single = {"rows": [{"method": "graft", "dataset": "a", "mat": 2.0}]}
    assert plot_sources(single, ("graft",), tmp_path / "sources.png") is None
    plain_only = {"rows": [{"method": "plain", "dataset": "a", "mat": 1.0, "seconds": 1.0,
                            "generated_tokens": 10}], "ablations": []}
    assert plots(plain_only, tmp_path) == []
    assert not list(tmp_path.iterdir())


def test_the_readme_figures_come_from_the_canonical_results(tmp_path):
    spec = importlib.util.spec_from_file_location("plot_results",
                                                  ROOT / "scripts" / "plot_results.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    written = script.main(["--out", str(tmp_path)])
    assert [p.name for p in written] == ["speedup_by_batch.png", "tokens_per_step_by_source.png"]
    assert all(0 < p.stat().st_size < 200_000 for p in written)
    committed = ROOT / "docs" / "images"
    assert all((committed / p.name).is_file() for p in written), "run scripts/plot_results.py"
