"""Offline generation with Graft, showing the answers and acceptance statistics.

    vllm-graft generate MODEL --speculative-config graft.json --prompts-file prompts.txt
    vllm-graft generate MODEL --speculative-config graft.json --show-sources --compare
    vllm-graft generate MODEL --speculative-config graft.json --json > report.json

Prompts come one per line from ``--prompts-file`` (or a few built-in ones). With ``--chat``
each prompt is a user message rendered with the model's chat template (what an
instruction-tuned model and its EAGLE-3 head were trained on). With ``--compare`` the
same prompts are also generated without speculation, in the same process, and the run
reports whether greedy outputs are token-identical and the speed ratio. Each engine first
generates ``--warmup-tokens`` tokens for as many prompts of its own (untimed, not
counted, the prefix cache reset after): a fresh engine's first steps set up kernels for
each new shape, and budget "auto" measures its modes there, costs a server pays once
and a run of a few prompts would otherwise be timed on.
``--show-sources`` colours each answer token by its source (drafted, retrieved, both,
or produced by the target); ``--json`` prints the report, per-token sources included,
for scripts. Engine logs go to a file unless ``--verbose``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from pathlib import Path

from vllm_graft.cli.common import (RenamedFlag, add_engine_options, command_parser,
                                   engine_options)
from vllm_graft.cli.sources import LABELS, label_output, records_by_request, text_pieces
from vllm_graft.cli.tree_view import graft_checkpoints, show_trees, tree_to_draw
from vllm_graft.cli.view import comparison_table, engine_logs_to, log_tail, show_answer
from vllm_graft.offline.engine import counter_delta, counters, cpu_runtime_defaults, engine

DEFAULT_PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the nth Fibonacci number.\"\"\"\n",
    "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown",
]
#: the warm-up's text, in no built-in prompt
WARMUP_PROMPT = "Describe a walk through a city park in autumn."
DEFAULT_CHAT_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in a few sentences why the sky is blue.",
    "Give me three tips for writing clean, readable code.",
    "What is the difference between a list and a tuple in Python?",
    # an edit of given code: the answer copies its context, as coding assistants' do
    "Add type hints and a docstring to this function:\n\n"
    "def moving_average(values, window):\n"
    "    averages = []\n"
    "    total = 0\n"
    "    for i, value in enumerate(values):\n"
    "        total += value\n"
    "        if i >= window:\n"
    "            total -= values[i - window]\n"
    "        if i >= window - 1:\n"
    "            averages.append(total / window)\n"
    "    return averages",
]


def build_parser():
    p = command_parser("generate", __doc__)
    p.add_argument("model", help="target model directory or Hugging Face Hub ID")
    p.add_argument("--speculative-config", required=True,
                   help="inline JSON or a JSON / YAML file (method graft)")
    p.add_argument("--prompts-file", help="file with one prompt per line (\\n escapes "
                   "allowed; default: a few built-in prompts)")
    p.add_argument("--prompts", action=RenamedFlag, new="--prompts-file",
                   replacement="prompts_file")
    p.add_argument("--chat", action="store_true",
                   help="render each prompt as a user message with the chat template")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per answer, at most")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    p.add_argument("--warmup-tokens", type=int, default=16,
                   help="untimed tokens each engine first generates for as many prompts "
                   "of its own (0: none)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=False,
                   help="generate --max-tokens tokens even past the end of an answer "
                        "(equal lengths for timing runs)")
    p.add_argument("--compare", action="store_true", help="also run without speculation")
    p.add_argument("--one-at-a-time", action="store_true",
                   help="also time the prompts one request at a time (the latency use of "
                   "speculation), after the run of all of them together")
    p.add_argument("--show-sources", action="store_true",
                   help="colour every answer token by where it came from")
    p.add_argument("--show-tree", action="store_true",
                   help="draw one verified tree per prompt: its drafted, retrieved and copied "
                        "branches, the checkpoint that pruned the drafting, the accepted path")
    p.add_argument("--json", nargs="?", const="-", metavar="FILE",
                   help="the report as JSON (per-token text pieces and sources included), "
                        "on stdout instead of the view, or written to FILE")
    p.add_argument("--verbose", action="store_true",
                   help="show engine logs instead of writing them to --log-file")
    p.add_argument("--log-file", type=Path, default=None,
                   help="where engine logs go (default: $VLLM_GRAFT_CACHE/logs/generate.log)")
    add_engine_options(p, max_model_len=2048, max_num_seqs=256)
    return p


def parse_args(argv):
    p = build_parser()
    args = p.parse_args(argv)
    if args.warmup_tokens < 0:
        p.error(f"--warmup-tokens must be 0 or more, got {args.warmup_tokens}")
    return args


def load_prompts(path: str | None, chat: bool = False) -> list[str]:
    """One prompt per non-blank line of the UTF-8 file at ``path``, its backslash escapes
    (``\\n``, ``\\t``, ``\\u00e9``) decoded; other characters are kept as they are."""
    if path is None:
        return DEFAULT_CHAT_PROMPTS if chat else DEFAULT_PROMPTS
    with open(path, encoding="utf-8") as f:
        # unicode_escape reads bytes as Latin-1: every other character goes in as its
        # own escape, so it comes out whole
        return [line.rstrip("\n").encode("latin-1", "backslashreplace").decode("unicode_escape")
                for line in f if line.strip()]


def run(model, spec, prompts, args, record: bool = False) -> dict:
    """Generate once, after the untimed warm-up; with ``record``, also the timed run's
    verified trees (``records``) and each output token's source. ``metrics`` are the
    engine's counters over the timed run alone."""
    from vllm import SamplingParams

    from vllm_graft.vllm.rpc import start_tree_recording, take_tree_records

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            ignore_eos=args.ignore_eos)
    with engine(model, spec, **engine_options(args)) as llm:
        if args.warmup_tokens > 0:
            warmup = SamplingParams(temperature=0.0, max_tokens=args.warmup_tokens,
                                    ignore_eos=True)
            generate_all(llm, [WARMUP_PROMPT] * len(prompts), warmup, args.chat)
            llm.reset_prefix_cache()
        if record:
            llm.collective_rpc(start_tree_recording)
        outputs, result = timed_generation(llm, [prompts], params, args.chat)
        records = llm.collective_rpc(take_tree_records)[0] if record else []
        tokenizer = llm.get_tokenizer()
        alone = one_at_a_time(llm, prompts, params, args.chat) if args.one_at_a_time else None
    tokens = result["tokens"]
    result["pieces"] = [text_pieces(tokenizer, t) for t in tokens]
    if alone is not None:
        result["one_at_a_time"] = alone
    if record:
        result["records"] = records
        by_request = records_by_request(records)
        result["sources"] = [
            label_output(by_request.get(o.request_id, []), len(o.prompt_token_ids), t).sources
            for o, t in zip(outputs, tokens)]
        result["trees"] = [tree_to_draw(by_request.get(o.request_id, []), tokenizer)
                           for o in outputs]
    return result


def one_at_a_time(llm, prompts: list[str], params, chat: bool) -> dict:
    """The prompts again, each alone in the engine: tokens/s and MAT of a single
    request's decoding, and its tokens (a request's own output does not depend on the
    batch in fp32 greedy decoding, so they must equal the batched run's)."""
    return timed_generation(llm, [[prompt] for prompt in prompts], params, chat)[1]


def timed_generation(llm, batches: list[list[str]], params, chat: bool) -> tuple[list, dict]:
    """``batches`` of prompts one after another: their outputs, and the run's tokens,
    seconds, tokens/s and the engine's counters over it."""
    before = counters(llm)
    start = time.perf_counter()
    outputs = [output for batch in batches for output in generate_all(llm, batch, params, chat)]
    elapsed = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return outputs, {"tokens": tokens, "seconds": elapsed,
                     "tokens_per_s": sum(len(t) for t in tokens) / elapsed,
                     "metrics": counter_delta(counters(llm), before)}


def generate_all(llm, prompts: list[str], params, chat: bool) -> list:
    """One batch of ``prompts``, as user messages with ``chat``."""
    if chat:
        conversations = [[{"role": "user", "content": p}] for p in prompts]
        return llm.chat(conversations, params, use_tqdm=False)
    return llm.generate(prompts, params, use_tqdm=False)


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
        total = sum(m.get(f"graft_accepted_{s}", 0)
                    for s in ("draft", "retrieved", "both", "context"))
        if total:
            out["accepted_share_retrieved"] = round(m.get("graft_accepted_retrieved", 0) / total, 3)
            out["accepted_share_context"] = round(m.get("graft_accepted_context", 0) / total, 3)
        trees = m.get("graft_trees_built") or 0
        if trees:
            out["draft_forwards_per_tree"] = round(m.get("graft_draft_forwards", 0) / trees, 2)
            stages = {k.removeprefix("graft_stage_"): v for k, v in m.items()
                      if k.startswith("graft_stage_") and v}
            out["prune_stage_counts"] = stages
        lookups = m.get("graft_retrieval_lookups") or 0
        if lookups:
            out["matrix_hit_rate"] = round(m.get("graft_retrieval_hits", 0) / lookups, 3)
    modes = {mode: m.get(f"graft_guard_{mode}_steps") or 0 for mode in ("tree", "chain", "plain")}
    if any(modes.values()):  # budget "auto": the steps the throughput guard ran in each mode
        out["steps_by_mode"] = modes
    alone = result.get("one_at_a_time")
    if alone is not None:
        out["one_at_a_time"] = {key: value for key, value in summary(alone).items()
                                if key in ("tokens_per_s", "mean_accepted_tokens",
                                           "steps_by_mode")}
    return out


def default_log_file() -> Path:
    from vllm_graft.assets.pypi import default_cache_dir

    return default_cache_dir() / "logs" / "generate.log"


def build_report(prompts, graft: dict, plain: dict | None, args) -> dict:
    """Statistics (the keys scripts already read) plus, per prompt, the tokens, their
    text pieces and, when recorded, their sources."""
    report = {"prompts": len(prompts), "max_tokens": args.max_tokens,
              "warmup_tokens": args.warmup_tokens, "graft": summary(graft)}
    if plain is not None:
        report["plain"] = summary(plain)
        report["speedup"] = round(graft["tokens_per_s"] / plain["tokens_per_s"], 3)
        if "one_at_a_time" in graft and "one_at_a_time" in plain:
            report["speedup_one_at_a_time"] = round(
                graft["one_at_a_time"]["tokens_per_s"] / plain["one_at_a_time"]["tokens_per_s"], 3)
        if args.temperature == 0:
            runs = [graft, plain] + [r["one_at_a_time"] for r in (graft, plain)
                                     if "one_at_a_time" in r]
            report["greedy_identical"] = all(r["tokens"] == plain["tokens"] for r in runs)
    sources = graft.get("sources") or [None] * len(prompts)
    report["outputs"] = [
        {"prompt": prompt, "tokens": tokens, "pieces": pieces,
         **({"sources": labels} if labels is not None else {})}
        for prompt, tokens, pieces, labels in zip(prompts, graft["tokens"], graft["pieces"],
                                                  sources)]
    if graft.get("sources"):
        counts = Counter(label for labels in graft["sources"] for label in labels)
        report["graft"]["tokens_by_source"] = {k: counts[k] for k in LABELS}
    return report


def generate_both(args, spec, prompts, status) -> tuple[dict, dict | None]:
    """The Graft run, then (with --compare) plain decoding, a spinner line each."""
    record = args.show_sources or args.show_tree or args.json is not None
    with status("Starting the Graft engine and generating..."):
        graft = run(args.model, spec, prompts, args, record=record)
    plain = None
    if args.compare:
        with status("Starting the plain engine and generating..."):
            plain = run(args.model, None, prompts, args)
    return graft, plain


def show_view(console, report: dict) -> None:
    for output in report["outputs"]:
        show_answer(console, output["prompt"], output["pieces"], output.get("sources"))
    console.print(comparison_table(report))


def main(argv=None) -> int:
    from vllm_graft.vllm.config import load_speculative_config_arg

    args = parse_args(argv)
    cpu_runtime_defaults()
    # In-process engines: tree recording runs functions in the worker (a separate
    # engine process would need pickled functions), and they start several times faster.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    spec = load_speculative_config_arg(args.speculative_config)
    prompts = load_prompts(args.prompts_file, args.chat)
    log_file = None if args.verbose else (args.log_file or default_log_file())
    with engine_logs_to(log_file) as (console, terminal):
        try:
            graft, plain = generate_both(args, spec, prompts, terminal.status)
        except BaseException:
            if log_file is not None:
                terminal.print(log_tail(log_file), markup=False, highlight=False)
                terminal.print(f"generation failed; engine logs: {log_file}")
            raise
        report = build_report(prompts, graft, plain, args)
        if args.json == "-":
            console.file.write(json.dumps(report, indent=2) + "\n")
        else:
            show_view(console, report)
            if args.show_tree:
                show_trees(console, prompts, graft["trees"], graft_checkpoints(spec))
            if log_file is not None:
                terminal.print(f"engine logs: {log_file}", style="dim")
        if args.json not in (None, "-"):
            Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if report.get("greedy_identical", True) else 1
