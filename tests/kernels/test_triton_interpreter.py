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
    for section in ("tree_kernel_check", "tree_kernel_timing", "bookkeeping",
                    "build_phases", "graph_bookkeeping", "verification_cost"):
        assert f"## {section}: ok" in report, report
    assert "gpu_check: verification_cost ok" in result.stdout
    # bookkeeping is reported as a share of a step, the forward read off the cost curve
    assert "share_greedy" in report and "share_sampled" in report, report
    # the wait-free build: no host wait, the waiting build's tree (eager on the CPU)
    graphs = json.loads((tmp_path / "gpu_check.json").read_text())["sections"][
        "graph_bookkeeping"]
    assert not graphs["captured"] and graphs["rows"]
    assert all(row["wait_free_host_waits"] == 0 and row["wait_free_same"]
               for row in graphs["rows"]), graphs


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine: the "
                    "script would run the whole check")
def test_gpu_check_without_gpu_says_so(tmp_path):
    result = subprocess.run(["bash", "scripts/gpu_check.sh", str(tmp_path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "no NVIDIA GPU found" in result.stdout and "nothing was measured" in result.stdout
