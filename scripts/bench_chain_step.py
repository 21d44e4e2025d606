"""Host cost of a copy-chain step's sizing and learning, with the CPU caches cold.

A chain step's work besides the target's forward is a few hundred small numpy and
tensor calls on trees of a few dozen nodes. Right after a forward, which streams the
model's weights through the caches, each such call costs several times what it costs
in a warm loop, so this script evicts the caches (by writing a buffer larger than the
last-level cache) before every timed call, as a forward would. Timed per batch size,
median over ``--repeats``: cutting the batch's chains (``TreeSizer.trim`` in chain
mode), teaching the chain acceptance model from a verified step (``TreeSizer.observe``),
the greedy walk of the chains (``greedy_chain_walk``) and counting accepted tokens by
source (``accepted_by_source``). The chains are 9 rows (root, 5 copied tokens, 3 walked
by the successor matrix), as budget "auto" builds them; accepted lengths are random.

    .venv/bin/python scripts/bench_chain_step.py                 # batch 1 / 8 / 32
    .venv/bin/python scripts/bench_chain_step.py --batch 1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from vllm_graft.core.acceptance import AcceptanceResult, greedy_chain_walk
from vllm_graft.core.budget import CostModel, TreeSizer
from vllm_graft.core.config import StepMode
from vllm_graft.core.graft import accepted_by_source
from vllm_graft.core.hybrid import SOURCE_CONTEXT, SOURCE_RETRIEVED, HybridTree

CHAIN_ROWS = 9
COPIED = 5


def chains(batch: int, generator: torch.Generator) -> HybridTree:
    """``batch`` full chains: root, copied tokens, then the matrix's walk."""
    tokens = torch.randint(0, 49152, (batch, CHAIN_ROWS), generator=generator)
    rows = torch.arange(CHAIN_ROWS)
    source = torch.full((batch, CHAIN_ROWS), SOURCE_RETRIEVED, dtype=torch.uint8)
    source[:, 1:1 + COPIED] = SOURCE_CONTEXT
    source[:, 0] = 0
    valid = torch.ones(batch, CHAIN_ROWS, dtype=torch.bool)
    return HybridTree(tokens=tokens, parents=(rows - 1).repeat(batch, 1),
                      depths=rows.repeat(batch, 1), valid=valid, source=source,
                      num_nodes=valid.sum(1),
                      score=torch.rand(batch, CHAIN_ROWS, generator=generator))


def verified(tree: HybridTree, generator: torch.Generator) -> tuple[AcceptanceResult,
                                                                     torch.Tensor]:
    """A random accepted prefix of every chain, and target tokens that produce it."""
    batch = tree.tokens.shape[0]
    accepted = torch.randint(0, 5, (batch,), generator=generator)
    steps = torch.arange(CHAIN_ROWS - 1)
    result = AcceptanceResult(torch.where(steps < accepted[:, None], steps + 1, -1),
                              torch.zeros(batch, CHAIN_ROWS, dtype=torch.long), accepted)
    row_tokens = torch.cat([tree.tokens[:, 1:], tree.tokens[:, :1]], dim=1)
    row_tokens[torch.arange(batch), accepted] = -2  # the first mismatch
    return result, row_tokens


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
    generator = torch.Generator().manual_seed(0)
    evict = np.zeros(args.evict_mib << 20, dtype=np.uint8)
    cost = CostModel(curves={1: ([1.0, 16.0, 64.0], [18.0, 25.0, 60.0]),
                             32: ([32.0, 128.0, 512.0], [45.0, 60.0, 150.0])})
    rows = []
    for batch in args.batch:
        sizer = TreeSizer(cost)
        tree = chains(batch, generator)
        result, row_tokens = verified(tree, generator)
        timed = {
            "trim_us": lambda: sizer.trim(tree, mode=StepMode.CHAIN),
            "observe_us": lambda: sizer.observe(tree, result, mode=StepMode.CHAIN),
            "walk_us": lambda: greedy_chain_walk(tree, row_tokens),
            "by_source_us": lambda: accepted_by_source(tree, result),
        }
        row = {"batch": batch}
        row.update({name: round(cold_median_us(fn, args.repeats, evict), 1)
                    for name, fn in timed.items()})
        row["total_us"] = round(sum(v for k, v in row.items() if k.endswith("_us")), 1)
        rows.append(row)
    columns = list(rows[0])
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in columns) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"repeats": args.repeats, "evict_mib": args.evict_mib, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
