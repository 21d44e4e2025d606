"""Cost of context retrieval per step: the n-gram hash against scanning the context.

For each context length, a synthetic context (random tokens mixed with copied spans,
so that suffixes recur) is fed to a :class:`ContextIndex` one token at a time, as a
decoding request feeds it; then for ``--steps`` further steps one token is appended
and a tree is proposed. Columns, in µs per call (median over the steps, except
``extend``, the mean over every appended token):

* ``extend``: index one new token;
* ``propose``: look up the suffix in the hash and build the proposal;
* ``scan windows``: the same proposal from a numpy scan of the whole context for each
  n-gram length (sliding windows compared at once, as vLLM's n-gram proposer did);
* ``scan last``: the same from one numpy pass for the last token, longer n-grams
  checked only at those hits (a single linear pass, like vLLM's current proposer).

Both scans build the tree with the index's own code, so the gap is the lookup alone;
the script checks that all three give the same proposals. ``bytes/token`` is the
memory the index holds per context token (tracemalloc, a separate build).

``--arrival N``: what a prompt of N tokens costs the steps after it arrives. The
proposer's own ``_context_index`` (a stand-in runner whose token table holds the
prompt) is called as the engine calls it: at the step of the prompt's last prefill
chunk (``--chunk`` tokens), then once per decoding step until the index has caught up.
Per step, in ms: the first call, the worst and the median call (wall clock, and this
thread's CPU time, which leaves out what other processes on a busy host took), and how
many steps the index lagged; once with the proposer's per-step limit
(``CONTEXT_INDEX_STEP``), once indexing the whole context in the first call (the
behaviour before the limit). The heap is frozen first, as vLLM's engine freezes it
after start-up, and the garbage collector runs as it would: the worst step includes
its pauses.

``--engine N``: the inter-token latency another stream sees in a real engine
(in-process, vLLM's CPU backend, a tiny random Qwen3 target and EAGLE-3 head built in a
temporary folder with room for N tokens, Graft trees of budget 60) when a prompt of N
tokens arrives: one greedy stream decodes alone for ``--warm-steps`` steps, then the
long prompt arrives (prefilled in ``--chunk``-token chunks); the run ends once the long
request's index has caught up. Columns: the stream's median gap between steps that gave
it tokens before the arrival, its worst gap while the long prompt was prefilled (the
prefill chunks' own cost, vLLM's), its worst and median gap from the long request's
first drafting step on (where indexing falls), and the most time ``_context_index``
took in one step (wall clock and CPU time).

    .venv/bin/python scripts/bench_context_index.py
    .venv/bin/python scripts/bench_context_index.py --lengths 1024 65536 --steps 100
    .venv/bin/python scripts/bench_context_index.py --arrival 131072
    .venv/bin/python scripts/bench_context_index.py --engine 32768
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from vllm_graft.core.context import DEPTH_DECAY, ContextIndex, ContextProposal, _best_subtree
from vllm_graft.markdown import records_table

Matches = tuple[list[tuple[float, list[int]]], int]


def make_context(length: int, vocab: int, rng: random.Random) -> list[int]:
    """About half random tokens, half spans copied from earlier (code, quotes, lists)."""
    tokens = [rng.randrange(vocab) for _ in range(16)]
    while len(tokens) < length:
        if rng.random() < 0.5:
            start = rng.randrange(len(tokens) - 1)
            tokens.extend(tokens[start:start + rng.randint(4, 48)])
        else:
            tokens.extend(rng.randrange(vocab) for _ in range(rng.randint(4, 48)))
    return tokens[:length]


def collect(ends_by_n: Callable[[int], np.ndarray], context: np.ndarray, length: int,
            args: argparse.Namespace) -> Matches:
    """Apply the index's match rule (longest n first, then most recent, distinct ends)
    to end positions found by a scan."""
    matches: list[tuple[float, list[int]]] = []
    taken: set[int] = set()
    longest = 0
    for n in range(min(args.max_ngram, length - 1), args.min_ngram - 1, -1):
        for end in ends_by_n(n)[::-1].tolist():
            if end in taken:
                continue
            taken.add(end)
            matches.append((float(n), context[end + 1:end + 1 + args.max_depth].tolist()))
            longest = max(longest, n)
            if len(matches) == args.max_matches:
                return matches, longest
    return matches, longest


def scan_windows(context: np.ndarray, length: int, args: argparse.Namespace) -> Matches:
    """Compare every window of each length n with the suffix."""
    def ends(n: int) -> np.ndarray:
        windows = sliding_window_view(context[:length - 1], n)  # ends n-1 .. length-2
        return np.flatnonzero((windows == context[length - n:length]).all(axis=1)) + n - 1
    return collect(ends, context, length, args)


def scan_last(context: np.ndarray, length: int, args: argparse.Namespace) -> Matches:
    """One pass for the last token; longer n-grams are checked at its hits only."""
    hits = np.flatnonzero(context[:length - 1] == context[length - 1])
    agree = np.ones(len(hits), dtype=bool)  # hits whose last n tokens match so far
    agree_by_n = {1: agree.copy()}
    for n in range(2, args.max_ngram + 1):
        back = hits - (n - 1)
        inside = back >= 0
        agree &= inside
        agree[inside] &= context[back[inside]] == context[length - n]
        agree_by_n[n] = agree.copy()
    return collect(lambda n: hits[agree_by_n[n]], context, length, args)


def to_proposal(found: Matches, args: argparse.Namespace) -> ContextProposal:
    matches, longest = found
    if not matches:
        return ContextProposal.empty()
    return _best_subtree(matches, args.max_nodes, DEPTH_DECAY, longest)


def bytes_per_token(tokens: list[int], args: argparse.Namespace) -> float:
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    index = ContextIndex(args.min_ngram, args.max_ngram, args.max_positions)
    index.extend(tokens)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    held = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    del index
    return held / len(tokens)


def bench(length: int, args: argparse.Namespace) -> dict[str, float | int | str]:
    rng = random.Random(args.seed + length)
    tokens = make_context(length + args.steps, args.vocab, rng)
    index = ContextIndex(args.min_ngram, args.max_ngram, args.max_positions)
    started = time.perf_counter()
    for token in tokens[:length]:
        index.extend((token,))
    extend_us = (time.perf_counter() - started) / length * 1e6

    context = np.asarray(tokens, dtype=np.int64)
    timings: dict[str, list[float]] = {"propose": [], "windows": [], "last": []}
    hits = 0
    for step in range(args.steps):
        index.extend((tokens[length + step],))
        current = length + step + 1
        started = time.perf_counter()
        proposal = index.propose(args.max_nodes, args.max_depth, args.max_matches)
        timings["propose"].append(time.perf_counter() - started)
        for name, scan in (("windows", scan_windows), ("last", scan_last)):
            started = time.perf_counter()
            scanned = to_proposal(scan(context, current, args), args)
            timings[name].append(time.perf_counter() - started)
            if scanned != proposal:
                raise AssertionError(f"scan {name!r} disagrees with the index at "
                                     f"length {current}")
        hits += bool(proposal.tokens)
    median = {name: statistics.median(t) * 1e6 for name, t in timings.items()}
    return {
        "context": f"{length // 1024}K" if length % 1024 == 0 else str(length),
        "extend": extend_us,
        "propose": median["propose"],
        "scan windows": median["windows"],
        "scan last": median["last"],
        "speed-up vs last": median["last"] / median["propose"],
        "steps with a match": f"{hits / args.steps:.0%}",
        "bytes/token": bytes_per_token(tokens[:length], args),
    }


def _proposer_stand_in(step: int | None, args: argparse.Namespace) -> SimpleNamespace:
    """What the proposer's ``_context_index`` reads of its proposer."""
    return SimpleNamespace(context_indexes={}, prompt_lengths={}, CONTEXT_INDEX_STEP=step,
                           context_config=SimpleNamespace(min_ngram=args.min_ngram,
                                                          max_ngram=args.max_ngram))


def arrival(length: int, step: int | None, args: argparse.Namespace
            ) -> dict[str, float | int | str]:
    """Per-call times of the proposer's ``_context_index`` after a prompt of ``length``
    tokens arrives (the module docstring)."""
    from vllm_graft.vllm.proposer import GraftTreeDrafting, SettledRows

    tokens = make_context(length + 4096, args.vocab, random.Random(args.seed + length))
    table = np.asarray([tokens], dtype=np.int32)
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=["r"],
                                                         token_ids_cpu=table),
                             requests={"r": SimpleNamespace(num_prompt_tokens=length)})
    proposer = _proposer_stand_in(step, args)
    first, count = length - min(args.chunk, length), min(args.chunk, length)
    times: list[float] = []  # wall clock
    cpu: list[float] = []  # this thread's CPU time: what other processes took is not in
    gc.collect()
    gc.freeze()  # as vLLM's engine core does after start-up
    try:
        while True:
            settled = SettledRows(batch_row=0, rows=list(range(count)),
                                  next_tokens=tokens[first + 1:first + count + 1],
                                  first_position=first, first_token=tokens[first],
                                  drafts=True, decoding=False)
            started, started_cpu = time.perf_counter(), time.thread_time()
            index = GraftTreeDrafting._context_index(proposer, runner, settled)
            cpu.append((time.thread_time() - started_cpu) * 1e3)
            times.append((time.perf_counter() - started) * 1e3)
            if not index.pending or first + count + 1 >= len(tokens):
                break
            first, count = first + count, 1  # one decoding step's token
    finally:
        gc.unfreeze()
    return {"prompt": f"{length // 1024}K" if length % 1024 == 0 else str(length),
            "indexed per step": "all" if step is None else str(step),
            "first step ms": times[0], "worst step ms": max(times),
            "median step ms": statistics.median(times),
            "worst step CPU ms": max(cpu), "median step CPU ms": statistics.median(cpu),
            "steps to catch up": len(times)}


def _tiny_models(room: int, root: Path) -> tuple[Path, Path]:
    """A tiny target and EAGLE-3 head in ``root``, with positions for ``room`` tokens
    (the tiny models' default is 4096)."""
    from vllm_graft.testing.tiny_models import build_eagle3_head, build_target

    target = build_target(root / "target", initializer_range=0.1)
    config = json.loads((target / "config.json").read_text())
    config["max_position_embeddings"] = room
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target, build_eagle3_head(target, root / "head")


def engine_arrival(length: int, step: int | None, models: tuple[Path, Path],
                   args: argparse.Namespace) -> dict[str, float | int | str]:
    """A stream's gaps between tokens when a prompt of ``length`` tokens arrives in a
    real engine (the module docstring)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the proposer in here
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from vllm_graft.offline.engine import engine
    from vllm_graft.vllm.proposer import GraftTreeDrafting

    target, head = models
    spent: list[float] = []  # _context_index time in the current step, ms
    spent_cpu: list[float] = []  # the same in this thread's CPU time
    long_pending: list[int] = []  # the long request's pending positions, per call
    original = GraftTreeDrafting._context_index

    def timed(self, runner, settled):
        started, started_cpu = time.perf_counter(), time.thread_time()
        index = original(self, runner, settled)
        spent_cpu[-1] += (time.thread_time() - started_cpu) * 1e3
        spent[-1] += (time.perf_counter() - started) * 1e3
        if len(index) > length // 2:
            long_pending.append(index.pending)
        return index

    saved_step = GraftTreeDrafting.CONTEXT_INDEX_STEP
    GraftTreeDrafting.CONTEXT_INDEX_STEP = step
    GraftTreeDrafting._context_index = timed
    rng = random.Random(args.seed)
    stream_prompt = TokensPrompt(prompt_token_ids=[rng.randrange(5, 2000)
                                                   for _ in range(64)])
    long_prompt = TokensPrompt(prompt_token_ids=make_context(length, 2000, rng))
    params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    spec = {"method": "graft", "model": str(head), "graft": {"budget": 60}}
    steps: list[dict] = []  # per step: end time, stream tokens, phase, indexing ms
    try:
        with engine(str(target), spec, max_model_len=length + 1024,
                    max_num_batched_tokens=args.chunk, max_num_seqs=4) as llm:
            core = llm.llm_engine
            core.add_request("stream", stream_prompt, params)
            phase, settled_at = "alone", None
            while True:
                if phase == "alone" and len(steps) == args.warm_steps:
                    core.add_request("long", long_prompt, params)
                    phase = "prefill"
                spent.append(0.0)
                spent_cpu.append(0.0)
                outputs = core.step()
                got = {o.request_id: len(o.outputs[0].token_ids) for o in outputs}
                if phase == "prefill" and got.get("long"):
                    phase = "drafting"
                steps.append({"end": time.perf_counter(), "stream": got.get("stream", 0),
                              "phase": phase, "index ms": spent[-1],
                              "index CPU ms": spent_cpu[-1]})
                if phase == "drafting" and long_pending and not long_pending[-1]:
                    settled_at = settled_at or len(steps)
                    if len(steps) >= settled_at + 10:
                        break
            core.abort_request(["stream", "long"])
    finally:
        GraftTreeDrafting._context_index = original
        GraftTreeDrafting.CONTEXT_INDEX_STEP = saved_step

    gaps: dict[str, list[float]] = {"alone": [], "prefill": [], "drafting": []}
    last = None
    for record in steps:
        if record["stream"]:
            if last is not None:
                gaps[record["phase"]].append((record["end"] - last) * 1e3)
            last = record["end"]
    drafting = [r for r in steps if r["phase"] == "drafting"]
    return {"prompt": f"{length // 1024}K" if length % 1024 == 0 else str(length),
            "indexed per step": "all" if step is None else str(step),
            "stream gap alone ms (median)": statistics.median(gaps["alone"][2:]),
            "worst gap in prefill ms": max(gaps["prefill"], default=0.0),
            "worst gap after ms": max(gaps["drafting"], default=0.0),
            "median gap after ms": statistics.median(gaps["drafting"] or [0.0]),
            "worst indexing in a step ms": max((r["index ms"] for r in drafting),
                                               default=0.0),
            "worst indexing in a step CPU ms": max((r["index CPU ms"] for r in drafting),
                                                   default=0.0),
            "steps lagging": sum(1 for p in long_pending if p)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--vocab", type=int, default=50_000)
    parser.add_argument("--steps", type=int, default=200, help="proposals timed per length")
    parser.add_argument("--max-nodes", type=int, default=16)
    parser.add_argument("--max-depth", type=int, default=16)
    parser.add_argument("--max-matches", type=int, default=8)
    parser.add_argument("--min-ngram", type=int, default=2)
    parser.add_argument("--max-ngram", type=int, default=8)
    parser.add_argument("--max-positions", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arrival", type=int, nargs="+", metavar="N",
                        help="time the steps after a prompt of N tokens arrives instead")
    parser.add_argument("--engine", type=int, nargs="+", metavar="N",
                        help="measure another stream's inter-token gaps in a real engine "
                        "when a prompt of N tokens arrives instead")
    parser.add_argument("--chunk", type=int, default=2048,
                        help="prefill chunk (the engine's max_num_batched_tokens)")
    parser.add_argument("--warm-steps", type=int, default=30,
                        help="--engine: steps the stream decodes alone first")
    parser.add_argument("--index-steps", nargs="+", metavar="K",
                        help="per-step indexing limits to compare (\"all\": none); "
                        "default: the proposer's CONTEXT_INDEX_STEP and all")
    parser.add_argument("--repeats", type=int, default=1,
                        help="--arrival: runs per prompt and limit (the worst is kept)")
    args = parser.parse_args()

    cell = lambda v: f"{v:.1f}" if isinstance(v, float) else str(v)  # noqa: E731
    if args.arrival or args.engine:
        from vllm_graft.vllm.proposer import GraftTreeDrafting

        limits = [None if k == "all" else int(k) for k in args.index_steps] \
            if args.index_steps else [GraftTreeDrafting.CONTEXT_INDEX_STEP, None]
        rows = []
        for n in args.arrival or ():
            for step in limits:
                runs = [arrival(n, step, args) for _ in range(args.repeats)]
                rows.append({**runs[0], **{key: max(run[key] for run in runs) for key in
                                           ("first step ms", "worst step ms",
                                            "worst step CPU ms")},
                             **{key: statistics.median(run[key] for run in runs) for key in
                                ("median step ms", "median step CPU ms")}})
        if args.engine:
            with tempfile.TemporaryDirectory(prefix="graft-arrival-") as root:
                models = _tiny_models(max(args.engine) + 1024, Path(root))
                rows += [engine_arrival(n, step, models, args)
                         for n in args.engine for step in limits]
        print(f"A long prompt arriving, ms; n-grams {args.min_ngram}..{args.max_ngram}, "
              f"prefill chunks of {args.chunk} tokens\n")
        for kind in ("first step ms", "stream gap alone ms (median)"):
            chosen = [row for row in rows if kind in row]
            if chosen:
                print("\n".join(records_table(chosen, cell=cell)) + "\n")
        return

    rows = [bench(length, args) for length in args.lengths]
    print(f"Context retrieval, µs per call; vocab {args.vocab:,}, n-grams "
          f"{args.min_ngram}..{args.max_ngram}, max_nodes {args.max_nodes}, max_depth "
          f"{args.max_depth}, max_matches {args.max_matches}, {args.steps} steps\n")
    print("\n".join(records_table(rows, cell=cell)))


if __name__ == "__main__":
    main()
