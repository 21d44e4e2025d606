"""Load test: ``vllm-graft serve`` under concurrent mixed traffic, one method after another.

    .venv/bin/python scripts/load_test.py --out bench/results/load-smollm2-135m
    .venv/bin/python scripts/load_test.py --duration 20 --methods plain,graft --out /tmp/l
    .venv/bin/python scripts/load_test.py --soak --methods graft --duration 3600 \
        --reference bench/results/load-soak/reference.json --out bench/results/load-soak

Each method (plain decoding last) gets its own server on 127.0.0.1 serving SmolLM2-135M
(the committed EAGLE-3 head and warm-up file for the speculative ones) and the same
traffic for ``--duration`` seconds, driven by vLLM's own load generator (``vllm bench
serve``, four streams at once, each re-launched until the time is up); with the
default 32 clients (``--clients`` scales the streams):

* greedy completions, short and long prompts (14 concurrent clients);
* sampled completions, temperature 0.8, top-p 0.95 (8);
* greedy with frequency, presence and repetition penalties (4);
* greedy with structured output (a JSON-schema-free choice list) (4);

and two more clients that vLLM's generator does not play: non-streaming greedy
requests, and streams that hang up after a few chunks (clients that disconnect).

Every answer to a deterministic request (greedy, penalties, structured, non-streaming),
soaks included, is compared with plain decoding's answer to the same request: plain's
first answer under load, a saved ``--reference`` (collected once by a plain server,
``--reference-only``), and plain's server answers what neither holds. Sampled requests
are not compared: speculative sampling is exact in distribution, not in the draws.
After each load the server must drain: ``vllm:num_requests_running`` and ``_waiting``
back to zero and, for Graft, every per-request table
(``vllm:graft_request_table_entries``). The server's resident memory (API server,
engine core and workers) is sampled every few seconds; time to first token is reported
beside throughput. Writes ``load.json``, ``report.md`` and ``load.png`` to ``--out`` and
exits non-zero when a request failed, an answer differed or a server did not drain.
"""

from __future__ import annotations

import argparse
import hashlib
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
from concurrent.futures import ThreadPoolExecutor
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
EXTRA_CLIENTS = 2  # non-streaming greedy, and the client that hangs up
DRAIN_TIMEOUT_S = 180


def scaled_streams(clients: int) -> dict:
    """:data:`STREAMS` with their concurrencies scaled to ``clients`` in all (the two
    extra clients included; at least one client per stream, greedy takes the rest)."""
    streamed = clients - EXTRA_CLIENTS
    if streamed < len(STREAMS):
        raise ValueError(f"--clients must be at least {len(STREAMS) + EXTRA_CLIENTS}")
    full = sum(c for c, _ in STREAMS.values())
    out = {name: (max(1, round(c * streamed / full)), fields)
           for name, (c, fields) in STREAMS.items() if name != "greedy"}
    return {"greedy": (streamed - sum(c for c, _ in out.values()), STREAMS["greedy"][1]),
            **out}


@dataclass
class MethodRun:
    name: str
    answers: list = field(default_factory=list)  # ((stream, prompt id), text), deterministic
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
    drained: dict = field(default_factory=dict)  # the gauges after the load


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
                 onednn_primitive_cache: int | None = None,
                 serve_args: list[str] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "vllm_graft.cli.main", "serve", str(model), "--host",
           "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
           "--max-num-seqs", "32", "--seed", "0", "--enforce-eager", *serve_args]
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


def scheduler_gauges(text: str) -> dict:
    """What must be zero once a load has drained, from Prometheus text: running and
    waiting requests and, for Graft, the entries of its per-request tables (each summed
    over engines; ``None`` when the server exports no such gauge)."""
    names = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
             "vllm:graft_request_table_entries": "graft_table_entries"}
    values: dict = {"running": 0.0, "waiting": 0.0, "graft_table_entries": None}
    for line in text.splitlines():
        key = names.get(line.split("{")[0].split(" ")[0])
        if key is not None:
            values[key] = (values[key] or 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def is_drained(values: dict, graft: bool) -> bool:
    if values["running"] or values["waiting"]:
        return False
    if not graft:
        return True
    return values["graft_table_entries"] == 0


def wait_drained(base: str, graft: bool, timeout: float = DRAIN_TIMEOUT_S) -> dict:
    """Polls ``/metrics`` until nothing runs or waits and Graft's per-request tables
    are empty; the last values, with ``drained`` false after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while True:
        with urllib.request.urlopen(f"{base}/metrics", timeout=60) as response:
            values = scheduler_gauges(response.read().decode())
        values["drained"] = is_drained(values, graft)
        if values["drained"] or time.time() > deadline:
            return values
        time.sleep(2)


def post(base: str, body: dict, timeout: float = 600) -> dict:
    request = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def run_stream(name: str, base: str, model: str, prompts: list[dict], deadline: float,
               work: Path, run: MethodRun, lock: threading.Lock, concurrency: int,
               tenant: str | None = None) -> None:
    """``vllm bench serve`` again and again until the deadline; each launch sends the
    next slice of the prompt list (in order, so outputs map back to prompts); every
    request names ``tenant`` in its ``user`` field when given."""
    fields = STREAMS[name][1]
    extra = {k: v for k, v in fields.items() if k not in ("temperature", "top_p")}
    if tenant is not None:
        extra["user"] = tenant
    offset, batch, launch = 0, concurrency * 2, 0
    last_start = deadline - min(10.0, (deadline - time.time()) / 2)
    while time.time() < last_start:
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
        if name in DETERMINISTIC:
            run.answers.append(((name, prompt["id"]), texts[i]))
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
                     run: MethodRun, lock: threading.Lock, tenant: str | None = None) -> None:
    for _, prompt in until(deadline, prompts):
        try:
            reply = post(base, {**request_body("nonstream", prompt, model),
                                **tenant_field(tenant)})
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
            run.answers.append((("nonstream", prompt["id"]), text))
            run.output_tokens += tokens


def tenant_field(tenant: str | None) -> dict:
    return {} if tenant is None else {"user": tenant}


def disconnecting_client(base: str, model: str, prompts: list[dict], deadline: float,
                         run: MethodRun, lock: threading.Lock, tenant: str | None = None) -> None:
    """Streams a long completion, reads a few chunks, hangs up."""
    for turn, prompt in until(deadline, prompts):
        body = {"model": model, "prompt": prompt["prompt"], "max_tokens": 400,
                "temperature": 0.0, "stream": True, "ignore_eos": True, **tenant_field(tenant)}
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
               work: Path, run: MethodRun, streams: dict = STREAMS, tenants: int = 0) -> None:
    """The traffic for ``duration`` seconds; with ``tenants``, each client stream names
    one of that many tenants (``user``: tenant-0, tenant-1...)."""
    lock, stop = threading.Lock(), threading.Event()
    start = time.time()
    deadline = start + duration
    names = [*streams, "nonstream", "disconnect"]
    tenant = {name: f"tenant-{i % tenants}" if tenants else None
              for i, name in enumerate(names)}
    threads = [threading.Thread(target=sample_memory, args=(server_pid, start, stop, run))]
    for name, (concurrency, _) in streams.items():
        threads.append(threading.Thread(target=run_stream, args=(
            name, base, model, prompts, deadline, work, run, lock, concurrency, tenant[name])))
    threads.append(threading.Thread(target=nonstream_client, args=(
        base, model, prompts, deadline, run, lock, tenant["nonstream"])))
    threads.append(threading.Thread(target=disconnecting_client, args=(
        base, model, prompts[::-1], deadline, run, lock, tenant["disconnect"])))
    for t in threads:
        t.daemon = True  # a stopped run (SIGTERM) does not wait for its clients
        t.start()
    for t in threads[1:]:
        t.join()
    run.seconds = time.time() - start
    stop.set()
    threads[0].join()


# ---- plain decoding's answers ------------------------------------------------------------
def request_body(stream: str, prompt: dict, model: str) -> dict:
    """The request a deterministic stream sends for ``prompt`` (tenant aside)."""
    fields = {"temperature": 0.0} if stream == "nonstream" else dict(STREAMS[stream][1])
    return {"model": model, "prompt": prompt["prompt"], "max_tokens": prompt["output_tokens"],
            **fields}


def reference_id(stream: str, prompt: dict) -> str:
    """A reference answer's name in ``--reference``: the stream and a digest of what
    decides the answer (prompt text, length, sampling fields; not the model path)."""
    body = request_body(stream, prompt, "")
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
    return f"{stream}/{prompt['id']}/{digest}"


def load_reference(path: Path | None, prompts: list[dict]) -> dict:
    """(stream, prompt id) -> plain's answer, from a ``--reference`` file (answers to
    other prompts or settings are ignored)."""
    if path is None or not path.is_file():
        return {}
    saved = json.loads(path.read_text())["answers"]
    return {(stream, p["id"]): saved[reference_id(stream, p)]
            for p in prompts for stream in DETERMINISTIC if reference_id(stream, p) in saved}


def save_reference(path: Path, prompts: list[dict], reference: dict, model: str,
                   serve_args: list[str]) -> None:
    by_id = {p["id"]: p for p in prompts}
    answers = {reference_id(stream, by_id[i]): text
               for (stream, i), text in sorted(reference.items())}
    path.write_text(json.dumps({"model": model, "serve_args": serve_args,
                                "answers": answers}, indent=1) + "\n")


def answer_missing(base: str, model: str, prompts: list[dict], reference: dict,
                   keys, threads: int = 8) -> int:
    """Plain decoding's answer (the server at ``base``) to every key in ``keys`` the
    reference lacks, ``threads`` requests at a time; how many were asked."""
    from tqdm import tqdm

    by_id = {p["id"]: p for p in prompts}
    missing = sorted(set(keys) - set(reference))

    def answer(key):
        return key, post(base, request_body(key[0], by_id[key[1]], model))["choices"][0]["text"]

    with ThreadPoolExecutor(threads) as pool:
        for key, text in tqdm(pool.map(answer, missing), total=len(missing),
                              desc="plain decoding's answers", mininterval=30):
            reference[key] = text
    return len(missing)


def all_keys(prompts: list[dict]) -> list[tuple[str, int]]:
    return [(stream, p["id"]) for p in prompts for stream in DETERMINISTIC]


# ---- report ---------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def compare(run: MethodRun, reference: dict) -> dict:
    """Every deterministic answer of ``run`` against plain decoding's."""
    compared = identical = 0
    mismatches = []
    for key, text in run.answers:
        if key not in reference:
            continue
        compared += 1
        if text == reference[key]:
            identical += 1
        elif len(mismatches) < 5:
            mismatches.append({"stream": key[0], "prompt": key[1], "answer": text[:200],
                               "plain": reference[key][:200]})
    return {"deterministic_answers": len(run.answers), "deterministic_compared": compared,
            "deterministic_identical": identical, "mismatches": mismatches}


def summarize(run: MethodRun, reference: dict, warmup_s: float = WARMUP_S) -> dict:
    return {
        "method": run.name, "seconds": round(run.seconds, 1), "requests": run.requests,
        "failed": len(run.failed), "failures": run.failed[:10],
        "disconnected_streams": run.disconnects, "nonstream_requests": run.nonstream,
        "requests_per_s": round(run.requests / run.seconds, 3) if run.seconds else None,
        "output_tokens_per_s": round(run.output_tokens / run.seconds, 2) if run.seconds else None,
        "ttft_ms_p50": _ms(percentile(run.ttfts, 50)),
        "ttft_ms_p99": _ms(percentile(run.ttfts, 99)),
        "itl_ms_p50": _ms(percentile(run.itls, 50)), "itl_ms_p99": _ms(percentile(run.itls, 99)),
        **compare(run, reference), "drained": run.drained,
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
    columns = ["method", "requests", "req/s", "output tok/s", "x plain", "TTFT p50 / p99 ms",
               "ITL p50 / p99 ms", "failed", "deterministic answers identical to plain",
               "drained after the load",
               f"RSS after {warmup_s:g} s of warm-up, first -> last MB",
               "RSS growth, second half MB", "RSS trend, second half MB/min",
               "RSS floor (lowest of each minute) after warm-up, first -> last MB, MB/min"]
    rows = []
    for s in summaries:
        ratio = (f"{s['output_tokens_per_s'] / plain['output_tokens_per_s']:.2f}"
                 if plain and plain["output_tokens_per_s"] else "")
        same = f"{s['deterministic_identical']} / {s['deterministic_compared']}"
        if s.get("deterministic_answers", s["deterministic_compared"]) != s[
                "deterministic_compared"]:
            same += f" ({s['deterministic_answers']} answers)"
        drained = s.get("drained") or {}
        rows.append([
            s["method"], s["requests"], s["requests_per_s"], s["output_tokens_per_s"], ratio,
            f"{s['ttft_ms_p50']} / {s['ttft_ms_p99']}", f"{s['itl_ms_p50']} / {s['itl_ms_p99']}",
            s["failed"], same, drain_text(drained),
            f"{s['memory_mb_first']} -> {s['memory_mb_last']}",
            s["memory_mb_second_half_growth"], s["memory_mb_per_min_second_half"],
            f"{s['memory_mb_floor_first']} -> {s['memory_mb_floor_last']}, "
            f"{s['memory_mb_floor_per_min']}"])
    lines = [f"# Load test: {setup['model']}, {setup['duration_s']} s per method, "
             f"{setup['clients']} concurrent clients", "",
             f"Command: `{setup['command']}`", "",
             *markdown_table(columns, rows, align="lrrrrllrlllrrl")]
    streams = setup.get("streams") or {name: c for name, (c, _) in STREAMS.items()}
    lines += ["", "Traffic per method: " + ", ".join(
        f"{name} ({c} clients)" for name, c in streams.items())
        + ", non-streaming greedy (1 client), streams hung up after 3-7 chunks (1 client)"
        + (f"; each client stream names one of {setup['tenants']} tenants (user field)"
           if setup.get("tenants") else "")
        + ". Requests counted: all sent (disconnected streams excluded). Deterministic: "
        "greedy, greedy with penalties, structured output and non-streaming greedy "
        "requests; every answer compared with plain decoding's answer to the same "
        "request" + (f" ({setup['reference']})" if setup.get("reference") else "")
        + ". Drained: running and waiting requests and Graft's per-request tables "
        "(vllm:graft_request_table_entries) back to zero after the load.", ""]
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


def drain_text(drained: dict) -> str:
    if not drained:
        return ""
    if drained.get("drained"):
        return "yes"
    tables = drained.get("graft_table_entries")
    return (f"NO: {drained['running']:g} running, {drained['waiting']:g} waiting, "
            + ("no vllm:graft_request_table_entries" if tables is None
               else f"{tables:g} entries in Graft's per-request tables"))


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


def read_prompt_file(path: Path) -> list[dict]:
    """``--prompts``: JSON lines of {"prompt": text, "output_tokens": n}."""
    prompts = []
    for i, line in enumerate(path.read_text().splitlines()):
        row = json.loads(line)
        if not isinstance(row.get("prompt"), str) or not isinstance(row.get("output_tokens"), int):
            raise ValueError(f"{path}, line {i + 1}: needs \"prompt\" (text) and "
                             f"\"output_tokens\" (an integer)")
        prompts.append({"id": i, "prompt": row["prompt"], "output_tokens": row["output_tokens"],
                        "kind": row.get("kind", "short")})
    return prompts


def serve_one(name: str, model: Path, spec: dict | None, work: Path, args, prompts: list[dict],
              reference: dict, runs: list[MethodRun], streams: dict) -> MethodRun:
    """One method's server: the load, the drain, and for plain decoding the reference
    answers (its first under load, then those the other runs need)."""
    run = MethodRun(name)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    (work / name).mkdir(exist_ok=True)
    log = work / name / "server.log"
    print(f"load test: {name}: starting the server", flush=True)
    server = start_server(model, spec, port, log, args.onednn_primitive_cache, args.serve_arg)
    try:
        wait_ready(server, base, log)
        post(base, {"model": str(model), "prompt": "Hello", "max_tokens": 8})
        if args.duration > 0:
            print(f"load test: {name}: {args.duration:.0f} s of load", flush=True)
            load_phase(base, str(model), server.pid, prompts, args.duration, work / name, run,
                       streams, args.tenants)
            run.drained = wait_drained(base, graft=spec is not None and
                                       spec.get("method") == "graft")
            print(f"load test: {name}: drained after the load: {drain_text(run.drained)}",
                  flush=True)
            run.graft_counters = graft_counters(base)
        if name == "plain":
            for key, text in run.answers:
                reference.setdefault(key, text)
            needed = {key for other in runs for key, _ in other.answers}
            if args.reference_only:
                needed = set(all_keys(prompts))
            asked = answer_missing(base, str(model), prompts, reference, needed)
            print(f"load test: plain answered {asked} requests it had not seen", flush=True)
    finally:
        stop_server(server)
    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--report-only", action="store_true",
                   help="render report.md and load.png again from OUT/load.json")
    p.add_argument("--duration", type=float, default=300, help="seconds of load per method")
    p.add_argument("--methods", default="graft,eagle3,ngram,plain",
                   help="comma-separated; plain always runs, last")
    p.add_argument("--soak", action="store_true",
                   help="only the methods named, no plain decoding under load (a long run "
                        "that watches memory); answers are still compared with plain "
                        "decoding's (--reference, then a plain server for what it lacks)")
    p.add_argument("--reference", type=Path, metavar="JSON",
                   help="plain decoding's answers to the deterministic requests, read if "
                        "it exists and written with what this run added")
    p.add_argument("--reference-only", action="store_true",
                   help="only collect plain decoding's answer to every deterministic "
                        "request of the prompt set into --reference (no load)")
    p.add_argument("--clients", type=int, default=sum(c for c, _ in STREAMS.values())
                   + EXTRA_CLIENTS, help="concurrent clients in all (default %(default)s)")
    p.add_argument("--tenants", type=int, default=0,
                   help="each client stream names one of this many tenants in its user "
                        "field (default: none named)")
    p.add_argument("--graft-set", type=json.loads, default={}, metavar="JSON",
                   help="keys merged into the Graft server's graft config, e.g. "
                        "'{\"isolation\": \"tenant\"}'")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="one more argument of every server started (repeat it), e.g. "
                        "--serve-arg=--tensor-parallel-size=2")
    p.add_argument("--prompts", type=Path, metavar="JSONL",
                   help="the prompts (default: MT-Bench, GSM8K, HumanEval, essays, code)")
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
    p.add_argument("--model", default="smollm2-135m", help="a model name or a local folder")
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
    if args.reference_only and args.reference is None:
        p.error("--reference-only needs --reference")
    # SIGTERM unwinds through each server's stop (a server runs in a session of its own)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        streams = scaled_streams(args.clients)
    except ValueError as err:
        p.error(str(err))

    from vllm_graft.assets.pypi import default_cache_dir
    from vllm_graft.cli.main import cpu_runtime_defaults

    cpu_runtime_defaults()
    cache = default_cache_dir()
    if Path(args.model).is_dir():
        model, head = Path(args.model), args.head
    else:
        from vllm_graft.assets.models import prepare_model
        from vllm_graft.cli.bench import default_head

        model = prepare_model(args.model, cache)
        head = args.head or str(default_head(args.model))
    if head is None:
        p.error("--head is needed with a local model folder")
    specs = method_specs(head, args.warmup if Path(args.warmup).is_file() else None,
                         args.calibration if Path(args.calibration).is_file() else None)
    if args.graft_heap_trim is not None:
        specs["graft"]["graft"]["heap_trim_s"] = args.graft_heap_trim
    specs["graft"]["graft"].update(args.graft_set)
    named = [m for m in args.methods.split(",") if m]
    wanted = named if args.soak else [m for m in named if m != "plain"] + ["plain"]
    if args.reference_only:
        wanted, args.duration = ["plain"], 0
    unknown = [m for m in wanted if m not in specs]
    if unknown:
        p.error(f"unknown methods {unknown}; choose among {sorted(specs)}")
    if args.prompts is not None:
        prompts = read_prompt_file(args.prompts)
    else:
        from transformers import AutoTokenizer

        prompts = build_prompts(cache, AutoTokenizer.from_pretrained(model))
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()

    reference = load_reference(args.reference, prompts)
    runs: list[MethodRun] = []
    for name in wanted:
        runs.append(serve_one(name, model, specs[name], work, args, prompts, reference, runs,
                              streams))
        print(f"load test: {name}: {runs[-1].requests} requests, "
              f"{len(runs[-1].failed)} failed", flush=True)
    if set(key for run in runs for key, _ in run.answers) - set(reference):
        serve_one("plain", model, None, work, argparse.Namespace(**{
            **vars(args), "duration": 0}), prompts, reference, runs, streams)
    if args.reference is not None:
        args.reference.parent.mkdir(parents=True, exist_ok=True)
        save_reference(args.reference, prompts, reference, args.model, args.serve_arg)
    if args.reference_only:
        shutil.rmtree(work, ignore_errors=True)
        print(f"load test: {len(reference)} answers of plain decoding in {args.reference}")
        return 0
    ordered = runs if args.soak else [runs[-1], *runs[:-1]]
    warmup_s = WARMUP_S if args.memory_warmup is None else args.memory_warmup
    summaries = [summarize(run, reference, warmup_s) for run in ordered]
    command = "scripts/load_test.py " + " ".join(
        a if not a.startswith("/") else os.path.relpath(a, REPO) for a in (argv or sys.argv[1:]))
    write_report(args.out, summaries, {
        "model": Path(args.model).name, "duration_s": args.duration, "warmup_s": warmup_s,
        "clients": args.clients, "streams": {n: c for n, (c, _) in streams.items()},
        "tenants": args.tenants, "graft_set": args.graft_set, "serve_args": args.serve_arg,
        "reference": (os.path.relpath(args.reference, REPO) if args.reference else None),
        "command": command, "prompts": {"short": sum(p["kind"] == "short" for p in prompts),
                                        "long": sum(p["kind"] == "long" for p in prompts)},
        "cpus": os.cpu_count()})
    print((args.out / "report.md").read_text())
    # vLLM's own speculation is not exact on every platform: a finding, not a failure
    exact = [s for s in summaries if specs[s["method"]] is None
             or specs[s["method"]].get("method") == "graft"]
    bad = [s for s in summaries if s["failed"] or not (s.get("drained") or {}).get("drained")]
    bad += [s for s in exact if s["deterministic_identical"] != s["deterministic_compared"]
            or s["deterministic_compared"] != s["deterministic_answers"]]
    if not bad:  # keep the generator's logs and results of a failed run
        shutil.rmtree(work, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
