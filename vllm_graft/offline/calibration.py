"""The calibration: fit the pruning thresholds on a few warm-up conversations
(``vllm-graft calibrate`` runs it; the benchmark harness too).

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

import time
from pathlib import Path

from vllm_graft.assets import datasets
from vllm_graft.offline.engine import (corpus_sha256, counter_delta, counters, engine,
                                       graft_config_dict, render_prompts)
from vllm_graft.offline.models import model_fingerprint, model_name


def run_calibration(model: str, head: str, out: Path, *, warmup: str | None, rounds: int,
                    max_tokens: int, cache_dir: Path, draft_cost: float, budget: int = 60,
                    offset: int = 100, extra_graft: dict | None = None,
                    variant: str = "graft", engine_options: dict | None = None) -> dict:
    """Calibrate ``head`` on ``model`` and write ``out`` (module docstring).
    ``engine_options``: vLLM engine arguments of every run (dtype, tensor parallelism,
    ...). Both models' fingerprints are taken first, so an unknown model stops before
    any engine starts."""
    if variant == "tail":
        return run_tail_calibration(
            model, head, out, warmup=warmup, rounds=rounds, max_tokens=max_tokens,
            cache_dir=cache_dir, draft_cost=draft_cost, length=budget, offset=offset,
            extra_graft=extra_graft, engine_options=engine_options)
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_graft.core.calibration import TreeRecord, fit_thresholds, tally_acceptance
    from vllm_graft.core.config import GraftConfig
    from vllm_graft.vllm.rpc import start_tree_recording, take_tree_records

    identities = model_identities(model, head)
    options = engine_options or {}
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
    with engine(model, dense, **options) as llm:
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
        hybrid, _ = _recorded_run(model, spec, rendered, params, options)
        gains.append(max(hybrid - kept_mean[i], 0.0))

    thresholds, fit = fit_thresholds(records, config.checkpoints, tuple(gains),
                                     config.max_depth, draft_cost=draft_cost)
    product = graft_config_dict(head, budget=budget, thresholds=list(thresholds), **extra)
    _, verified = _recorded_run(model, product, rendered, params, options)
    chains = graft_config_dict(head, budget="auto", guard_modes=["chain"], **extra)
    return _save_calibration(
        out, prompts, warmup, rounds, start, fit, kept_mean,
        checkpoints=config.checkpoints, thresholds=thresholds, budget=config.budget,
        draft_keep=config.draft_keep, template="best_first",
        acceptance=tally_acceptance(verified),
        chain_acceptance=_learned_chain_acceptance(model, chains, rendered, params, options),
        **identities)


def _learned_chain_acceptance(model: str, spec: dict, rendered, params, options: dict):
    """Copy chains' odds: what a chain-only budget-auto engine's chain acceptance model
    learned over the prompts, from the chains it verified and from the whole chains it
    built (its shadow chains, so nodes its sizer cut are measured too)."""
    from vllm_graft.core.calibration import AcceptanceTally
    from vllm_graft.vllm.rpc import learned_chain_acceptance

    with engine(model, spec, **options) as llm:
        llm.generate(rendered, params, use_tqdm=True)
        return AcceptanceTally(**llm.collective_rpc(learned_chain_acceptance)[0])


def _recorded_run(model: str, spec: dict, rendered, params, options: dict
                  ) -> tuple[float, list[dict]]:
    """One run of ``spec``: its accepted drafts per step, and its verified trees or
    chains (recorded)."""
    from vllm_graft.vllm.rpc import start_tree_recording, take_tree_records

    with engine(model, spec, **options) as llm:
        before = counters(llm)
        llm.collective_rpc(start_tree_recording)
        llm.generate(rendered, params, use_tqdm=True)
        trees = llm.collective_rpc(take_tree_records)[0]
        d = counter_delta(counters(llm), before)
    return d["spec_decode_num_accepted_tokens"] / max(d["spec_decode_num_drafts"], 1), trees


def model_identities(model: str, head: str) -> dict:
    """The calibration file's ``target`` and ``drafter``: names and fingerprints."""
    from vllm_graft.core.calibration import ModelIdentity

    return {"target": ModelIdentity(name=model_name(model), fingerprint=model_fingerprint(model)),
            "drafter": ModelIdentity(name=model_name(head), fingerprint=model_fingerprint(head))}


def _save_calibration(out: Path, prompts, warmup: str | None, rounds: int, start: float,
                      fit: dict, kept_mean: list[float], **layout) -> dict:
    """Write the calibration file: ``layout`` (checkpoints, thresholds, budget, the
    models' identities, ...), the corpus hash and how the fit went."""
    from vllm_graft.core.calibration import CALIBRATION_FORMAT_VERSION, Calibration

    calibration = Calibration(
        format_version=CALIBRATION_FORMAT_VERSION, **layout,
        warmup_corpus_sha256=corpus_sha256(prompts),
        fit={**fit, "kept_accepted_mean": [round(k, 3) for k in kept_mean],
             "seconds": round(time.time() - start, 1), "rounds": rounds,
             "warmup_file": warmup})
    calibration.save(out)
    return calibration.model_dump(mode="json")


def run_tail_calibration(model: str, head: str, out: Path, *, warmup: str | None,
                         rounds: int, max_tokens: int, cache_dir: Path, draft_cost: float,
                         length: int, offset: int = 100, extra_graft: dict | None = None,
                         engine_options: dict | None = None) -> dict:
    """The Graft-TAIL calibration of chains of ``length`` tokens (module docstring)."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_graft.core.calibration import (ChainRecord, fit_chain_thresholds,
                                             tally_acceptance)
    from vllm_graft.core.config import GraftConfig
    from vllm_graft.vllm.rpc import start_tree_recording, take_tree_records

    identities = model_identities(model, head)
    options = engine_options or {}
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
    with engine(model, unpruned, **options) as llm:
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
        hybrid, chains = _recorded_run(model, spec, rendered, params, options)
        gains.append(max(hybrid - kept, 0.0))
        verified += chains

    thresholds, fit = fit_chain_thresholds(records, checkpoints, tuple(gains), length,
                                           draft_cost=draft_cost)
    return _save_calibration(
        out, prompts, warmup, rounds, start, fit, kept_mean,
        checkpoints=checkpoints, thresholds=thresholds, budget=length,
        draft_keep=config.draft_keep, template="top1_walk", shape="chain",
        acceptance=tally_acceptance(verified), **identities)
