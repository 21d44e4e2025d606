"""Train an EAGLE-3 head for a target, reproducibly.

    vllm-graft train-head MODEL --out HEAD_DIR [--num-prompts 1600] [--epochs 2]

The target answers ShareGPT prompts (greedy, vLLM), transformers extracts its hidden
states over prompt + answer, and the head is trained with training-time test (see
:mod:`vllm_graft.training.eagle3`). Every stage is cached in ``--work-dir``, so an
interrupted run resumes. Writes ``HEAD_DIR`` in vLLM's EAGLE-3 layout plus
``training_report.json`` (tokens, time, accuracy per step).
"""

from __future__ import annotations

import json
import shlex
import sys

from vllm_graft.assets import datasets
from vllm_graft.assets.pypi import default_cache_dir
from vllm_graft.cli.common import (add_training_data_args, answer_engine_options,
                                   command_parser, training_target_and_work_dir)
from vllm_graft.offline.engine import cpu_runtime_defaults


def build_parser():
    p = command_parser("train-head", __doc__)
    add_training_data_args(p, "head")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="the head's vocabulary: the target's most frequent answer tokens")
    p.add_argument("--ttt-steps", type=int, default=3,
                   help="training-time test: draft steps unrolled per position")
    p.add_argument("--epochs", type=int, default=2, help="passes over the features")
    p.add_argument("--lr", type=float, default=5e-4, help="learning rate")
    p.add_argument("--batch-tokens", type=int, default=2048, help="tokens per optimiser step")
    return p


def main(argv=None) -> int:
    from vllm_graft.training.data import (default_aux_layers, extract_features,
                                          generate_answers, read_answers)
    from vllm_graft.training.train import train_head

    p = build_parser()
    args = p.parse_args(argv)
    cpu_runtime_defaults()

    model, work = training_target_and_work_dir(p, args)
    cache = args.cache_dir or default_cache_dir()
    prompts = datasets.sharegpt(cache, limit=args.num_prompts, offset=args.prompt_offset)
    answers = generate_answers(str(model), prompts, work / "answers.jsonl",
                               max_prompt_tokens=args.max_prompt_tokens,
                               max_tokens=args.max_tokens, **answer_engine_options(args))
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    aux = default_aux_layers(layers)
    features = extract_features(str(model), read_answers(answers), work / "features",
                                aux_layers=aux)
    report = train_head(model, features, args.out, draft_vocab=args.draft_vocab,
                        aux_layers=aux, steps=args.ttt_steps, epochs=args.epochs, lr=args.lr,
                        batch_tokens=args.batch_tokens)
    report["command"] = "vllm-graft train-head " + shlex.join(
        argv if argv is not None else sys.argv[1:])
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0
