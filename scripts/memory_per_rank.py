"""Graft's memory on each tensor-parallel rank, for a deployment guide.

    .venv/bin/python scripts/memory_per_rank.py                  # Qwen3-235B-A22B, TP 8
    .venv/bin/python scripts/memory_per_rank.py --tp 4 --batch 64 --matrices 16
    .venv/bin/python scripts/memory_per_rank.py --config MODEL_DIR/config.json

Counts what Graft adds to a vLLM engine, per rank: the successor matrices (every rank
holds full copies: they are small, and each rank reads them locally), the seed copy
isolated serving keeps, the EAGLE-3 head's weights (vLLM shards them like the target's
layers), the drafter's tree K/V rows and the verification logits (the target's logits
for every tree row, gathered on every rank; vLLM's own speculative decoding with as many
draft tokens holds the same). The head is taken to be one decoder layer of the target's
shape whose attention reads the concatenation of embedding and fused hidden state, the
``fc`` fusing three hidden states, and an lm head over ``--draft-vocab`` tokens, as
EAGLE-3 heads are built. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json

from vllm_graft.markdown import markdown_table

#: Qwen3-235B-A22B (its config.json)
QWEN3_235B = {"hidden_size": 4096, "num_attention_heads": 64, "num_key_value_heads": 4,
              "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936}
MB = 1e6


def head_parameters(cfg: dict, draft_vocab: int) -> int:
    hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], \
        cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    attention_in = 2 * hidden  # EAGLE-3: [embedding, fused hidden state]
    attention = attention_in * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    mlp = 3 * hidden * cfg["intermediate_size"]
    fc = 3 * hidden * hidden
    return attention + mlp + fc + draft_vocab * hidden


def rows(args, cfg: dict) -> list[tuple[str, float, str]]:
    vocab = cfg["vocab_size"]
    kv_heads = cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    matrix = vocab * args.successor_k * 4
    seed = matrix if args.matrices > 1 else 0
    head = head_parameters(cfg, args.draft_vocab) * args.dtype_bytes / args.tp
    kv_heads_per_rank = max(1, kv_heads // args.tp)  # vLLM replicates KV heads past TP = heads
    tree_rows = args.batch * args.top_k * args.max_depth
    tree_kv = tree_rows * 2 * kv_heads_per_rank * head_dim * args.dtype_bytes
    logits = args.batch * (args.budget + 1) * vocab * 4
    return [
        ("successor matrices", (matrix * args.matrices) / MB,
         f"{args.matrices} x {vocab:,} x {args.successor_k} x 4 B (full copy on every rank)"),
        ("isolation seed", seed / MB, "the warm-up copy new tenants start from (tenant, "
                                      "request modes)"),
        ("EAGLE-3 head weights", head / MB,
         f"{head_parameters(cfg, args.draft_vocab) / 1e6:,.0f} M parameters x "
         f"{args.dtype_bytes} B / TP {args.tp}"),
        ("drafter tree K/V", tree_kv / MB,
         f"{args.batch} requests x {args.top_k * args.max_depth} rows x 2 x "
         f"{kv_heads_per_rank} KV heads x {head_dim} x {args.dtype_bytes} B"),
        ("verification logits", logits / MB,
         f"{args.batch} x {args.budget + 1} rows x {vocab:,} x 4 B (fp32), transient"),
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="the target's config.json (default: Qwen3-235B-A22B)")
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel size")
    p.add_argument("--batch", type=int, default=32, help="requests drafting in one step")
    p.add_argument("--budget", type=int, default=60)
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--max-depth", type=int, default=7)
    p.add_argument("--successor-k", type=int, default=8)
    p.add_argument("--matrices", type=int, default=1,
                   help="successor matrices held (isolation max_matrices; 1: global)")
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--dtype-bytes", type=int, default=2, help="2: bf16 / fp16")
    args = p.parse_args(argv)
    cfg = QWEN3_235B
    if args.config:
        with open(args.config) as f:
            cfg = json.load(f)
    table = rows(args, cfg)
    total = sum(mb for _, mb, _ in table)
    print("\n".join(markdown_table(
        [f"per rank (TP {args.tp}, batch {args.batch}, budget {args.budget})", "MB", "what"],
        [*([name, f"{mb:,.1f}", what] for name, mb, what in table),
         ["**total**", f"**{total:,.1f}**", ""]], align="lrl")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
