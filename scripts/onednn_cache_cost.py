"""What one entry of oneDNN's primitive cache costs: memory, and the time to build it.

    .venv/bin/python scripts/onednn_cache_cost.py
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 .venv/bin/python scripts/onednn_cache_cost.py

vLLM's CPU linear layers run through ``onednn_mm`` (a per-layer handler that keeps the
primitives of its last 32 row counts), and oneDNN keeps every primitive it built, up
to ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` (default 1024), in one cache per process. A
primitive belongs to one operand shape, so each new number of query rows M in a forward
adds one per distinct weight shape. Graft's forwards (verification of trees and chains
of varied sizes, drafter levels) meet many more M than plain decoding: the cache fills
for longer, and the live heap grows until it is full. This script runs one SmolLM2-135M
MLP-shaped layer (576 -> 1536) through ``onednn_mm`` at ``--rows`` new row counts and
reports the live heap it adds per new M (glibc ``mallinfo2``), and the time of a call
that builds its primitive against one that finds it cached.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from heap_trace import _libc  # glibc with mallinfo2 declared (this folder is on the path)


def live_heap_mb(libc) -> float:
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) / 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=300, help="new row counts M to build")
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--out-features", type=int, default=1536)
    args = p.parse_args(argv)

    import torch
    from vllm import _custom_ops as ops

    libc = _libc()
    torch.manual_seed(0)
    weight = torch.randn(args.out_features, args.hidden)
    handler = ops.create_onednn_mm(weight.t(), 32)
    inputs = [torch.randn(m, args.hidden) for m in range(1, args.rows + 1)]
    ops.onednn_mm(handler, inputs[0], None)  # the handler's own set-up
    start_mb = live_heap_mb(libc)
    built = []
    for x in inputs[1:]:
        t = time.perf_counter()
        ops.onednn_mm(handler, x, None)
        built.append(time.perf_counter() - t)
    grown_mb = live_heap_mb(libc) - start_mb
    cached = []
    for _ in range(len(built)):
        t = time.perf_counter()
        ops.onednn_mm(handler, inputs[len(inputs) // 2], None)
        cached.append(time.perf_counter() - t)
    capacity = os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024 (default)")
    print(f"ONEDNN_PRIMITIVE_CACHE_CAPACITY={capacity}, {len(built)} new row counts of a "
          f"{args.hidden} -> {args.out_features} layer")
    print(f"live heap added: {grown_mb:.1f} MB, {1e3 * grown_mb / len(built):.0f} KB per new M")
    print(f"call that builds its primitive: {1e3 * statistics.median(built):.2f} ms (median); "
          f"call with a cached one at M={len(inputs) // 2}: "
          f"{1e3 * statistics.median(cached):.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
