"""``vllm-graft warmup``: serve a few warm-up conversations with Graft and save the
successor matrix it learned (the paper's warm-up rounds).

    vllm-graft warmup MODEL --head HEAD --rounds 5 --out successor.bin
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from vllm_graft.assets import datasets
from vllm_graft.assets.pypi import default_cache_dir
from vllm_graft.cli.common import (add_engine_arguments, corpus_sha256, drafter_graft_keys,
                                   engine, engine_budget, graft_config_dict, render_prompts)


def run_warmup(model: str, head: str, out: Path, *, rounds: int, max_tokens: int,
               cache_dir: Path, budget: int = 60, dtype: str = "float32",
               max_model_len: int = 4096, offset: int = 0, extra_graft: dict | None = None
               ) -> dict:
    from transformers import AutoTokenizer

    from vllm_graft.core.calibration import fingerprint_model
    from vllm_graft.vllm.rpc import save_successor_matrix

    prompts = datasets.sharegpt(cache_dir, limit=rounds, offset=offset)
    tokenizer = AutoTokenizer.from_pretrained(model)
    # one matrix learned from every warm-up conversation: the one the file holds
    spec = graft_config_dict(head, budget=budget,
                             **{"isolation": "global", **(extra_graft or {})})
    start = time.time()
    with engine(model, spec, dtype=dtype, max_model_len=max_model_len) as llm:
        outputs = llm.generate(render_prompts(tokenizer, prompts),
                               _sampling(max_tokens), use_tqdm=True)
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        metadata = {"rounds": rounds, "tokens": tokens,
                    "corpus_sha256": corpus_sha256(prompts),
                    "target_fingerprint": fingerprint_model(model)}
        saved = llm.collective_rpc(save_successor_matrix, args=(str(out), metadata))[0]
    return {**saved, **metadata, "seconds": round(time.time() - start, 1), "path": str(out)}


def _sampling(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def main(argv=None) -> int:
    from vllm_graft.cli.main import cpu_runtime_defaults

    p = argparse.ArgumentParser(prog="vllm-graft warmup", description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--rounds", type=int, default=5, help="warm-up conversations (ShareGPT)")
    add_engine_arguments(p)
    args = p.parse_args(argv)
    cpu_runtime_defaults()
    report = run_warmup(args.model, args.head, args.out, rounds=args.rounds,
                        max_tokens=args.max_tokens, cache_dir=args.cache_dir or default_cache_dir(),
                        budget=engine_budget(p, args, chains=args.drafter == "dflash"),
                        dtype=args.dtype,
                        extra_graft=drafter_graft_keys(args.drafter))
    print(report)
    return 0
