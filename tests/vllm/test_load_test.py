"""``scripts/load_test.py`` end to end on the tiny models, as a soak runs it: a few
seconds of its traffic on a real Graft server (``vllm-graft serve`` on 127.0.0.1), then
a plain server answering the deterministic requests Graft served. The script exits
non-zero when a request failed, any deterministic answer differed from plain decoding's
or the server did not drain (requests running, or entries left in Graft's per-request
tables after the load); the test also checks that every answer was compared and that
Graft's tables were read from ``/metrics``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm.conftest import server_env

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "load_test.py"
PROMPTS = ["def fib(n):\n", "for i in range(10):\n", "import os\nimport sys\n",
           "class Stack:\n    def __init__(self):\n", "The capital of France is"]


def test_a_short_load_compares_every_answer_and_drains(tiny_models, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "output_tokens": 24}) + "\n"
                               for p in PROMPTS))
    out, reference = tmp_path / "out", tmp_path / "reference.json"
    run = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--model", str(tiny_models.target), "--head",
         str(tiny_models.head), "--warmup", "none", "--calibration", "none", "--prompts",
         str(prompts), "--soak", "--methods", "graft", "--duration", "20", "--clients", "8",
         "--tenants", "2", "--reference", str(reference), "--out", str(out)],
        env=server_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = run.communicate(timeout=1800)
    except subprocess.TimeoutExpired:
        run.terminate()  # the script stops the servers it started
        output, _ = run.communicate(timeout=180)
        pytest.fail(f"the load test did not finish in 30 minutes: {output[-3000:]}")
    assert run.returncode == 0, output[-4000:]
    [graft] = json.loads((out / "load.json").read_text())["methods"]
    assert graft["method"] == "graft" and graft["failed"] == 0
    assert graft["deterministic_answers"] > 0
    assert (graft["deterministic_identical"] == graft["deterministic_compared"]
            == graft["deterministic_answers"])
    assert graft["drained"] == {"running": 0, "waiting": 0, "graft_table_entries": 0,
                                "drained": True}
    assert graft["ttft_ms_p50"] is not None
    assert json.loads(reference.read_text())["answers"]  # plain decoding's, kept
