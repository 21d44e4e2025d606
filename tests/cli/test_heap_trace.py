"""``scripts/heap_trace.py``'s report on a synthetic trace (no engine): growth is measured
from the end of the warm-up, and a heap that grows must show as growing."""

from __future__ import annotations

import json

import pytest

from tests.cli.helpers import script_module


@pytest.fixture(scope="module")
def heap_trace():
    with script_module("heap_trace") as module:
        yield module


def trace(rounds: int, live_per_round: float, kept: float = 400.0) -> list[dict]:
    return [{"round": i, "output_tokens": 100 * i, "rss_mb": 4000 + live_per_round * i + kept,
             "heap_live_mb": 3000 + live_per_round * i, "heap_kept_mb": kept,
             "rss_trimmed_mb": 3800 + live_per_round * i, "python_blocks": 1000 + i}
            for i in range(rounds + 1)]


def test_growth_starts_after_the_warm_up(heap_trace):
    warm = heap_trace.WARMUP_ROUNDS
    rising = trace(warm + 10, live_per_round=2.0)
    rising[1]["heap_live_mb"] += 500  # a warm-up jump is not growth
    assert heap_trace.growth(rising, "heap_live_mb") == pytest.approx(20.0)
    assert heap_trace.growth(trace(warm + 10, 0.0), "heap_live_mb") == 0.0
    short = trace(2, live_per_round=3.0)  # fewer rounds than the warm-up: the last one
    assert heap_trace.after_warmup(short) == short[-1:]


def test_report_and_plot_from_the_saved_traces(heap_trace, tmp_path):
    states = {"pending_trees": 0, "deferred_rows": 0}
    graft = {"method": "graft", "trace": trace(12, 4.0), "python_growth": [
        {"kb": 30.0, "blocks": 5, "where": ["a.py:1"]}]}
    for row in graft["trace"]:
        row["request_states"] = states
    plain = {"method": "plain", "trace": trace(12, 0.0), "python_growth": None}
    (tmp_path / "heap.json").write_text(json.dumps(
        {"command": "scripts/heap_trace.py --out x", "traces": [graft, plain]}))
    assert heap_trace.main(["--report-only", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    graft_line = next(line for line in report.splitlines() if line.startswith("| graft"))
    plain_line = next(line for line in report.splitlines() if line.startswith("| plain"))
    grown = 4.0 * (12 - heap_trace.WARMUP_ROUNDS)
    assert f"+{grown:.1f}" in graft_line and '"deferred_rows": 0' in graft_line
    assert "+0.0 | +0.0 | +0.0" in plain_line
    assert "+0.03 MB in all" in report
    assert (tmp_path / "heap.png").stat().st_size > 0
