"""The warm-up: serve a few ShareGPT conversations with Graft and save the successor
matrix the engine learned (the paper's warm-up rounds), with the target's fingerprint
and the corpus hash in the file's metadata."""

from __future__ import annotations

import time
from pathlib import Path

from vllm_graft.assets import datasets
from vllm_graft.offline.engine import (corpus_sha256, engine, graft_config_dict,
                                       render_prompts)
from vllm_graft.offline.models import model_fingerprint


def run_warmup(model: str, head: str, out: Path, *, rounds: int, max_tokens: int,
               cache_dir: Path, budget: int = 60, offset: int = 0,
               extra_graft: dict | None = None, engine_options: dict | None = None) -> dict:
    """Warm up on ``rounds`` conversations from ShareGPT record ``offset`` and write the
    matrix to ``out``. ``engine_options``: vLLM engine arguments (dtype, tensor
    parallelism, ...). The target's fingerprint is taken first, so an unknown model
    stops before any engine starts."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_graft.vllm.rpc import save_successor_matrix

    fingerprint = model_fingerprint(model)
    prompts = datasets.sharegpt(cache_dir, limit=rounds, offset=offset)
    tokenizer = AutoTokenizer.from_pretrained(model)
    # one matrix learned from every warm-up conversation: the one the file holds
    spec = graft_config_dict(head, budget=budget,
                             **{"isolation": "global", **(extra_graft or {})})
    start = time.time()
    with engine(model, spec, **(engine_options or {})) as llm:
        outputs = llm.generate(render_prompts(tokenizer, prompts),
                               SamplingParams(temperature=0.0, max_tokens=max_tokens),
                               use_tqdm=True)
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        metadata = {"rounds": rounds, "tokens": tokens,
                    "corpus_sha256": corpus_sha256(prompts),
                    "target_fingerprint": fingerprint}
        saved = llm.collective_rpc(save_successor_matrix, args=(str(out), metadata))[0]
    return {**saved, **metadata, "seconds": round(time.time() - start, 1), "path": str(out)}
