"""Runs the Triton kernel tests and the GPU check's smoke run under Triton's interpreter,
each in a process of its own (see conftest.py), with the Triton that scripts/setup.sh
installs next to the environment; and the GPU check on a machine without a GPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRITON_SITE = Path(sys.prefix) / "triton-interpreter"

needs_interpreter = pytest.mark.skipif(
    not (TRITON_SITE / "triton").is_dir(),
    reason=f"Triton for the interpreter is not installed in {TRITON_SITE} (scripts/setup.sh)")


def interpreter_env() -> dict[str, str]:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHON=sys.executable)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), str(TRITON_SITE), env.get("PYTHONPATH")) if p)
    return env


def run(command: list[str], timeout: int) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=ROOT, env=interpreter_env(), capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}"
    return result


@needs_interpreter
def test_kernel_under_interpreter():
    result = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                  "tests/kernels/interpreter"], timeout=900)
    assert " passed" in result.stdout and "failed" not in result.stdout, result.stdout


@needs_interpreter
def test_gpu_check_smoke_run(tmp_path):
    result = run(["bash", "scripts/gpu_check.sh", str(tmp_path), "--smoke"], timeout=600)
    report = (tmp_path / "gpu_check.md").read_text()
    assert "FAILED" not in report, report
    for section in ("tree_kernel_check", "tree_kernel_timing", "bookkeeping", "whole_step",
                    "build_phases", "graph_bookkeeping", "verification_cost"):
        assert f"## {section}: ok" in report, report
    assert "gpu_check: verification_cost ok" in result.stdout
    sections = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    # bookkeeping is reported as a share of a step, the forward read off the cost curve;
    # the fused step beside the torch path, one read of the device per step
    assert "share_greedy" in report and "share_sampled" in report, report
    backends = [row["backend"] for row in sections["bookkeeping"]["rows"]]
    assert backends == ["fused", "compiled"] * 2, backends
    assert all(row["host_reads_greedy"] == 1 for row in sections["bookkeeping"]["rows"]
               if row["backend"] == "fused"), sections["bookkeeping"]
    # the wait-free build: no host wait, the waiting build's tree (eager on the CPU); the
    # fused step whole, the same result again from the same matrix
    graphs = sections["graph_bookkeeping"]
    assert not graphs["captured"] and graphs["rows"]
    assert all(row["wait_free_host_waits"] == 0 and row["wait_free_same"]
               and row["fused_replay_same"] and row["fused_eager_step_greedy_ms"] > 0
               and "fused_eager_share_greedy" in row for row in graphs["rows"]), graphs
    # the whole step: every phase timed, the phases build the step's trees, the plain
    # and chain steps beside it, tokens/s projected with the committed MAT values
    whole = sections["whole_step"]
    assert [(row["batch"], row["context"]) for row in whole["rows"]] == [(1, 24), (2, 24)]
    for row in whole["rows"]:
        assert "errors" not in row and "skipped" not in row, row
        for key in ("draft", "head", "finalize", "forward", "accept", "step", "plain",
                    "chain3", "chain5"):
            assert row[f"{key}_ms"] > 0, (key, row)
        assert row["phases_same"] and row["replay_same"], row
        assert row["step_mode"] == "eager (no GPU)", row
        for key in ("graft_tok_s", "chain3_tok_s", "chain5_tok_s", "plain_tok_s",
                    "graft_over_chain", "graft_over_plain", "bookkeeping_share"):
            assert isinstance(row[key], float), (key, row)
    assert [goal["goal"] for goal in whole["goals"]] == ["Graft / better EAGLE-3 chain",
                                                         "Graft / plain"], whole["goals"]
    assert "gpu_check: whole_step MAT graft = 1.980 (bench/results/smollm2-135m/" \
        in result.stdout, result.stdout
    assert "Projected tokens/s" in report and "graft_over_chain" in report, report


@needs_interpreter
def test_gpu_check_keeps_going_past_a_hung_section(tmp_path):
    """Each section runs in a process of its own with a time limit: one that hangs is
    killed there and recorded as such, the sections the time budget cannot reach are
    recorded as not run, the report is written whole, and the script fails."""
    python = tmp_path / "python"  # whole_step hangs, as a kernel never run before might
    python.write_text('#!/bin/bash\n'
                      'case " $* " in *" --sections whole_step --limit-s "*) exec sleep 600;;\n'
                      'esac\n'
                      f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    out = tmp_path / "out"
    env = dict(interpreter_env(), PYTHON=str(python), GPU_CHECK_BUDGET_S="45",
               GPU_CHECK_SECTIONS="whole_step tree_kernel_check")
    result = subprocess.run(["bash", "scripts/gpu_check.sh", str(out), "--smoke"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "gpu_check: whole_step killed at its time limit" in result.stdout, result.stdout
    sections = json.loads((out / "gpu_check.json").read_text())["sections"]
    assert "killed at its time limit" in sections["whole_step"]["error"], sections
    assert "time budget (45 s) was spent" in sections["tree_kernel_check"]["skipped"], sections
    report = (out / "gpu_check.md").read_text()
    assert "## whole_step: FAILED" in report and "## tree_kernel_check: SKIPPED" in report


def test_gpu_check_mat_and_projection():
    """The whole step's MAT defaults come from the committed CPU results; tokens/s =
    batch x MAT / step time, and the goals compare Graft with the better chain at the
    smallest batch and with plain decoding at the largest."""
    path = list(sys.path)
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path[:] = path  # the script adds its folder too

    mats = {name: gpu_check.committed_mat(name) for name in gpu_check.MAT_RESULTS}
    assert mats["graft"][0] == pytest.approx(1.98, abs=5e-3), mats
    assert mats["chain5"][0] == pytest.approx(1.267, abs=5e-3), mats
    assert mats["chain3"][0] == pytest.approx(1.329, abs=5e-3), mats
    assert all("results.json" in source for _, source in mats.values()), mats
    rows = [dict(batch=1, context=1024, step_ms=20.0, chain3_ms=12.0, chain5_ms=15.0,
                 plain_ms=10.0),
            dict(batch=32, context=1024, step_ms=100.0, chain3_ms=60.0, chain5_ms=70.0,
                 plain_ms=40.0),
            dict(batch=8, context=1024, skipped="does not fit")]
    goals = gpu_check.project_throughput(rows, {"graft": (2.0, "x"), "chain3": (1.5, "x"),
                                                "chain5": (1.8, "x")})
    assert rows[0]["graft_tok_s"] == pytest.approx(100.0)
    assert rows[0]["chain3_tok_s"] == pytest.approx(125.0)
    assert rows[0]["graft_over_chain"] == pytest.approx(100.0 / 125.0)
    assert rows[1]["graft_over_plain"] == pytest.approx(640.0 / 800.0)
    assert "graft_tok_s" not in rows[2]
    assert [(g["batch"], g["met"]) for g in goals] == [(1, False), (32, False)], goals


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine: the "
                    "script would run the whole check")
def test_gpu_check_without_gpu_says_so(tmp_path):
    result = subprocess.run(["bash", "scripts/gpu_check.sh", str(tmp_path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "no NVIDIA GPU found" in result.stdout and "nothing was measured" in result.stdout
