"""``scripts/load_test.py`` end to end on the tiny models: a few seconds of its traffic
on a real Graft server and then on plain decoding's, each ``vllm-graft serve`` on
127.0.0.1. The script exits non-zero when a request failed, any deterministic answer
differed from plain decoding's or a server did not drain (requests running, or entries
left in Graft's per-request tables after the load); the test also checks that answers
were compared and that Graft's tables were read from ``/metrics``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.vllm.conftest import server_env

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "load_test.py"
PROMPTS = ["def fib(n):\n", "for i in range(10):\n", "import os\nimport sys\n",
           "class Stack:\n    def __init__(self):\n", "The capital of France is"]


def test_a_short_load_compares_every_answer_and_drains(tiny_models, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "output_tokens": 24}) + "\n"
                               for p in PROMPTS))
    out, reference = tmp_path / "out", tmp_path / "reference.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", str(tiny_models.target), "--head",
         str(tiny_models.head), "--warmup", "none", "--calibration", "none", "--prompts",
         str(prompts), "--methods", "graft", "--duration", "20", "--clients", "8",
         "--tenants", "2", "--reference", str(reference), "--out", str(out)],
        env=server_env(), capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    methods = {s["method"]: s for s in json.loads((out / "load.json").read_text())["methods"]}
    assert set(methods) == {"graft", "plain"}
    for summary in methods.values():
        assert summary["failed"] == 0
        assert summary["deterministic_answers"] > 0
        assert (summary["deterministic_identical"] == summary["deterministic_compared"]
                == summary["deterministic_answers"])
        assert summary["drained"]["drained"] and summary["drained"]["running"] == 0
        assert summary["ttft_ms_p50"] is not None
    assert methods["graft"]["drained"]["graft_table_entries"] == 0
    assert methods["plain"]["drained"]["graft_table_entries"] is None
    assert json.loads(reference.read_text())["answers"]
