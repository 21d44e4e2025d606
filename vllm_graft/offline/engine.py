"""An in-process vLLM engine as the tools and the benchmark start it, its counters,
and the speculative configs of a Graft run. Nothing here parses arguments: the
command line (:mod:`vllm_graft.cli`) and the harness (:mod:`vllm_graft.bench`) pass
the engine options they were given."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import sys
from pathlib import Path

from vllm_graft.assets.datasets import Prompt
from vllm_graft.machine import has_gpu

#: what every engine here is started with unless the caller passes its own (and
#: ``enforce_eager`` where there is no GPU: :func:`engine_settings`)
DEFAULT_ENGINE_SETTINGS = {"dtype": "float32", "max_model_len": 4096, "max_num_seqs": 16,
                           "seed": 0, "disable_log_stats": False}


def engine_settings(**options) -> dict:
    """:data:`DEFAULT_ENGINE_SETTINGS` with ``options`` (vLLM's engine arguments) over
    them, eager unless ``options`` say otherwise only where there is no GPU: on a GPU the
    engine captures CUDA graphs as ``vllm serve`` does, so that what the tools measure
    there (a benchmark's speeds, a calibration's costs) is what a server would run."""
    return {"enforce_eager": not has_gpu(), **DEFAULT_ENGINE_SETTINGS, **options}


def cpu_runtime_defaults(environ=os.environ) -> None:
    """Defaults vLLM's CPU backend needs on a machine without a GPU: a bounded KV cache
    (unset, vLLM tries to reserve 92 % of RAM) and Intel OpenMP for the engine
    processes it spawns (without it they run far slower)."""
    if has_gpu():
        return
    environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    preload = environ.get("LD_PRELOAD", "")
    if iomp.is_file() and str(iomp) not in preload:
        environ["LD_PRELOAD"] = f"{iomp}:{preload}" if preload else str(iomp)


@contextlib.contextmanager
def engine(model: str, speculative_config=None, **options):
    """An LLM that is shut down when the block ends, started with
    :func:`engine_settings` of ``options``. In-process unless the caller
    chose otherwise: the tools run functions in the worker through ``collective_rpc``
    (an engine process of its own would need them pickled), and it starts several
    times faster."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    llm = LLM(model=model, speculative_config=speculative_config, **engine_settings(**options))
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def counters(llm) -> dict:
    """Speculative-decoding counters and Graft's (``graft_<worker-side name>``, in the
    worker's units; cumulative)."""
    from vllm_graft.vllm.metrics import read_graft_values

    out = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            value = getattr(metric, "values", getattr(metric, "value", None))
            out[metric.name.removeprefix("vllm:")] = value
    out.update({f"graft_{name}": value for name, value in read_graft_values().items()})
    return out


def counter_delta(after: dict, before: dict) -> dict:
    out = {}
    for key, value in after.items():
        old = before.get(key, 0 if not isinstance(value, list) else [])
        if isinstance(value, list):
            old = list(old) + [0] * (len(value) - len(old))
            out[key] = [a - b for a, b in zip(value, old)]
        else:
            out[key] = value - old
    return out


def render_prompts(tokenizer, prompts: list[Prompt]):
    """Token prompts: chat prompts through the model's chat template, raw text as is."""
    from vllm.inputs import TokensPrompt

    from vllm_graft.training.data import chat_prompt_ids

    return [TokensPrompt(prompt_token_ids=chat_prompt_ids(tokenizer, p)) for p in prompts]


def corpus_sha256(prompts: list[Prompt]) -> str:
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps([p.source, p.chat, p.text]).encode())
    return h.hexdigest()


def drafter_graft_keys(drafter: str) -> dict:
    """The graft keys that select ``drafter`` (a DFlash drafter needs Graft-TAIL)."""
    if drafter == "eagle3":
        return {}
    if drafter == "dflash":
        return {"drafter": "dflash", "variant": "tail"}
    return {"drafter": drafter}


def graft_config_dict(head: str | Path, **graft) -> dict:
    return {"method": "graft", "model": str(head), "graft": graft}
