"""``vllm-graft generate``: offline generation with Graft, printing acceptance statistics.

    vllm-graft generate MODEL --speculative-config graft.json --prompts prompts.txt

Prompts come one per line from ``--prompts`` (or a few built-in ones). With ``--chat``
each prompt is a user message rendered with the model's chat template (what an
instruction-tuned model and its EAGLE-3 head were trained on). With ``--compare`` the
same prompts are also generated without speculation, in the same process, and the run
reports whether greedy outputs are token-identical and the speed ratio.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

DEFAULT_PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the nth Fibonacci number.\"\"\"\n",
    "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown",
]
DEFAULT_CHAT_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in a few sentences why the sky is blue.",
    "Give me three tips for writing clean, readable code.",
    "What is the difference between a list and a tuple in Python?",
]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="vllm-graft generate", description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--speculative-config", required=True,
                   help="inline JSON or a JSON / YAML file (method graft)")
    p.add_argument("--prompts", help="file with one prompt per line (\\n escapes allowed)")
    p.add_argument("--chat", action="store_true",
                   help="render each prompt as a user message with the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--compare", action="store_true", help="also run without speculation")
    p.add_argument("--json", help="write the statistics to this file")
    return p.parse_args(argv)


def load_prompts(path: str | None, chat: bool = False) -> list[str]:
    if path is None:
        return DEFAULT_CHAT_PROMPTS if chat else DEFAULT_PROMPTS
    with open(path) as f:
        return [line.rstrip("\n").encode().decode("unicode_escape") for line in f if line.strip()]


def run(model, spec, prompts, args) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=args.dtype, max_model_len=args.max_model_len, seed=0,
              speculative_config=spec, disable_log_stats=False, enforce_eager=True)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            ignore_eos=True)
    start = time.perf_counter()
    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in prompts]
        outputs = llm.chat(conversations, params, use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    metrics = {}
    for m in llm.get_metrics():
        if m.name.startswith(("vllm:spec_decode", "vllm:graft")):
            metrics[m.name.removeprefix("vllm:")] = getattr(m, "values", getattr(m, "value", None))
    del llm
    gc.collect()
    generated = sum(len(t) for t in tokens)
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": generated / elapsed,
            "metrics": metrics}


def summary(result: dict) -> dict:
    m = result["metrics"]
    drafts = m.get("spec_decode_num_drafts") or 0
    out = {"tokens_per_s": round(result["tokens_per_s"], 1)}
    if drafts:
        accepted = m.get("spec_decode_num_accepted_tokens", 0)
        out["mean_accepted_tokens"] = round(1 + accepted / drafts, 3)  # MAT per step
        out["verified_nodes_per_step"] = round(m.get("spec_decode_num_draft_tokens", 0) / drafts, 1)
        per_pos = m.get("spec_decode_num_accepted_tokens_per_pos") or []
        out["acceptance_by_depth"] = [round(x / drafts, 3) for x in per_pos if x]
        total = sum(m.get(f"graft_accepted_{s}", 0) for s in ("draft", "retrieved", "both"))
        if total:
            out["accepted_share_retrieved"] = round(m.get("graft_accepted_retrieved", 0) / total, 3)
        trees = m.get("graft_trees_built") or 0
        if trees:
            out["draft_forwards_per_tree"] = round(m.get("graft_draft_forwards", 0) / trees, 2)
            stages = {k.removeprefix("graft_stage_"): v for k, v in m.items()
                      if k.startswith("graft_stage_") and v}
            out["prune_stage_counts"] = stages
        lookups = m.get("graft_retrieval_lookups") or 0
        if lookups:
            out["matrix_hit_rate"] = round(m.get("graft_retrieval_hits", 0) / lookups, 3)
    return out


def main(argv=None) -> int:
    from vllm_graft.cli.main import cpu_runtime_defaults
    from vllm_graft.vllm.config import load_speculative_config_arg

    args = parse_args(argv)
    cpu_runtime_defaults()
    spec = load_speculative_config_arg(args.speculative_config)
    prompts = load_prompts(args.prompts, args.chat)
    report = {"prompts": len(prompts), "max_tokens": args.max_tokens}
    graft = run(args.model, spec, prompts, args)
    report["graft"] = summary(graft)
    if args.compare:
        plain = run(args.model, None, prompts, args)
        report["plain"] = summary(plain)
        report["speedup"] = round(graft["tokens_per_s"] / plain["tokens_per_s"], 3)
        if args.temperature == 0:
            report["greedy_identical"] = graft["tokens"] == plain["tokens"]
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report.get("greedy_identical", True) else 1
