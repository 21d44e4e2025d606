"""One benchmark run: every method on the same prompts, one engine configuration.

Per method one in-process vLLM engine is started with the same settings (dtype, context
length, batch size); each dataset is generated as one batch and the engine's counters
are read before and after, so every number comes from the same run. Greedy outputs of
every method are compared with plain decoding token by token. The batch sweep keeps its
methods' engines alive together and lets them take turns, round after round
(:func:`vllm_graft.bench.engines.run_engines_interleaved`): its ratios to plain
decoding are what speed goals are judged by, and this machine's speed drifts more than
the differences measured.
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, replace
from pathlib import Path

from tqdm import tqdm

from vllm_graft.assets import datasets
from vllm_graft.bench.config import DFLASH_METHODS, BenchConfig
from vllm_graft.bench.engines import (ENGINE_WARMUP_OFFSET, ENGINE_WARMUP_TOKENS,
                                      STEP_SPLIT_KEYS, engine_warmup_source, guard_steps,
                                      run_engine, run_engines_interleaved)
from vllm_graft.bench.methods import Method, methods
from vllm_graft.offline.engine import render_prompts


def load_dataset(name: str, tokenizer, cache_dir: Path, limit: int) -> list[datasets.Prompt]:
    if name == "humaneval":
        return datasets.humaneval(cache_dir, limit)
    if name == "mtbench":
        return datasets.mtbench(cache_dir, limit)
    if name == "gsm8k":
        return datasets.gsm8k(cache_dir, limit)
    if name == "code-edit":
        return datasets.code_edit(limit)
    if name in datasets.COPY_KINDS:
        return datasets.copy_prompts(name, limit)
    kind, _, size = name.partition("-")
    tokens = int(size.rstrip("k")) * 1024
    if kind == "essays":
        return datasets.essays(cache_dir, tokenizer, tokens, limit=min(limit, 4))
    if kind == "code":
        return datasets.stdlib_code(tokenizer, tokens, limit=min(limit, 4))
    raise ValueError(f"unknown dataset {name!r}")



def summarize(method: Method, delta: dict, tokens: int, seconds: float,
              chain_tokens: int) -> dict:
    drafts = delta.get("spec_decode_num_drafts", 0) or 0
    accepted = delta.get("spec_decode_num_accepted_tokens", 0) or 0
    row = {"generated_tokens": tokens, "seconds": round(seconds, 3),
           "tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0,
           "mat": round(1 + accepted / drafts, 3) if drafts else 1.0,
           "verification_steps": drafts,
           "verified_tokens_per_step": round(1 + delta.get("spec_decode_num_draft_tokens", 0)
                                             / drafts, 2) if drafts else 1.0}
    if method.kind == "graft":
        trees = delta.get("graft_trees_built", 0) or 0
        row["draft_forwards_per_step"] = round(delta.get("graft_draft_forwards", 0) / trees, 3) \
            if trees else 0.0
        by_source = {s: delta.get(f"graft_accepted_{s}", 0)
                     for s in ("draft", "retrieved", "both", "context")}
        total = sum(by_source.values())
        for source in ("retrieved", "both", "context"):
            row[f"accepted_share_{source}"] = round(by_source[source] / total, 3) if total \
                else 0.0
        copied = delta.get("graft_context_nodes", 0)
        row["context_acceptance"] = round(by_source["context"] / copied, 3) if copied else None
        lookups = delta.get("graft_retrieval_lookups", 0)
        row["matrix_hit_rate"] = round(delta.get("graft_retrieval_hits", 0) / lookups, 3) \
            if lookups else None
        row["bookkeeping_share"] = round(delta.get("graft_bookkeeping_us", 0) / 1e6 / seconds, 4) \
            if seconds else None
        row["draft_forward_share"] = round(delta.get("graft_draft_forward_us", 0) / 1e6 / seconds, 4) \
            if seconds else None
        row["stages"] = {k.removeprefix("graft_stage_"): v for k, v in delta.items()
                         if k.startswith("graft_stage_") and v}
        # budget "auto": the engine steps the throughput guard ran in each mode
        row["guard_steps"] = guard_steps(delta)
        # its chain scout: plain steps it looked at, chain steps it started, chain nodes
        # its looks taught the acceptance model
        row["chain_scout"] = {name: delta.get(f"graft_chain_{key}", 0) for name, key in (
            ("looks", "scout_looks"), ("steps", "scout_steps"), ("shadow_trials", "shadow_trials"))}
    elif method.name == "eagle3":  # vLLM's chain: one drafter forward per draft token
        row["draft_forwards_per_step"] = float(chain_tokens)
    elif method.name == "dflash":  # one forward drafts the whole block
        row["draft_forwards_per_step"] = 1.0
    else:
        row["draft_forwards_per_step"] = 0.0
    return row


def suffix_available() -> bool:
    """vLLM's ``suffix`` method needs the arctic-inference package."""
    import importlib.util

    return importlib.util.find_spec("arctic_inference") is not None




def method_spec(config: BenchConfig, method: Method, extra_graft: dict | None = None
                ) -> dict | None:
    """The speculative config of ``method`` in this run (None: plain decoding)."""
    spec = method.speculative_config(config.head, config.warmup, config.calibration,
                                     config.drafter, config.tail_calibration,
                                     config.dflash, config.dflash_calibration)
    if spec is not None and extra_graft and method.kind == "graft":
        spec["graft"].update(extra_graft)
        spec["graft"] = {k: v for k, v in spec["graft"].items() if v is not None}
    return spec


def run_methods(config: BenchConfig, prompt_ids: dict[str, list], method_list,
                max_model_len: int, extra_graft: dict | None = None, label: str = "",
                rounds: int | None = None):
    """Rows and greedy outputs of every method. One engine after another, or with
    ``rounds``, all engines at once, interleaved
    (:func:`~vllm_graft.bench.engines.run_engines_interleaved`)."""
    rows, outputs = [], {}
    names = {method.name: (method.name + (f"-{label}" if label else "")).replace(" ", "_")
             for method in method_list}
    if rounds is None:  # lazily: each engine runs when its rows are reached
        results = (run_engine(config, method_spec(config, m, extra_graft), prompt_ids,
                              max_model_len, names[m.name])
                   for m in tqdm(method_list, desc=label or "methods", unit="method"))
    else:
        interleaved = run_engines_interleaved(
            config, {names[m.name]: method_spec(config, m, extra_graft) for m in method_list},
            prompt_ids, max_model_len, rounds,
            fresh_each_round={names[m.name] for m in method_list if m.remembers_requests})
        results = (interleaved[names[m.name]] for m in method_list)
    for method, result in zip(method_list, results):
        for dataset, data in result["datasets"].items():
            tokens = data["tokens"]
            outputs[(method.name, dataset)] = outputs_of_every_round(
                method.name, tokens, data.get("round_same"))
            row = summarize(method, data["delta"], sum(len(t) for t in tokens),
                            data["seconds"], config.chain_tokens)
            if data.get("steps"):
                # tokens per decoding step over all steps, drafted or not (the prefill's
                # token and step excluded): vLLM's MAT above counts steps with drafts only
                decoded = sum(len(t) for t in tokens) - len(tokens)
                steps = max(sum(data["steps"]) - len(tokens), 1)
                row["tokens_per_step"] = round(decoded / steps, 3)
            for key in STEP_SPLIT_KEYS:  # medians over rounds
                if key in data:
                    row[key] = round(data[key], 3)
            if "round_seconds" in data:
                generated = sum(len(t) for t in tokens)
                row["round_tokens_per_s"] = [round(generated / max(x, 1e-9), 2)
                                             for x in data["round_seconds"]]
                row["rounds_identical"] = data["rounds_identical"]
            if data.get("round_prefill_ms") and None not in data["round_prefill_ms"]:
                row["round_prefill_ms"] = [round(x, 1) for x in data["round_prefill_ms"]]
            if any(data.get("round_guard_steps", ())):  # what budget auto ran, each round
                row["round_guard_steps"] = data["round_guard_steps"]
            rows.append({"method": method.name, "dataset": dataset, "prompts": len(tokens),
                         **row})
        rows.append({"method": method.name, "dataset": "_engine",
                     "wall_seconds": round(result["wall_seconds"], 1),
                     "warmup_seconds": round(result["warmup_seconds"], 2),
                     "engine_starts": result.get("engine_starts", 1)})
    return rows, outputs


def run_bench(config: BenchConfig) -> dict:
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.target)
    max_positions = AutoConfig.from_pretrained(config.target).max_position_embeddings
    all_methods = methods(config.budget, config.chain_tokens, config.dflash_block)
    notes = []
    chosen = []
    for name in config.methods:
        if name == "suffix" and not suffix_available():
            notes.append("suffix: skipped, arctic-inference is not installed "
                         "(scripts/install_suffix_decoding.sh installs it)")
            continue
        if name in DFLASH_METHODS and config.dflash is None:
            notes.append(f"{name}: skipped, no DFlash drafter for this target")
            continue
        chosen.append(all_methods[name])

    prompt_sets, prompt_ids, longest = {}, {}, 0
    most = max([config.prompts, *config.batch_sizes])
    for name in config.datasets:
        prompts = load_dataset(name, tokenizer, config.cache_dir, most)
        ids = render_prompts(tokenizer, prompts)
        fits = [(p, r) for p, r in zip(prompts, ids)
                if len(r["prompt_token_ids"]) + config.max_tokens + config.budget + 8
                <= max_positions]
        if len(fits) < len(prompts):
            notes.append(f"{name}: {len(prompts) - len(fits)} prompts longer than the "
                         f"model's {max_positions} positions were left out")
        if not fits:
            continue
        prompt_sets[name] = [p for p, _ in fits]
        prompt_ids[name] = [r["prompt_token_ids"] for _, r in fits]
        longest = max(longest, max(len(ids) for ids in prompt_ids[name]))
    max_model_len = min(max_positions, longest + config.max_tokens + config.budget + 16)

    warm = render_prompts(tokenizer, engine_warmup_source(config.cache_dir, most))
    config = replace(config, engine_warmup=[r["prompt_token_ids"] for r in warm])
    first = {name: ids[:config.prompts] for name, ids in prompt_ids.items()}
    prompt_sets = {name: prompts[:config.prompts] for name, prompts in prompt_sets.items()}
    rows, outputs = run_methods(config, first, chosen, max_model_len)
    agreement = greedy_agreement(chosen, outputs, prompt_sets)

    batch_rows = []
    for batch in config.batch_sizes:
        swept = [all_methods[name] for name in config.batch_methods]
        subset = {name: ids[:max(batch, config.prompts)] for name, ids in prompt_ids.items()}
        sweep = replace(config, max_num_seqs=batch)
        found, sweep_outputs = run_methods(sweep, subset, swept, max_model_len,
                                           label=f"batch{batch}",
                                           rounds=config.batch_rounds)
        batch_rows += [{"batch": batch, **row} for row in found]
        for method, same in greedy_agreement(swept, sweep_outputs, subset).items():
            agreement[f"{method}@batch{batch}"] = same

    ablations = []
    if config.ablations:
        ablations = run_ablations(config, first, max_model_len)
    return {
        "config": portable_config(config),
        "machine": machine_description(),
        "max_model_len": max_model_len,
        "datasets": {name: len(p) for name, p in prompt_sets.items()},
        "rows": rows,
        "batch_rows": batch_rows,
        "greedy_agreement_with_plain": agreement,
        "ablations": ablations,
        "notes": notes,
    }


def outputs_of_every_round(method: str, tokens: list, round_same: list[bool] | None) -> list:
    """Each request's output as greedy agreement compares it: its first round's tokens
    where every round repeated them, else a marker that equals no other output (a later
    round that diverged fails the comparison with plain decoding, and the exit code)."""
    if round_same is None:
        return tokens
    return [t if same else ("differed between rounds", method, i)
            for i, (t, same) in enumerate(zip(tokens, round_same))]


def greedy_agreement(chosen, outputs, prompt_sets) -> dict[str, dict[str, int]]:
    """Per method: prompts whose greedy output equals plain decoding's (same run)."""
    if "plain" not in [m.name for m in chosen]:
        return {}
    agreement = {}
    for method in chosen:
        same = total = 0
        for name in prompt_sets:
            for a, b in zip(outputs[("plain", name)], outputs[(method.name, name)]):
                same += int(a == b)
                total += 1
        agreement[method.name] = {"identical": same, "total": total}
    return agreement


def run_ablations(config: BenchConfig, prompt_ids, max_model_len) -> list[dict]:
    """Graft with one knob changed at a time, on the ablation datasets."""
    from vllm_graft.offline.warmup import run_warmup

    subset = {k: v for k, v in prompt_ids.items() if k in config.ablation_datasets} \
        or dict(list(prompt_ids.items())[:1])
    graft = methods(config.budget)["graft"]
    cold = Method("graft", "graft", graft=graft.graft, uses_retrieval=False)  # no warm-up file
    variants = [("warmup_rounds", 0, cold, {})]
    if config.warmup:
        variants.append(("warmup_rounds", "warm", graft, {}))
    variants += [("retrieval_depth", d, graft, {"retrieval_depth": d}) for d in (2, 4, 8, 12)]
    for width in (4, 8, 16):
        extra = {"retrieval_width": width}
        if width > 8:  # a wider template needs a matrix that stores more successors
            path = config.out / f"warmup-k{width}.bin"
            if not path.is_file():
                run_warmup(config.target, config.head, path, rounds=5, max_tokens=256,
                           cache_dir=config.cache_dir, budget=config.budget,
                           extra_graft={"successor_k": width, "retrieval_width": width,
                                        "drafter": config.drafter},
                           engine_options={"dtype": config.dtype})
            extra.update(successor_k=width, warmup=str(path))
        variants.append(("retrieval_width", width, graft, extra))
    out = []
    for knob, value, method, extra in variants:
        rows, _ = run_methods(config, subset, [method], max_model_len,
                              extra_graft=extra, label=f"ablation-{knob}-{value}")
        out += [{"knob": knob, "value": value, **row} for row in rows
                if row["dataset"] != "_engine"]
    return out


def portable_config(config: BenchConfig) -> dict:
    """The run's settings with this machine's paths left out: files in the model cache
    are written as ``$VLLM_GRAFT_CACHE/...``, files in the working tree relative to it, so
    committed results name no machine paths."""
    cache, cwd = Path(config.cache_dir).resolve(), Path.cwd().resolve()

    def portable(value):
        if not isinstance(value, (str, Path)) or not str(value).startswith(("/", ".")):
            return str(value) if isinstance(value, Path) else value
        path = Path(value).resolve()
        if path.is_relative_to(cache):
            return "$VLLM_GRAFT_CACHE/" + str(path.relative_to(cache))
        if path.is_relative_to(cwd):
            return str(path.relative_to(cwd))
        return path.name

    settings = asdict(config)
    settings["cache_dir"] = "$VLLM_GRAFT_CACHE"
    settings["engine_warmup"] = {"prompts": len(config.engine_warmup),
                                 "offset": ENGINE_WARMUP_OFFSET,
                                 "tokens": ENGINE_WARMUP_TOKENS,
                                 "prefill_shapes": True}
    return {k: portable(v) for k, v in settings.items()}


def machine_description() -> dict:
    import os

    import torch

    from vllm_graft.machine import cpu_model

    return {"cpu": cpu_model() or platform.processor(), "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform()}


def write_results(results: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    path.write_text(json.dumps(results, indent=2))
    return path
