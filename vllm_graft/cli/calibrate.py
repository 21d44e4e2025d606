"""Fit the pruning thresholds on a few warm-up conversations and write the calibration
file (how: :mod:`vllm_graft.offline.calibration`).

    vllm-graft calibrate MODEL --head HEAD --warmup successor.bin --out calibration.json
    vllm-graft calibrate MODEL --head HEAD --warmup successor.bin --variant tail \\
        --budget 5 --out calibration-tail5.json
"""

from __future__ import annotations

from vllm_graft.assets.pypi import default_cache_dir
from vllm_graft.cli.common import (add_engine_arguments, command_parser, engine_budget,
                                   engine_options)
from vllm_graft.offline.engine import cpu_runtime_defaults, drafter_graft_keys
from vllm_graft.offline.models import ModelNotFoundError


def build_parser():
    p = command_parser("calibrate", __doc__)
    p.add_argument("model", help="target model directory or Hugging Face Hub ID")
    p.add_argument("--warmup", help="successor matrix from `vllm-graft warmup`")
    p.add_argument("--rounds", type=int, default=5, help="calibration conversations")
    p.add_argument("--draft-cost", type=float, default=0.1,
                   help="cost of one draft step relative to one verification")
    p.add_argument("--variant", choices=["graft", "tail"], default="graft",
                   help="calibrate Graft trees, or Graft-TAIL chains of --budget tokens")
    add_engine_arguments(p)
    return p


def main(argv=None) -> int:
    from vllm_graft.offline.calibration import run_calibration

    p = build_parser()
    args = p.parse_args(argv)
    if args.drafter == "dflash" and args.variant != "tail":
        p.error("--drafter dflash drafts blocks: calibrate them with --variant tail")
    cpu_runtime_defaults()
    try:
        result = run_calibration(
            args.model, args.head, args.out, warmup=args.warmup, rounds=args.rounds,
            max_tokens=args.max_tokens, cache_dir=args.cache_dir or default_cache_dir(),
            draft_cost=args.draft_cost,
            budget=engine_budget(p, args, chains=args.variant == "tail"),
            variant=args.variant, extra_graft=drafter_graft_keys(args.drafter),
            engine_options=engine_options(args))
    except ModelNotFoundError as err:
        p.error(str(err))
    print({"thresholds": result["thresholds"], **result["fit"]})
    return 0
