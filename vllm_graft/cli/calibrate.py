"""``vllm-graft calibrate``: fit the pruning thresholds on a few warm-up conversations.

    vllm-graft calibrate MODEL --head HEAD --warmup successor.bin --out calibration.json

1. A dense-tree run (no pruning, no retrieval) records, for every tree, the drafter's
   best-path confidence after each step and the accepted path, which tells how many
   accepted tokens a tree stopped at checkpoint ``i`` would have kept.
2. One run per checkpoint with pruning forced there measures what retrieval adds in
   the freed slots (with the warmed-up successor matrix; without context copies, which
   the dense run has none of either: their tokens are no gain of pruning).
3. A coordinate search picks the thresholds that maximise accepted tokens per unit of
   step cost, a step costing ``1 + draft_cost * draft_forwards`` (verification = 1).
4. A last run with the fitted thresholds and the product's defaults (context copies
   on) tallies its verified trees' nodes per source and depth (tried and accepted): the
   file's ``acceptance``, which seeds ``budget: "auto"``'s acceptance model with the odds
   of the trees it will size.
5. A budget-auto run held to copy chains gives what its chain acceptance model learned
   (verified chains and the whole chains it built): the file's ``chain_acceptance``,
   which seeds that model, a population of its own.

``--variant tail`` calibrates Graft-TAIL chains of ``--budget`` tokens the same way:
unpruned chains record the cumulative confidence after each draft step and how many
drafted tokens were accepted, one run per checkpoint stops every chain there to measure
what the retrieved tail adds, and the search fits the thresholds each checkpoint holds
until the next (:func:`vllm_graft.core.calibration.fit_chain_thresholds`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from vllm_graft.assets import datasets
from vllm_graft.assets.pypi import default_cache_dir
from vllm_graft.cli.common import (add_engine_arguments, corpus_sha256, counter_delta,
                                   counters, drafter_graft_keys, engine, engine_budget,
                                   graft_config_dict, render_prompts)


def run_calibration(model: str, head: str, out: Path, *, warmup: str | None, rounds: int,
                    max_tokens: int, cache_dir: Path, draft_cost: float, budget: int = 60,
                    dtype: str = "float32", max_model_len: int = 4096, offset: int = 100,
                    extra_graft: dict | None = None, variant: str = "graft") -> dict:
    if variant == "tail":
        return run_tail_calibration(
            model, head, out, warmup=warmup, rounds=rounds, max_tokens=max_tokens,
            cache_dir=cache_dir, draft_cost=draft_cost, length=budget, dtype=dtype,
            max_model_len=max_model_len, offset=offset, extra_graft=extra_graft)
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_graft.core.calibration import TreeRecord, fit_thresholds, tally_acceptance
    from vllm_graft.core.config import GraftConfig
    from vllm_graft.vllm.rpc import start_tree_recording, take_tree_records

    config = GraftConfig(budget=budget)
    prompts = datasets.sharegpt(cache_dir, limit=rounds, offset=offset)
    tokenizer = AutoTokenizer.from_pretrained(model)
    rendered = render_prompts(tokenizer, prompts)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    extra = dict(extra_graft or {})
    if warmup:
        extra["warmup"] = warmup
    start = time.time()

    dense = graft_config_dict(head, budget=budget, variant="dense_tree", **extra)
    with engine(model, dense, dtype=dtype, max_model_len=max_model_len) as llm:
        llm.collective_rpc(start_tree_recording)
        llm.generate(rendered, params, use_tqdm=True)
        raw = llm.collective_rpc(take_tree_records)[0]
    records = [TreeRecord.from_dense_tree(r["depths"], r["accepted_rows"], r["confidence"],
                                          config.checkpoints, config.draft_keep) for r in raw]
    kept_mean = [sum(r.kept_accepted[i] for r in records) / max(len(records), 1)
                 for i in range(len(config.checkpoints))]

    gains = []
    for i in range(len(config.checkpoints)):
        forced = [0.0] * len(config.checkpoints)
        forced[i] = 1.0  # confidence never exceeds 1: every tree stops at checkpoint i
        spec = graft_config_dict(head, budget=budget, thresholds=forced, context=False,
                                 **extra)
        hybrid, _ = _recorded_run(model, spec, rendered, params, dtype, max_model_len)
        gains.append(max(hybrid - kept_mean[i], 0.0))

    thresholds, fit = fit_thresholds(records, config.checkpoints, tuple(gains),
                                     config.max_depth, draft_cost=draft_cost)
    product = graft_config_dict(head, budget=budget, thresholds=list(thresholds), **extra)
    _, verified = _recorded_run(model, product, rendered, params, dtype, max_model_len)
    chains = graft_config_dict(head, budget="auto", guard_modes=["chain"], **extra)
    return _save_calibration(
        out, model, head, prompts, warmup, rounds, start, fit, kept_mean,
        checkpoints=config.checkpoints, thresholds=thresholds, budget=config.budget,
        draft_keep=config.draft_keep, template="best_first",
        acceptance=tally_acceptance(verified),
        chain_acceptance=_learned_chain_acceptance(model, chains, rendered, params, dtype,
                                                   max_model_len))


def _learned_chain_acceptance(model: str, spec: dict, rendered, params, dtype: str,
                              max_model_len: int):
    """Copy chains' odds: what a chain-only budget-auto engine's chain acceptance model
    learned over the prompts, from the chains it verified and from the whole chains it
    built (its shadow chains, so nodes its sizer cut are measured too)."""
    from vllm_graft.core.calibration import AcceptanceTally
    from vllm_graft.vllm.rpc import learned_chain_acceptance

    with engine(model, spec, dtype=dtype, max_model_len=max_model_len) as llm:
        llm.generate(rendered, params, use_tqdm=True)
        return AcceptanceTally(**llm.collective_rpc(learned_chain_acceptance)[0])


def _recorded_run(model: str, spec: dict, rendered, params, dtype: str, max_model_len: int
                  ) -> tuple[float, list[dict]]:
    """One run of ``spec``: its accepted drafts per step, and its verified trees or
    chains (recorded)."""
    from vllm_graft.vllm.rpc import start_tree_recording, take_tree_records

    with engine(model, spec, dtype=dtype, max_model_len=max_model_len) as llm:
        before = counters(llm)
        llm.collective_rpc(start_tree_recording)
        llm.generate(rendered, params, use_tqdm=True)
        trees = llm.collective_rpc(take_tree_records)[0]
        d = counter_delta(counters(llm), before)
    return d["spec_decode_num_accepted_tokens"] / max(d["spec_decode_num_drafts"], 1), trees


def _save_calibration(out: Path, model: str, head: str, prompts, warmup: str | None,
                      rounds: int, start: float, fit: dict, kept_mean: list[float],
                      **layout) -> dict:
    """Write the calibration file: ``layout`` (checkpoints, thresholds, budget, ...),
    the models' identities, the corpus hash and how the fit went."""
    from vllm_graft.core.calibration import (CALIBRATION_FORMAT_VERSION, Calibration,
                                             ModelIdentity, fingerprint_model)

    calibration = Calibration(
        format_version=CALIBRATION_FORMAT_VERSION, **layout,
        target=ModelIdentity(name=Path(model).name, fingerprint=fingerprint_model(model)),
        drafter=ModelIdentity(name=Path(head).name, fingerprint=fingerprint_model(head)),
        warmup_corpus_sha256=corpus_sha256(prompts),
        fit={**fit, "kept_accepted_mean": [round(k, 3) for k in kept_mean],
             "seconds": round(time.time() - start, 1), "rounds": rounds,
             "warmup_file": warmup})
    calibration.save(out)
    return calibration.model_dump(mode="json")


def run_tail_calibration(model: str, head: str, out: Path, *, warmup: str | None,
                         rounds: int, max_tokens: int, cache_dir: Path, draft_cost: float,
                         length: int, dtype: str = "float32", max_model_len: int = 4096,
                         offset: int = 100, extra_graft: dict | None = None) -> dict:
    """The Graft-TAIL calibration of chains of ``length`` tokens (module docstring)."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_graft.core.calibration import (ChainRecord, fit_chain_thresholds,
                                             tally_acceptance)
    from vllm_graft.core.config import GraftConfig
    from vllm_graft.vllm.rpc import start_tree_recording, take_tree_records

    extra = {key: value for key, value in (extra_graft or {}).items() if key != "variant"}
    config = GraftConfig(variant="tail", budget=length, **extra)
    checkpoints = config.checkpoints
    prompts = datasets.sharegpt(cache_dir, limit=rounds, offset=offset)
    rendered = render_prompts(AutoTokenizer.from_pretrained(model), prompts)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    if warmup:
        extra["warmup"] = warmup
    start = time.time()

    never = [0.0] * len(checkpoints)
    unpruned = graft_config_dict(head, variant="tail", budget=length, thresholds=never,
                                 **extra)
    with engine(model, unpruned, dtype=dtype, max_model_len=max_model_len) as llm:
        llm.collective_rpc(start_tree_recording)
        llm.generate(rendered, params, use_tqdm=True)
        raw = llm.collective_rpc(take_tree_records)[0]
    verified = list(raw)
    # chains the scheduler cut short (near the length limit) say nothing about the rest
    records = [ChainRecord(tuple(r["confidence"]), len(r["accepted_rows"])) for r in raw
               if len(r["depths"]) == length + 1]

    gains, kept_mean = [], []
    for i, checkpoint in enumerate(checkpoints):
        kept = sum(min(r.accepted, checkpoint) for r in records) / max(len(records), 1)
        kept_mean.append(kept)
        if checkpoint >= length:  # never reached by a chain this short
            gains.append(0.0)
            continue
        forced = [0.0] * len(checkpoints)
        forced[i] = 1.0  # confidence never exceeds 1: every chain stops at this step
        spec = graft_config_dict(head, variant="tail", budget=length, thresholds=forced,
                                 **extra)
        hybrid, chains = _recorded_run(model, spec, rendered, params, dtype, max_model_len)
        gains.append(max(hybrid - kept, 0.0))
        verified += chains

    thresholds, fit = fit_chain_thresholds(records, checkpoints, tuple(gains), length,
                                           draft_cost=draft_cost)
    return _save_calibration(
        out, model, head, prompts, warmup, rounds, start, fit, kept_mean,
        checkpoints=checkpoints, thresholds=thresholds, budget=length,
        draft_keep=config.draft_keep, template="top1_walk", shape="chain",
        acceptance=tally_acceptance(verified))


def main(argv=None) -> int:
    from vllm_graft.cli.main import cpu_runtime_defaults

    p = argparse.ArgumentParser(prog="vllm-graft calibrate",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--warmup", help="successor matrix from `vllm-graft warmup`")
    p.add_argument("--rounds", type=int, default=5, help="calibration conversations")
    p.add_argument("--draft-cost", type=float, default=0.1,
                   help="cost of one draft step relative to one verification")
    p.add_argument("--variant", choices=["graft", "tail"], default="graft",
                   help="calibrate Graft trees, or Graft-TAIL chains of --budget tokens")
    add_engine_arguments(p)
    args = p.parse_args(argv)
    if args.drafter == "dflash" and args.variant != "tail":
        p.error("--drafter dflash drafts blocks: calibrate them with --variant tail")
    cpu_runtime_defaults()
    result = run_calibration(args.model, args.head, args.out, warmup=args.warmup,
                             rounds=args.rounds, max_tokens=args.max_tokens,
                             cache_dir=args.cache_dir or default_cache_dir(),
                             draft_cost=args.draft_cost,
                             budget=engine_budget(p, args, chains=args.variant == "tail"),
                             dtype=args.dtype,
                             variant=args.variant,
                             extra_graft=drafter_graft_keys(args.drafter))
    print({"thresholds": result["thresholds"], **result["fit"]})
    return 0
