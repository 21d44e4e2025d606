"""Load test: ``vllm-graft serve`` under concurrent mixed traffic, one method after another.

    .venv/bin/python scripts/load_test.py --out bench/results/load-smollm2-135m
    .venv/bin/python scripts/load_test.py --duration 20 --methods plain,graft --out /tmp/l

Each method (plain decoding last) gets its own server on 127.0.0.1 serving SmolLM2-135M
(the committed EAGLE-3 head and warm-up file for the speculative ones) and the same
traffic for ``--duration`` seconds, driven by vLLM's own load generator (``vllm bench
serve``, four streams at once, each re-launched until the time is up):

* greedy completions, short and long prompts (14 concurrent clients);
* sampled completions, temperature 0.8, top-p 0.95 (8);
* greedy with frequency, presence and repetition penalties (4);
* greedy with structured output (a JSON-schema-free choice list) (4);

and two more clients that vLLM's generator does not play: non-streaming greedy
requests, and streams that hang up after a few chunks (clients that disconnect). Every
deterministic response (greedy, penalties, structured, non-streaming) is compared with
plain decoding's response to the same request; plain's server answers any request it
did not see under load at the end. The server's resident memory (API server, engine
core and workers) is sampled every few seconds. Writes ``load.json``, ``report.md`` and
``load.png`` to ``--out`` and exits non-zero when a request failed or a deterministic
response differed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from vllm_graft.markdown import markdown_table

REPO = Path(__file__).resolve().parents[1]
WARMUP_S = 30  # default: memory samples before this are the warm-up
STREAMS = {  # name -> (concurrency, request fields beyond prompt / max_tokens)
    "greedy": (14, {"temperature": 0.0}),
    "sampled": (8, {"temperature": 0.8, "top_p": 0.95}),
    "penalties": (4, {"temperature": 0.0, "frequency_penalty": 0.5,
                      "presence_penalty": 0.3, "repetition_penalty": 1.1}),
    "structured": (4, {"temperature": 0.0, "structured_outputs": {
        "choice": ["yes", "no", "it depends", "I do not know"]}}),
}
DETERMINISTIC = ("greedy", "penalties", "structured", "nonstream")


@dataclass
class MethodRun:
    name: str
    responses: dict = field(default_factory=dict)  # (stream, prompt id) -> text
    requests: int = 0
    failed: list = field(default_factory=list)
    output_tokens: int = 0
    ttfts: list = field(default_factory=list)
    itls: list = field(default_factory=list)
    seconds: float = 0.0
    memory: list = field(default_factory=list)  # (seconds since start, MB)
    disconnects: int = 0
    nonstream: int = 0
    graft_counters: dict = field(default_factory=dict)  # vllm:graft_* at the end


# ---- prompts -------------------------------------------------------------------------
def build_prompts(cache_dir: Path, tokenizer) -> list[dict]:
    """Short chat prompts (MT-Bench, GSM8K, HumanEval) and long ones (an essay, a
    standard-library file, about 1,000 tokens), each with its output length."""
    from vllm_graft.assets import datasets
    from vllm_graft.training.data import chat_prompt_ids

    short = (datasets.mtbench(cache_dir, 24) + datasets.gsm8k(cache_dir, 24)
             + datasets.humaneval(cache_dir, 24))
    long = datasets.essays(cache_dir, tokenizer, 1000, limit=4) + \
        datasets.stdlib_code(tokenizer, 1000, limit=4)
    prompts = []
    for i, p in enumerate(short + long):
        text = tokenizer.decode(chat_prompt_ids(tokenizer, p))
        prompts.append({"id": i, "prompt": text, "output_tokens": 96 if i < len(short) else 48,
                        "kind": "short" if i < len(short) else "long"})
    return prompts


# ---- the server ------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, spec: dict | None, port: int, log: Path,
                 onednn_primitive_cache: int | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "vllm_graft.cli.main", "serve", str(model), "--host",
           "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
           "--max-num-seqs", "32", "--seed", "0", "--enforce-eager"]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    if onednn_primitive_cache is not None:  # see scripts/heap_trace.py
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(onednn_primitive_cache)
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def wait_ready(server: subprocess.Popen, base: str, log: Path, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"server not ready in {timeout} s")


def stop_server(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def resident_mb(root_pid: int) -> float:
    import psutil

    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 1e6


# ---- traffic ------------------------------------------------------------------------------
def graft_counters(base: str) -> dict:
    """Graft's Prometheus counters on the server (``vllm:graft_*_total``) by the worker's
    names and units, summed over engines; empty for a server without Graft: what the
    throughput guard chose (``guard_<mode>_steps``)."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=60) as response:
        return parse_graft_counters(response.read().decode())


def parse_graft_counters(text: str) -> dict:
    from vllm_graft.vllm.metrics import worker_of

    counters: dict[str, float] = {}
    for line in text.splitlines():
        series, value = line.rsplit(" ", 1) if " " in line else (line, "")
        name = series.split("{")[0]
        if not name.startswith("vllm:graft_") or not name.endswith("_total"):
            continue
        labels = {k: v for k, v in re.findall(r'(\w+)="([^"]*)"', series)
                  if k not in ("engine", "model_name")}
        worker, scale = worker_of(name.removeprefix("vllm:graft_").removesuffix("_total"),
                                  labels)
        counters[worker] = counters.get(worker, 0.0) + round(float(value) / scale, 3)
    return counters


def post(base: str, body: dict, timeout: float = 600) -> dict:
    request = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def run_stream(name: str, base: str, model: str, prompts: list[dict], deadline: float,
               work: Path, run: MethodRun, lock: threading.Lock) -> None:
    """``vllm bench serve`` again and again until the deadline; each launch sends the
    next slice of the prompt list (in order, so outputs map back to prompts)."""
    concurrency, fields = STREAMS[name]
    extra = {k: v for k, v in fields.items() if k not in ("temperature", "top_p")}
    offset, batch, launch = 0, concurrency * 2, 0
    while time.time() < deadline - 10:
        chosen = [prompts[(offset + i) % len(prompts)] for i in range(batch)]
        offset += batch
        data = work / f"{name}-{launch}.jsonl"
        data.write_text("".join(json.dumps({"prompt": p["prompt"],
                                            "output_tokens": p["output_tokens"]}) + "\n"
                                for p in chosen))
        cmd = [sys.executable, "-m", "vllm_graft.cli.main", "bench-serve", "--backend",
               "openai", "--base-url", base, "--endpoint", "/v1/completions", "--model",
               model, "--dataset-name", "custom", "--dataset-path", str(data),
               "--custom-output-len", "-1", "--skip-chat-template", "--disable-shuffle",
               "--num-prompts", str(len(chosen)), "--max-concurrency", str(concurrency),
               "--request-rate", "inf", "--seed", "0", "--disable-tqdm", "--save-result",
               "--save-detailed", "--result-dir", str(work),
               "--result-filename", f"{name}-{launch}.json",
               "--temperature", str(fields["temperature"]), "--percentile-metrics",
               "ttft,itl", "--metric-percentiles", "50,99"]
        if "top_p" in fields:
            cmd += ["--top-p", str(fields["top_p"])]
        if extra:
            cmd += ["--extra-body", json.dumps(extra)]
        started = time.time()
        log = work / f"{name}-{launch}.log"
        subprocess.run(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                       timeout=max(60, deadline - time.time() + 600))
        took = time.time() - started
        saved = work / f"{name}-{launch}.json"
        if not saved.is_file():  # the generator itself failed: every request counts
            tail = log.read_text()[-300:]
            result = {"errors": [f"vllm bench serve failed: {tail}"] * len(chosen)}
        else:
            result = json.loads(saved.read_text())
        with lock:
            collect(run, name, chosen, result)
        launch += 1
        # aim at about a minute per launch
        batch = max(concurrency, min(batch * 4, int(batch * 60 / max(took, 1.0))))


def collect(run: MethodRun, name: str, chosen: list[dict], result: dict) -> None:
    texts, errors = result.get("generated_texts", []), result.get("errors", [])
    for i, prompt in enumerate(chosen):
        error = errors[i] if i < len(errors) else "no result"
        run.requests += 1
        if error:
            run.failed.append({"stream": name, "prompt": prompt["id"], "error": error[:300]})
            continue
        run.responses[(name, prompt["id"])] = texts[i]
    run.output_tokens += int(result.get("total_output_tokens", 0))
    run.ttfts += [t for t in result.get("ttfts", []) if t]
    run.itls += [t for row in result.get("itls", []) for t in row]


def until(deadline: float, prompts: list[dict]):
    """The prompts in turn, with their turn number, until the deadline."""
    turn = 0
    while time.time() < deadline:
        yield turn, prompts[turn % len(prompts)]
        turn += 1


def nonstream_client(base: str, model: str, prompts: list[dict], deadline: float,
                     run: MethodRun, lock: threading.Lock) -> None:
    for _, prompt in until(deadline, prompts):
        try:
            reply = post(base, {"model": model, "prompt": prompt["prompt"],
                                "max_tokens": prompt["output_tokens"], "temperature": 0.0})
            text, error = reply["choices"][0]["text"], None
            tokens = reply["usage"]["completion_tokens"]
        except (OSError, KeyError, ValueError) as err:
            text, tokens, error = None, 0, err
        with lock:
            run.requests += 1
            if error is not None:
                run.failed.append({"stream": "nonstream", "prompt": prompt["id"],
                                   "error": str(error)[:300]})
                continue
            run.nonstream += 1
            run.responses[("nonstream", prompt["id"])] = text
            run.output_tokens += tokens


def disconnecting_client(base: str, model: str, prompts: list[dict], deadline: float,
                         run: MethodRun, lock: threading.Lock) -> None:
    """Streams a long completion, reads a few chunks, hangs up."""
    for turn, prompt in until(deadline, prompts):
        body = {"model": model, "prompt": prompt["prompt"], "max_tokens": 400,
                "temperature": 0.0, "stream": True, "ignore_eos": True}
        request = urllib.request.Request(f"{base}/v1/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            response = urllib.request.urlopen(request, timeout=600)
            chunks = 0
            while chunks < 3 + turn % 5:
                if response.readline().startswith(b"data: {"):
                    chunks += 1
            response.close()
            with lock:
                run.disconnects += 1
        except OSError as err:
            with lock:
                run.failed.append({"stream": "disconnect", "prompt": prompt["id"],
                                   "error": str(err)[:300]})


def sample_memory(pid: int, start: float, stop: threading.Event, run: MethodRun) -> None:
    while not stop.wait(3.0):
        run.memory.append((round(time.time() - start, 1), round(resident_mb(pid), 1)))


def load_phase(base: str, model: str, server_pid: int, prompts: list[dict], duration: float,
               work: Path, run: MethodRun) -> None:
    lock, stop = threading.Lock(), threading.Event()
    start = time.time()
    deadline = start + duration
    threads = [threading.Thread(target=sample_memory, args=(server_pid, start, stop, run))]
    for name in STREAMS:
        threads.append(threading.Thread(target=run_stream, args=(
            name, base, model, prompts, deadline, work, run, lock)))
    threads.append(threading.Thread(target=nonstream_client, args=(
        base, model, prompts, deadline, run, lock)))
    threads.append(threading.Thread(target=disconnecting_client, args=(
        base, model, prompts[::-1], deadline, run, lock)))
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    run.seconds = time.time() - start
    stop.set()
    threads[0].join()


def replay_missing(base: str, model: str, prompts: list[dict], reference: MethodRun,
                   others: list[MethodRun]) -> int:
    """Plain decoding's answer to every deterministic request another method served
    and plain did not see under load."""
    by_id = {p["id"]: p for p in prompts}
    missing = sorted({key for run in others for key in run.responses
                      if key[0] in DETERMINISTIC and key not in reference.responses})
    for stream, prompt_id in missing:
        prompt = by_id[prompt_id]
        fields = {"temperature": 0.0} if stream == "nonstream" else dict(STREAMS[stream][1])
        body = {"model": model, "prompt": prompt["prompt"],
                "max_tokens": prompt["output_tokens"], **fields}
        reference.responses[(stream, prompt_id)] = post(base, body)["choices"][0]["text"]
    return len(missing)


# ---- report ---------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summarize(run: MethodRun, reference: MethodRun | None, warmup_s: float = WARMUP_S) -> dict:
    compared = identical = 0
    mismatches = []
    if reference is not None and reference is not run:
        for key, text in run.responses.items():
            if key[0] in DETERMINISTIC and key in reference.responses:
                compared += 1
                if text == reference.responses[key]:
                    identical += 1
                elif len(mismatches) < 5:
                    mismatches.append({"stream": key[0], "prompt": key[1]})
    return {
        "method": run.name, "seconds": round(run.seconds, 1), "requests": run.requests,
        "failed": len(run.failed), "failures": run.failed[:10],
        "disconnected_streams": run.disconnects, "nonstream_requests": run.nonstream,
        "requests_per_s": round(run.requests / run.seconds, 3) if run.seconds else None,
        "output_tokens_per_s": round(run.output_tokens / run.seconds, 2) if run.seconds else None,
        "ttft_ms_p50": _ms(percentile(run.ttfts, 50)),
        "ttft_ms_p99": _ms(percentile(run.ttfts, 99)),
        "itl_ms_p50": _ms(percentile(run.itls, 50)), "itl_ms_p99": _ms(percentile(run.itls, 99)),
        "deterministic_compared": compared, "deterministic_identical": identical,
        "mismatches": mismatches,
        **memory_figures(run.memory, warmup_s),
        "graft_counters": run.graft_counters,
        "memory_trace": run.memory,
    }


def memory_figures(trace: list, warmup_s: float) -> dict:
    """The report's resident-memory figures of one server's trace."""
    after = [mb for t, mb in trace if t >= warmup_s]
    return {"memory_mb_first": after[0] if after else None,
            "memory_mb_last": after[-1] if after else None,
            "memory_mb_max": max(after) if after else None,
            "memory_mb_second_half_growth": second_half_growth(trace),
            "memory_mb_per_min_second_half": second_half_slope(trace),
            **floor_trend(trace, warmup_s)}


def second_half_growth(trace: list) -> float | None:
    """RSS at the end minus RSS halfway through the load: a leak keeps climbing here,
    while allocator pools sized for the first large batches stop."""
    if len(trace) < 4:
        return None
    end = trace[-1][0]
    middle = min(trace, key=lambda sample: abs(sample[0] - end / 2))
    return round(trace[-1][1] - middle[1], 1)


def second_half_slope(trace: list) -> float | None:
    """Least-squares slope of RSS over the second half of the load, MB per minute: a
    leak's steady climb, read through the saw-tooth of periodic heap trims that a
    difference of two single samples would mistake for growth or shrinkage."""
    if len(trace) < 4:
        return None
    end = trace[-1][0]
    return _per_minute([(t, mb) for t, mb in trace if t >= end / 2])


def floor_trend(trace: list, warmup_s: float, window_s: float = 60.0) -> dict:
    """The lowest RSS of each ``window_s`` after the warm-up: what the server keeps
    between heap trims (the peaks are a step's transient buffers, handed back by the
    next trim). A leak raises the floor; a server whose live memory holds does not.
    Returns the first and last window's floor and the floor's trend in MB/min."""
    lows: dict[int, tuple[float, float]] = {}
    for t, mb in trace:
        if t >= warmup_s:
            window = int((t - warmup_s) // window_s)
            if window not in lows or mb < lows[window][1]:
                lows[window] = (warmup_s + (window + 0.5) * window_s, mb)
    full = [lows[w] for w in sorted(lows)]
    end = trace[-1][0] if trace else 0.0
    if full and full[-1][0] + window_s / 2 > end + 1e-9:  # a last window cut short
        full = full[:-1] if len(full) > 1 else full
    return {"memory_mb_floor_first": full[0][1] if full else None,
            "memory_mb_floor_last": full[-1][1] if full else None,
            "memory_mb_floor_per_min": _per_minute(full) if len(full) >= 3 else None}


def _per_minute(points: list) -> float | None:
    """Least-squares slope of ``(seconds, MB)`` points, in MB per minute."""
    if len(points) < 2:
        return None
    mean_t = statistics.fmean(t for t, _ in points)
    mean_mb = statistics.fmean(mb for _, mb in points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    if spread == 0:
        return None
    slope = sum((t - mean_t) * (mb - mean_mb) for t, mb in points) / spread
    return round(60 * slope, 2)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1e3 * seconds, 1)


def write_report(out: Path, summaries: list[dict], setup: dict) -> None:
    (out / "load.json").write_text(json.dumps({"setup": setup, "methods": summaries},
                                              indent=1))
    render(out)


def render(out: Path) -> None:
    """report.md and load.png from load.json."""
    saved = json.loads((out / "load.json").read_text())
    setup, summaries = saved["setup"], saved["methods"]
    warmup_s = setup.get("warmup_s", WARMUP_S)
    for s in summaries:  # from the trace: a new warm-up, or results older than a figure
        s.update(memory_figures(s["memory_trace"], warmup_s))
    plain = next((s for s in summaries if s["method"] == "plain"), None)
    columns = ["method", "req/s", "output tok/s", "x plain", "TTFT p50 / p99 ms",
               "ITL p50 / p99 ms", "failed", "deterministic identical to plain",
               f"RSS after {warmup_s:g} s of warm-up, first -> last MB",
               "RSS growth, second half MB", "RSS trend, second half MB/min",
               "RSS floor (lowest of each minute) after warm-up, first -> last MB, MB/min"]
    rows = []
    for s in summaries:
        ratio = (f"{s['output_tokens_per_s'] / plain['output_tokens_per_s']:.2f}"
                 if plain and plain["output_tokens_per_s"] else "")
        same = ("(reference)" if s["method"] == "plain" else
                f"{s['deterministic_identical']} / {s['deterministic_compared']}")
        rows.append([
            s["method"], s["requests_per_s"], s["output_tokens_per_s"], ratio,
            f"{s['ttft_ms_p50']} / {s['ttft_ms_p99']}", f"{s['itl_ms_p50']} / {s['itl_ms_p99']}",
            s["failed"], same, f"{s['memory_mb_first']} -> {s['memory_mb_last']}",
            s["memory_mb_second_half_growth"], s["memory_mb_per_min_second_half"],
            f"{s['memory_mb_floor_first']} -> {s['memory_mb_floor_last']}, "
            f"{s['memory_mb_floor_per_min']}"])
    lines = [f"# Load test: {setup['model']}, {setup['duration_s']} s per method, "
             f"{setup['clients']} concurrent clients", "",
             f"Command: `{setup['command']}`", "",
             *markdown_table(columns, rows, align="lrrrllrllrrl")]
    lines += ["", "Traffic per method: " + ", ".join(
        f"{name} ({c} clients)" for name, (c, _) in STREAMS.items())
        + ", non-streaming greedy (1 client), streams hung up after 3-7 chunks (1 client). "
        "Requests counted: all sent (disconnected streams excluded). Deterministic: "
        "greedy, greedy with penalties, structured output and non-streaming greedy "
        "requests, compared with plain decoding's answer to the same request.", ""]
    for s in summaries:
        counters = s.get("graft_counters") or {}
        steps = {mode: int(counters.get(f"guard_{mode}_steps", 0))
                 for mode in ("tree", "chain", "plain")}
        if any(steps.values()):
            lines += [f"{s['method']}: the throughput guard ran "
                      + ", ".join(f"{n} {mode}" for mode, n in steps.items())
                      + " steps.", ""]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    plot(out / "load.png", summaries, warmup_s)


def plot(path: Path, summaries: list[dict], warmup_s: float = WARMUP_S) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4))
    names = [s["method"] for s in summaries]
    speed.bar(names, [s["output_tokens_per_s"] or 0 for s in summaries], color="#4c72b0")
    speed.set_ylabel("output tokens / s (all clients)")
    speed.set_title("throughput under load")
    for s in summaries:
        trace = s["memory_trace"]
        memory.plot([t for t, _ in trace], [mb for _, mb in trace], label=s["method"])
    memory.axvline(warmup_s, color="grey", linestyle=":", linewidth=1)
    memory.set_xlabel("seconds into the load")
    memory.set_ylabel("server resident memory (MB)")
    memory.set_title("memory (API server + engine + workers)")
    memory.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main -----------------------------------------------------------------------------------
def method_specs(head: str, warmup: str | None, calibration: str | None) -> dict:
    from vllm_graft.bench.methods import methods

    table = methods(budget=60)
    specs = {}
    for name in ("graft", "eagle3", "ngram", "plain"):
        key = "graft_auto" if name == "graft" else name
        specs[name] = table[key].speculative_config(head, warmup, calibration)
    return specs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--report-only", action="store_true",
                   help="render report.md and load.png again from OUT/load.json")
    p.add_argument("--duration", type=float, default=300, help="seconds of load per method")
    p.add_argument("--methods", default="graft,eagle3,ngram,plain",
                   help="comma-separated; plain always runs, last")
    p.add_argument("--soak", action="store_true",
                   help="only the methods named, no plain run and no comparison (a long "
                        "run that watches memory)")
    p.add_argument("--onednn-primitive-cache", type=int, help="ONEDNN_PRIMITIVE_CACHE_CAPACITY "
                   "of the servers started (what it bounds: scripts/heap_trace.py; default: "
                   "vllm-graft serve's 128 on a CPU; 1024 is oneDNN's own)")
    p.add_argument("--memory-warmup", type=float, metavar="S",
                   help=f"seconds of load before the report's first memory figure (default "
                        f"{WARMUP_S}; a long soak: until oneDNN's primitive cache is full); "
                        f"with --report-only, renders saved results with this warm-up")
    p.add_argument("--graft-heap-trim", type=float, metavar="S",
                   help="graft.heap_trim_s of the Graft server (default: Graft's own; 0: "
                        "no trims, as before that setting existed)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--head", help="EAGLE-3 head (default: the committed one)")
    p.add_argument("--warmup", default=str(REPO / "bench/results/smollm2-135m/warmup.bin"))
    p.add_argument("--calibration",
                   default=str(REPO / "bench/results/smollm2-135m/calibration.json"))
    args = p.parse_args(argv)
    if args.report_only:
        if args.memory_warmup is not None:
            saved = json.loads((args.out / "load.json").read_text())
            saved["setup"]["warmup_s"] = args.memory_warmup
            (args.out / "load.json").write_text(json.dumps(saved, indent=1))
        render(args.out)
        print((args.out / "report.md").read_text())
        return 0

    from transformers import AutoTokenizer

    from vllm_graft.assets.models import prepare_model
    from vllm_graft.assets.pypi import default_cache_dir
    from vllm_graft.cli.bench import default_head
    from vllm_graft.cli.main import cpu_runtime_defaults

    cpu_runtime_defaults()
    cache = default_cache_dir()
    model = prepare_model(args.model, cache)
    head = args.head or str(default_head(args.model))
    specs = method_specs(head, args.warmup if Path(args.warmup).is_file() else None,
                         args.calibration if Path(args.calibration).is_file() else None)
    if args.graft_heap_trim is not None:
        specs["graft"]["graft"]["heap_trim_s"] = args.graft_heap_trim
    named = [m for m in args.methods.split(",") if m]
    wanted = named if args.soak else [m for m in named if m != "plain"] + ["plain"]
    unknown = [m for m in wanted if m not in specs]
    if unknown:
        p.error(f"unknown methods {unknown}; choose among {sorted(specs)}")
    prompts = build_prompts(cache, AutoTokenizer.from_pretrained(model))
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()

    runs: list[MethodRun] = []
    for name in wanted:
        run = MethodRun(name)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        (work / name).mkdir()
        log = work / name / "server.log"
        print(f"load test: {name}: starting the server", flush=True)
        server = start_server(model, specs[name], port, log, args.onednn_primitive_cache)
        try:
            wait_ready(server, base, log)
            post(base, {"model": str(model), "prompt": "Hello", "max_tokens": 8})
            print(f"load test: {name}: {args.duration:.0f} s of load", flush=True)
            load_phase(base, str(model), server.pid, prompts, args.duration, work / name, run)
            run.graft_counters = graft_counters(base)
            if name == "plain":
                replayed = replay_missing(base, str(model), prompts, run, runs)
                print(f"load test: plain answered {replayed} requests it had not seen",
                      flush=True)
        finally:
            stop_server(server)
        runs.append(run)
        print(f"load test: {name}: {run.requests} requests, {len(run.failed)} failed",
              flush=True)
    reference = runs[-1] if not args.soak else None
    ordered = runs if args.soak else [runs[-1], *runs[:-1]]
    warmup_s = WARMUP_S if args.memory_warmup is None else args.memory_warmup
    summaries = [summarize(run, reference, warmup_s) for run in ordered]
    command = "scripts/load_test.py " + " ".join(
        a if not a.startswith("/") else os.path.relpath(a, REPO) for a in (argv or sys.argv[1:]))
    write_report(args.out, summaries, {
        "model": args.model, "duration_s": args.duration, "warmup_s": warmup_s,
        "clients": sum(c for c, _ in STREAMS.values()) + 2, "command": command,
        "prompts": {"short": sum(p["kind"] == "short" for p in prompts),
                    "long": sum(p["kind"] == "long" for p in prompts)},
        "cpus": os.cpu_count()})
    print((args.out / "report.md").read_text())
    # vLLM's own speculation is not exact on every platform: a finding, not a failure
    bad = [s for s in summaries if s["failed"] or (
        specs[s["method"]] is not None and specs[s["method"]].get("method") == "graft"
        and s["deterministic_identical"] != s["deterministic_compared"])]
    if not bad:  # keep the generator's logs and results of a failed run
        shutil.rmtree(work, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
