"""Train a DFlash block drafter for a target, reproducibly.

    vllm-graft train-dflash MODEL --out DRAFTER_DIR [--num-prompts 1600] [--block 8]

The target answers ShareGPT prompts (greedy, vLLM), transformers extracts its hidden
states at the drafter's target layers over prompt + answer, and the drafter is trained
on random blocks of those answers (see :mod:`vllm_graft.training.dflash`). Every stage is
cached in ``--work-dir`` (the answers are the same file ``train-head`` writes, so one
work directory serves both). Writes ``DRAFTER_DIR`` in the layout vLLM's DFlash loads
(``config.json``, ``model.safetensors``, ``mask_embedding.pt``) plus
``training_report.json``; serve it with ``{"method": "dflash", "model": DRAFTER_DIR,
"num_speculative_tokens": BLOCK}`` or Graft-TAIL (``"drafter": "dflash"``).
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

from vllm_graft.assets import datasets
from vllm_graft.assets.pypi import default_cache_dir
from vllm_graft.cli.common import (add_training_data_args, answer_engine_options,
                                   command_parser, training_target_and_work_dir)
from vllm_graft.offline.engine import cpu_runtime_defaults


def build_parser():
    p = command_parser("train-dflash", __doc__)
    add_training_data_args(p, "drafter")
    p.add_argument("--block", type=int, default=8,
                   help="tokens per block (vLLM's num_speculative_tokens, Graft's budget)")
    p.add_argument("--layers", type=int, default=2, help="drafter decoder layers")
    p.add_argument("--target-layers", type=int, default=5,
                   help="how many target layers the drafter reads (spread evenly)")
    p.add_argument("--target-layer-ids", type=int, nargs="+", default=None,
                   help="explicit DFlash target layer ids (overrides --target-layers)")
    p.add_argument("--epochs", type=int, default=3, help="passes over the features")
    p.add_argument("--lr", type=float, default=6e-4, help="learning rate")
    p.add_argument("--anchors", type=int, default=48,
                   help="blocks per sequence and epoch (random answer positions)")
    p.add_argument("--batch-predictions", type=int, default=1536,
                   help="predicted tokens per optimiser step")
    p.add_argument("--gamma", type=float, default=4.0,
                   help="loss weight of block position j: exp(-(j - 1) / gamma)")
    p.add_argument("--all-positions", action="store_true",
                   help="score every block position (weighted) instead of sampling position "
                   "j with probability exp(-(j - 1) / gamma)")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="default: an unused special token of the tokenizer")
    p.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="dtype of the saved weights")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled blocks")
    p.add_argument("--chunk", type=int, default=200,
                   help="prompts per cached chunk of answers and of features")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    cpu_runtime_defaults()

    import torch

    from vllm_graft.bench.runner import machine_description
    from vllm_graft.training.data import (WorkDirError, check_work_settings, extract_features,
                                          generate_answers, read_answers)
    from vllm_graft.training.dflash import (default_target_layer_ids, feature_layers,
                                            train_dflash)

    model, work = training_target_and_work_dir(p, args)
    try:
        # features are cached per chunk of answers, in folders named by their first
        check_work_settings(work, {"chunk": args.chunk}, name="chunks.json")
    except WorkDirError as error:
        p.error(str(error))
    cache = args.cache_dir or default_cache_dir()
    target_layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    ids = args.target_layer_ids or default_target_layer_ids(target_layers, args.target_layers)
    if any(not 0 <= t <= target_layers - 2 for t in ids) or sorted(set(ids)) != list(ids):
        p.error(f"--target-layer-ids must be increasing ids in 0..{target_layers - 2}")
    stages = {}

    # answers and features in chunks of prompts, each cached: an interrupted run resumes
    # at the chunk it was in. The merged answers.jsonl is the file train-head reads and
    # writes, so a work directory of either command serves the other.
    clock = time.time()
    answers_path = work / "answers.jsonl"
    cached = answers_path.is_file()
    if not cached:
        prompts = datasets.sharegpt(cache, limit=args.num_prompts, offset=args.prompt_offset)
        parts = []
        (work / "answers-parts").mkdir(exist_ok=True)
        for start in range(0, len(prompts), args.chunk):
            parts.append(generate_answers(
                str(model), prompts[start:start + args.chunk],
                work / "answers-parts" / f"{start:06d}.jsonl",
                max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens,
                **answer_engine_options(args)))
        tmp = answers_path.with_suffix(".tmp")
        tmp.write_text("".join(part.read_text() for part in parts))
        tmp.replace(answers_path)
    stages["answers"] = "cached" if cached else round(time.time() - clock)
    answers = read_answers(answers_path)

    clock = time.time()
    root = work / ("features-dflash-" + "-".join(map(str, ids)))
    cached = all((root / f"{start:06d}" / "features.done").is_file()
                 for start in range(0, len(answers), args.chunk))
    features = [extract_features(str(model), answers[start:start + args.chunk],
                                 root / f"{start:06d}", aux_layers=feature_layers(ids))
                for start in range(0, len(answers), args.chunk)]
    stages["features"] = "cached" if cached else round(time.time() - clock)

    report = train_dflash(model, features, args.out, target_layer_ids=ids, layers=args.layers,
                          block=args.block, epochs=args.epochs, lr=args.lr,
                          anchors_per_seq=args.anchors,
                          batch_predictions=args.batch_predictions, gamma=args.gamma,
                          mask_token_id=args.mask_token_id, seed=args.seed,
                          sample_positions=not args.all_positions,
                          save_dtype=getattr(torch, args.save_dtype))
    stages["training"] = report["seconds"]
    report["data"] = {
        "prompts": f"ShareGPT first turns {args.prompt_offset}.."
                   f"{args.prompt_offset + args.num_prompts - 1} ({len(answers)} within "
                   f"{args.max_prompt_tokens} prompt tokens)",
        "answer_tokens": sum(len(a["answer_ids"]) for a in answers),
        "prompt_tokens": sum(len(a["prompt_ids"]) for a in answers),
        "answers": f"greedy, max {args.max_tokens} tokens, by the target itself "
                   f"(vLLM, {args.dtype})"}
    report["stage_seconds"] = stages
    # machine paths in the model cache written as $VLLM_GRAFT_CACHE/...
    report["command"] = "vllm-graft train-dflash " + shlex.join(
        argv if argv is not None else sys.argv[1:]).replace(
        str(Path(cache).resolve()), "$VLLM_GRAFT_CACHE")
    report["machine"] = machine_description()
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "loss_curve"}, indent=2))
    return 0

