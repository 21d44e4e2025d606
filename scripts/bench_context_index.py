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

    .venv/bin/python scripts/bench_context_index.py
    .venv/bin/python scripts/bench_context_index.py --lengths 1024 65536 --steps 100
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable

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
    args = parser.parse_args()

    rows = [bench(length, args) for length in args.lengths]
    print(f"Context retrieval, µs per call; vocab {args.vocab:,}, n-grams "
          f"{args.min_ngram}..{args.max_ngram}, max_nodes {args.max_nodes}, max_depth "
          f"{args.max_depth}, max_matches {args.max_matches}, {args.steps} steps\n")
    print("\n".join(records_table(
        rows, cell=lambda v: f"{v:.1f}" if isinstance(v, float) else str(v))))


if __name__ == "__main__":
    main()
