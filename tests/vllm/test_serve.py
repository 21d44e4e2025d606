"""``vllm-graft serve`` with ``--speculative-config graft.json`` on 127.0.0.1: an
OpenAI chat and a completion request answered, Graft's counters on ``/metrics`` (engine
core and API server in separate processes, so the counters crossed the process
boundary), every metric the Grafana dashboard queries among them, and the server
stopped by its PID."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.cli.test_dashboard import dashboard_metric_names
from tests.vllm.conftest import graft_spec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status, response.read().decode()


def _post(url: str, body: dict, timeout: float = 120.0) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def test_serve_answers_and_exports_graft_metrics(tiny_models, tmp_path):
    config = tmp_path / "graft.json"
    config.write_text(json.dumps(graft_spec(tiny_models.head, budget=16)))
    port = _free_port()
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm_graft.cli.main", "serve", str(tiny_models.target),
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
         "--max-model-len", "512", "--enforce-eager", "--speculative-config", str(config)],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 240
        while True:
            assert server.poll() is None, Path(tmp_path / "serve.log").read_text()[-3000:]
            try:
                if _get(f"{base}/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.time() < deadline, "server not ready in 240 s"
            time.sleep(0.5)

        reply = _post(f"{base}/v1/chat/completions", {
            "model": str(tiny_models.target), "max_tokens": 48, "temperature": 0,
            "messages": [{"role": "user", "content": "def fib(n):"}]})
        assert reply["choices"][0]["message"]["content"]
        assert reply["usage"]["completion_tokens"] > 0
        reply = _post(f"{base}/v1/completions", {
            "model": str(tiny_models.target), "max_tokens": 32, "temperature": 0,
            "prompt": "for i in range(10):\n"})
        assert reply["choices"][0]["text"]

        _, metrics = _get(f"{base}/metrics")
        values = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^vllm:(graft_\w+|spec_decode_num_\w+)_total\{[^}]*\} ([0-9.e+]+)$', metrics, re.M)}
        assert values["graft_trees_built"] > 0, values
        assert values["graft_verified_trees"] > 0
        assert values["spec_decode_num_drafts"] > 0
        assert "vllm:graft_stage_0_total" in metrics
        exported = set(re.findall(r"^(vllm:\w+)\{", metrics, re.M))
        missing = dashboard_metric_names() - exported
        assert not missing, f"the dashboard queries metrics /metrics lacks: {sorted(missing)}"
    finally:
        os.kill(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
    assert server.returncode is not None
