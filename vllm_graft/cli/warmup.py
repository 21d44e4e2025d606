"""Serve a few warm-up conversations with Graft and save the successor matrix it
learned (the paper's warm-up rounds).

    vllm-graft warmup MODEL --head HEAD --rounds 5 --out successor.bin
    vllm-graft warmup Qwen/Qwen3-8B --head HEAD --tensor-parallel-size 2 \\
        --max-model-len 8192 --out successor.bin
"""

from __future__ import annotations

from vllm_graft.assets.pypi import default_cache_dir
from vllm_graft.cli.common import (add_engine_arguments, command_parser, engine_budget,
                                   engine_options)
from vllm_graft.offline.engine import cpu_runtime_defaults, drafter_graft_keys
from vllm_graft.offline.models import ModelNotFoundError


def build_parser():
    p = command_parser("warmup", __doc__)
    p.add_argument("model", help="target model directory or Hugging Face Hub ID")
    p.add_argument("--rounds", type=int, default=5, help="warm-up conversations (ShareGPT)")
    add_engine_arguments(p)
    return p


def main(argv=None) -> int:
    from vllm_graft.offline.warmup import run_warmup

    p = build_parser()
    args = p.parse_args(argv)
    cpu_runtime_defaults()
    try:
        report = run_warmup(args.model, args.head, args.out, rounds=args.rounds,
                            max_tokens=args.max_tokens,
                            cache_dir=args.cache_dir or default_cache_dir(),
                            budget=engine_budget(p, args, chains=args.drafter == "dflash"),
                            extra_graft=drafter_graft_keys(args.drafter),
                            engine_options=engine_options(args))
    except ModelNotFoundError as err:
        p.error(str(err))
    print(report)
    return 0
