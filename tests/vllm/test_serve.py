"""``vllm-graft serve`` with ``--speculative-config graft.json`` on 127.0.0.1: an
OpenAI chat and a completion request answered, Graft's counters on ``/metrics`` (engine
core and API server in separate processes, so the counters crossed the process
boundary), every metric the Grafana dashboard queries among them and every Graft metric
on the dashboard; malformed requests answered 4xx and a client gone mid-stream, with the
server serving on; SIGTERM while a request streams saves the successor state at once,
drains the request to its greedy text, stops the server cleanly and saves again."""

from __future__ import annotations

import json
import re

from tests.cli.test_dashboard import dashboard_metric_names
from tests.vllm.conftest import graft_spec
from tests.vllm.served import (ServedModel, disconnect_mid_stream, http_get, http_post,
                               http_post_status, open_stream, read_stream_chunks)
from vllm_graft.core.successor import read_successor_file


def test_serve_answers_and_exports_graft_metrics(tiny_models, tmp_path):
    config = tmp_path / "graft.json"
    state = tmp_path / "graft.sm"
    config.write_text(json.dumps(graft_spec(
        tiny_models.head, budget=16, isolation="global",
        successor_state={"path": state.name, "save_every_s": 0})))
    server = ServedModel(tiny_models.target, tmp_path / "serve.log", config)
    base = server.base
    try:
        server.wait_ready()

        reply = http_post(f"{base}/v1/chat/completions", {
            "model": str(tiny_models.target), "max_tokens": 48, "temperature": 0,
            "messages": [{"role": "user", "content": "def fib(n):"}]})
        assert reply["choices"][0]["message"]["content"]
        assert reply["usage"]["completion_tokens"] > 0
        reply = http_post(f"{base}/v1/completions", {
            "model": str(tiny_models.target), "max_tokens": 32, "temperature": 0,
            "prompt": "for i in range(10):\n"})
        assert reply["choices"][0]["text"]
        first_text = reply["choices"][0]["text"]

        _, metrics = http_get(f"{base}/metrics")
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
            status, text = http_post_status(completions, bad)
            assert 400 <= status < 500, (bad, status, text)
        for _ in range(3):
            assert disconnect_mid_stream(completions, {
                "model": model, "prompt": "def f(x):", "max_tokens": 400,
                "ignore_eos": True, "temperature": 0}, chunks=5) == 5
        reply = http_post(completions, {"model": model, "max_tokens": 32, "temperature": 0,
                                    "prompt": "for i in range(10):\n"})
        assert reply["choices"][0]["text"] == first_text  # serving on, greedy unchanged

        # SIGTERM while a request streams: the first state save runs between its steps,
        # and the request drains to the same greedy text
        long_request = {"model": model, "prompt": "class Stack:", "max_tokens": 160,
                        "ignore_eos": True, "temperature": 0}
        reference = http_post(completions, long_request)["choices"][0]["text"]
        stream = open_stream(completions, long_request)
        streamed = "".join(read_stream_chunks(stream, chunks=3))
        server.terminate()
        streamed += "".join(read_stream_chunks(stream))
        assert streamed and reference.startswith(streamed), (streamed, reference)
    finally:
        returncode = server.stop()
    served = server.log_path.read_text()
    assert returncode == 0, served[-3000:]
    shutdown_lines = "\n".join(line[-220:] for line in served.splitlines()
                               if "shutdown" in line or "Graft" in line or "leaked" in line)
    # the save made as SIGTERM is seen comes first, between steps, whatever follows
    assert "successor state saved" in served and "(shutdown requested," in served, \
        shutdown_lines
    _, metadata = read_successor_file(state)
    assert metadata["reason"] in ("shutdown requested", "shutdown"), shutdown_lines
