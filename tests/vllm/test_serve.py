"""``vllm-graft serve`` with ``--speculative-config graft.json`` on 127.0.0.1: an
OpenAI chat and a completion request answered, Graft's counters on ``/metrics`` (engine
core and API server in separate processes, so the counters crossed the process
boundary), every metric the Grafana dashboard queries among them and every Graft metric
on the dashboard; malformed requests answered 4xx and a client gone mid-stream, with the
server serving on; SIGTERM while a request streams saves the successor state at once,
drains the request to its greedy text, stops the server cleanly and saves again."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.cli.test_dashboard import dashboard_metric_names
from tests.vllm.conftest import graft_spec, server_env
from vllm_graft.core.successor import read_successor_file


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


def _post_status(url: str, body: dict) -> tuple[int, str]:
    try:
        _post(url, body)
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    return 200, ""


def _open_stream(url: str, body: dict):
    request = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=120)


def _read_stream_chunks(response, chunks: int | None = None) -> list[str]:
    """The texts of the next ``chunks`` streamed completion chunks (all that are left
    when ``None``, up to ``[DONE]`` or the server closing the stream)."""
    texts = []
    while chunks is None or len(texts) < chunks:
        line = response.readline()
        if not line or line.startswith(b"data: [DONE]"):
            break
        if line.startswith(b"data: {"):
            texts.append(json.loads(line[len(b"data: "):])["choices"][0]["text"])
    return texts


def _disconnect_mid_stream(url: str, body: dict, chunks: int) -> int:
    """Read ``chunks`` streamed chunks of a completion, then hang up; how many came."""
    response = _open_stream(url, body)
    read = len(_read_stream_chunks(response, chunks))
    response.close()
    return read


def test_serve_answers_and_exports_graft_metrics(tiny_models, tmp_path):
    config = tmp_path / "graft.json"
    state = tmp_path / "graft.sm"
    config.write_text(json.dumps(graft_spec(
        tiny_models.head, budget=16, isolation="global",
        successor_state={"path": state.name, "save_every_s": 0})))
    port = _free_port()
    env = server_env()
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm_graft.cli.main", "serve", str(tiny_models.target),
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
         "--max-model-len", "512", "--enforce-eager", "--speculative-config", str(config)],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    signalled = False
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
        first_text = reply["choices"][0]["text"]

        _, metrics = _get(f"{base}/metrics")
        values = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^vllm:(graft_\w+|spec_decode_num_\w+)_total\{[^}]*\} ([0-9.e+]+)$', metrics, re.M)}
        assert values["graft_trees_built"] > 0, values
        assert values["graft_verified_trees"] > 0
        assert values["spec_decode_num_drafts"] > 0
        assert re.search(r'^vllm:graft_drafting_stops_total\{[^}]*stage="0"', metrics, re.M)
        assert re.search(r'^vllm:graft_accepted_tokens_total\{[^}]*source="context"',
                         metrics, re.M)
        assert "_us_total" not in metrics
        exported = set(re.findall(r"^(vllm:\w+)\{", metrics, re.M))
        missing = dashboard_metric_names() - exported
        assert not missing, f"the dashboard queries metrics /metrics lacks: {sorted(missing)}"
        graft = {name for name in exported
                 if name.startswith("vllm:graft_") and not name.endswith("_created")}
        unshown = graft - dashboard_metric_names()
        assert not unshown, f"/metrics exports metrics the dashboard lacks: {sorted(unshown)}"

        completions = f"{base}/v1/completions"
        model = str(tiny_models.target)
        for bad in ({"model": model, "prompt": "x", "max_tokens": 10**9},
                    {"model": model, "prompt": "x", "max_tokens": -3},
                    {"model": model, "prompt": "", "max_tokens": 4},
                    {"model": model, "prompt": "x", "temperature": "hot"},
                    {"model": model, "prompt": "x", "vllm_xargs": {"graft_tenant": 5}},
                    {"model": model, "prompt": "x", "vllm_xargs": {"graft_nope": "a"}}):
            status, text = _post_status(completions, bad)
            assert 400 <= status < 500, (bad, status, text)
        for _ in range(3):
            assert _disconnect_mid_stream(completions, {
                "model": model, "prompt": "def f(x):", "max_tokens": 400,
                "ignore_eos": True, "temperature": 0}, chunks=5) == 5
        reply = _post(completions, {"model": model, "max_tokens": 32, "temperature": 0,
                                    "prompt": "for i in range(10):\n"})
        assert reply["choices"][0]["text"] == first_text  # serving on, greedy unchanged

        # SIGTERM while a request streams: the first state save runs between its steps,
        # and the request drains to the same greedy text
        long_request = {"model": model, "prompt": "class Stack:", "max_tokens": 160,
                        "ignore_eos": True, "temperature": 0}
        reference = _post(completions, long_request)["choices"][0]["text"]
        stream = _open_stream(completions, long_request)
        streamed = "".join(_read_stream_chunks(stream, chunks=3))
        os.kill(server.pid, signal.SIGTERM)
        signalled = True
        streamed += "".join(_read_stream_chunks(stream))
        assert streamed and reference.startswith(streamed), (streamed, reference)
    finally:
        if not signalled:
            os.kill(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
    served = Path(tmp_path / "serve.log").read_text()
    assert server.returncode == 0, served[-3000:]
    shutdown_lines = "\n".join(line[-220:] for line in served.splitlines()
                               if "shutdown" in line or "Graft" in line or "leaked" in line)
    # the save made as SIGTERM is seen comes first, between steps, whatever follows
    assert "successor state saved" in served and "(shutdown requested," in served, \
        shutdown_lines
    _, metadata = read_successor_file(state)
    assert metadata["reason"] in ("shutdown requested", "shutdown"), shutdown_lines
