"""Shared pieces of the engine-driving commands (warmup, calibrate, bench, the trainers)."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
from pathlib import Path

from vllm_graft.assets.datasets import Prompt
from vllm_graft.core.config import DEFAULT_TAIL_LENGTH, MAX_TAIL_LENGTH, PAPER_BUDGET


def add_training_data_args(parser, artifact: str) -> None:
    """The arguments the drafter trainers share: the target, the output directory and
    the ShareGPT prompts whose greedy answers they train on."""
    parser.add_argument("model", help="target model directory")
    parser.add_argument("--out", type=Path, required=True, help=f"{artifact} directory to write")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="cache of answers and features (default: <out>.work)")
    parser.add_argument("--prompts", type=int, default=1600, help="ShareGPT prompts to answer")
    parser.add_argument("--prompt-offset", type=int, default=200,
                        help="skip the first prompts (kept for warm-up and calibration)")
    parser.add_argument("--max-prompt-tokens", type=int, default=384)
    parser.add_argument("--max-tokens", type=int, default=256, help="answer length")
    parser.add_argument("--dtype", default="float32", help="dtype of the answer generation")
    parser.add_argument("--cache-dir", type=Path, default=None)


def training_data_settings(args) -> dict:
    """What the trainers' cached answers and features depend on (a work directory of
    either trainer serves the other)."""
    return {"model": str(Path(args.model).resolve()), "prompts": args.prompts,
            "prompt_offset": args.prompt_offset, "max_prompt_tokens": args.max_prompt_tokens,
            "max_tokens": args.max_tokens, "dtype": args.dtype}


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


@contextlib.contextmanager
def engine(model: str, speculative_config=None, **options):
    """An LLM that is shut down when the block ends. In-process unless the caller chose
    otherwise: the tools run functions in the worker through ``collective_rpc`` (an
    engine process of its own would need them pickled), and it starts several times
    faster."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    settings = dict(model=model, dtype="float32", max_model_len=4096, enforce_eager=True,
                    seed=0, max_num_seqs=16, disable_log_stats=False)
    settings.update(options)
    llm = LLM(speculative_config=speculative_config, **settings)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def counters(llm) -> dict:
    """Speculative-decoding and Graft counters (cumulative)."""
    out = {}
    for metric in llm.get_metrics():
        if metric.name.startswith(("vllm:spec_decode", "vllm:graft")):
            value = getattr(metric, "values", getattr(metric, "value", None))
            out[metric.name.removeprefix("vllm:")] = value
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


def engine_budget(parser, args, chains: bool) -> int:
    """``--budget`` as given, or its default for trees or chains; a chain longer than
    Graft-TAIL takes is a usage error naming the flag."""
    if args.budget is None:
        return DEFAULT_TAIL_LENGTH if chains else PAPER_BUDGET
    if chains and args.budget > MAX_TAIL_LENGTH:
        parser.error(f"--budget: Graft-TAIL chains take at most {MAX_TAIL_LENGTH} tokens, "
                     f"got {args.budget}")
    return args.budget


def add_engine_arguments(parser) -> None:
    """The arguments every engine-driving tool takes after MODEL."""
    parser.add_argument("--head", required=True,
                        help="EAGLE-3 head directory (or the draft model, see --drafter)")
    parser.add_argument("--drafter", choices=["eagle3", "draft_model", "dflash"],
                        default="eagle3", help="what --head is: an EAGLE-3 head, an "
                        "ordinary draft model, or a DFlash block drafter (Graft-TAIL)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--budget", type=int, default=None,
                        help=f"tree nodes (default {PAPER_BUDGET}), or Graft-TAIL chain tokens "
                             f"(default {DEFAULT_TAIL_LENGTH}, at most {MAX_TAIL_LENGTH})")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="default: $VLLM_GRAFT_CACHE or ~/.cache/vllm-graft")


def drafter_graft_keys(drafter: str) -> dict:
    """The graft keys that select ``drafter`` (a DFlash drafter needs Graft-TAIL)."""
    if drafter == "eagle3":
        return {}
    if drafter == "dflash":
        return {"drafter": "dflash", "variant": "tail"}
    return {"drafter": drafter}


def graft_config_dict(head: str | Path, **graft) -> dict:
    return {"method": "graft", "model": str(head), "graft": graft}


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
