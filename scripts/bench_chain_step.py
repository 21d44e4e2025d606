"""Host cost of a copy-chain step's sizing and learning, with the CPU caches cold.

A chain step's work besides the target's forward is small list, numpy and tensor work
on chains of a few nodes. Right after a forward, which streams the model's weights
through the caches, each call costs several times what it costs in a warm loop, so
this script evicts the caches (by writing a buffer larger than the last-level cache)
before every timed call, as a forward would. Timed per batch size, median over
``--repeats``: cutting the batch's chains (``TreeSizer.trim_chains``), the tensors of
the cut chains handed to the engine (``HostChains.to_tree``), the greedy walk of the
verified chains (``greedy_chain_walk_lists``), teaching the chain acceptance model
(``TreeSizer.observe_chains``) and counting accepted tokens by source
(``count_accepted_sources``). The chains are 9 rows (root, 5 copied tokens, 3 walked by
the successor matrix), as budget "auto" builds them; accepted lengths are random.

    .venv/bin/python scripts/bench_chain_step.py                 # batch 1 / 8 / 32
    .venv/bin/python scripts/bench_chain_step.py --batch 1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np

from vllm_graft.core.acceptance import greedy_chain_walk_lists
from vllm_graft.core.budget import CostModel, TreeSizer
from vllm_graft.markdown import records_table
from vllm_graft.core.chain import HostChains
from vllm_graft.core.graft import count_accepted_sources
from vllm_graft.core.hybrid import SOURCE_CONTEXT, SOURCE_RETRIEVED, UNKNOWN_SCORE

CHAIN_ROWS = 9
COPIED = 5
VOCAB = 49152


def chains(batch: int, rng: random.Random) -> HostChains:
    """``batch`` full chains: root, copied tokens (scored by their match), then the
    matrix's walk."""
    walked = CHAIN_ROWS - 1 - COPIED
    tokens = [[rng.randrange(VOCAB) for _ in range(CHAIN_ROWS)] for _ in range(batch)]
    source = [[0] + [SOURCE_CONTEXT] * COPIED + [SOURCE_RETRIEVED] * walked] * batch
    score = [[UNKNOWN_SCORE] + [rng.choice([0.0, 0.25, 0.5, 0.75, 1.0])] * COPIED
             + [UNKNOWN_SCORE] * walked for _ in range(batch)]
    return HostChains(tokens, source, score)


def verified(host: HostChains, rng: random.Random) -> tuple[list[int], list[int]]:
    """A random accepted prefix of every chain, and the target's tokens at every row
    (each request's rows one after another) that produce it."""
    accepted, row_tokens = [], []
    for tokens in host.tokens:
        count = rng.randrange(5)
        rows = tokens[1:] + [tokens[0]]  # the choice after each row: the next node
        rows[count] = -2  # the first mismatch
        accepted.append(count)
        row_tokens += rows
    return accepted, row_tokens


def cold_median_us(fn, repeats: int, evict: np.ndarray) -> float:
    times = []
    for _ in range(repeats):
        evict += 1  # writes every byte: the caches hold this buffer afterwards
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[repeats // 10:]) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--evict-mib", type=int, default=64,
                        help="buffer written before each call (above the last-level cache)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    rng = random.Random(0)
    evict = np.zeros(args.evict_mib << 20, dtype=np.uint8)
    cost = CostModel(curves={1: ([1.0, 16.0, 64.0], [18.0, 25.0, 60.0]),
                             32: ([32.0, 128.0, 512.0], [45.0, 60.0, 150.0])})
    rows = []
    for batch in args.batch:
        sizer = TreeSizer(cost)
        host = chains(batch, rng)
        accepted, row_tokens = verified(host, rng)
        drafts = [tokens[1:] for tokens in host.tokens]
        accepted_rows = [list(range(1, n + 1)) + [-1] * (CHAIN_ROWS - 1 - n) for n in accepted]
        lessons = [(source[1:], score[1:], n, 0)
                   for source, score, n in zip(host.source, host.score, accepted)]
        timed = {
            "trim_us": lambda: sizer.trim_chains(host),
            "to_tree_us": lambda: host.to_tree(),
            "walk_us": lambda: greedy_chain_walk_lists(drafts, row_tokens),
            "observe_us": lambda: sizer.observe_chains(lessons),
            "by_source_us": lambda: count_accepted_sources(host.source, accepted_rows),
        }
        row = {"batch": batch}
        row.update({name: round(cold_median_us(fn, args.repeats, evict), 1)
                    for name, fn in timed.items()})
        row["total_us"] = round(sum(v for k, v in row.items() if k.endswith("_us")), 1)
        rows.append(row)
    print("\n".join(records_table(rows)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"repeats": args.repeats, "evict_mib": args.evict_mib, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
