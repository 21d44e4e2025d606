"""Graft's counters, from the worker to ``/metrics`` and ``LLM.get_metrics()``.

vLLM's own speculative counters stay meaningful for trees (``num_speculative_tokens``
is the tree budget, so drafts = verified nodes and accepted = accepted path length).
Graft adds its own, which travel like this:

worker  ``ModelRunnerOutput.graft_stats`` (pickled with the output)
  -> engine core: the scheduler adds them up and ships them in
     :class:`GraftSchedulerStats`, a ``SchedulerStats`` with one more declared field
     (msgspec serialises declared fields only; every process registers the subclass as
     the type of ``EngineCoreOutputs.scheduler_stats``)
  -> front end: :class:`GraftPrometheus` counters named ``vllm:graft_<name>_total``,
     created after vLLM's Prometheus logger has unregistered every ``vllm:`` metric.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields

import prometheus_client

from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.metrics.utils import create_metric_per_engine

#: name -> help text; the names the worker counts (vllm_graft.vllm.runner)
GRAFT_COUNTERS = {
    "trees_built": "Hybrid trees built (one per drafting request per step).",
    "verified_trees": "Hybrid trees verified by the target.",
    "verified_nodes": "Tree nodes verified (the root excluded).",
    "draft_forwards": "Draft-head tree steps run, summed over requests.",
    "draft_nodes": "Tree nodes proposed by the drafter (merged ones included).",
    "retrieved_nodes": "Tree nodes proposed by the successor matrix alone.",
    "merged_nodes": "Retrieved nodes that equalled a drafted sibling.",
    "retrieval_lookups": "Successor-matrix lookups made for retrieval.",
    "retrieval_hits": "Lookups that found a successor (matrix hit rate = hits / lookups).",
    "accepted_draft": "Accepted tokens proposed by the drafter only.",
    "accepted_retrieved": "Accepted tokens proposed by the successor matrix only.",
    "accepted_both": "Accepted tokens proposed by the drafter and the matrix.",
    "accepted_padding": "Accepted padding nodes of fixed-shape trees.",
    "context_nodes": "Tree nodes copied from the request's own context (prompt lookup), "
                     "whatever else proposed them too.",
    "accepted_context": "Accepted tokens copied from the context (counted here only, "
                        "not under draft, retrieved or both).",
    "padded_nodes": "Padding nodes that filled fixed-shape trees up to the budget.",
    "auto_chosen_nodes": "Tree nodes budget \"auto\" chose to verify (the root excluded).",
    "auto_predicted_accepted_milli": "Accepted tokens budget \"auto\" predicted, in "
                                     "thousandths (compare with the accepted_* counters).",
    "guard_tree_steps": "Steps budget \"auto\"'s throughput guard ran with Graft trees.",
    "guard_chain_steps": "Steps the throughput guard ran with copy chains (copied context "
                         "continued by the successor matrix, no drafter).",
    "guard_plain_steps": "Steps the throughput guard decoded plainly (the other modes "
                         "measured slower, or no request was ready to draft).",
    "chains_built": "Copy chains proposed (the throughput guard's chain mode).",
    "chain_scout_looks": "Plain steps at which the chain scout built the batch's copy "
                         "chains to predict whether they beat plain decoding.",
    "chain_scout_steps": "Steps run with copy chains because the chain scout predicted "
                         "them faster than plain decoding (counted in guard_chain_steps "
                         "too).",
    "chain_shadow_trials": "Copy-chain nodes the acceptance model learned without "
                           "verifying them: a chain (a scout's, or a chain step's past "
                           "its cut) scored against the tokens decoding emitted at its "
                           "positions.",
    "chain_nodes": "Nodes of copy chains (the root excluded).",
    "replaced_nodes": "Low-confidence drafted nodes that fixed-shape trees replaced "
                      "with retrieved ones.",
    "one_pass_verifications": "Sampling steps of all-greedy batches done from one top-k "
                              "pass over the verified rows' logits (no per-level sampler "
                              "calls; the same pass teaches the successor matrix).",
    "fused_sampled_verifications": "Sampling steps walked by one fused op for the whole "
                                   "batch (temperature, top-k and top-p alone; no "
                                   "per-level sampler calls).",
    "errors": "Failures in Graft's hooks; each made its step decode plainly "
              "(vllm_graft/vllm/faults.py).",
    "bookkeeping_us": "Microseconds of Graft's own work outside model forwards.",
    "draft_forward_us": "Microseconds of draft-head forwards (catch-up and tree steps).",
    "tree_attention_us": "Microseconds recomputing tree rows' attention in the target "
                         "(CPU only: on a GPU it is part of the forward).",
    "tree_preparation_us": "Microseconds of the drafter's catch-up outside tree steps "
                           "(budget \"auto\": reading new prompts, keeping the rows of "
                           "the requests it follows), charged to trees by the "
                           "throughput guard.",
    "heap_trims": "Times the worker handed the memory its C allocator kept after frees "
                  "back to the system (graft.heap_trim_s).",
    "heap_trim_us": "Microseconds those hand-backs took.",
    "successor_state_save_failures": "Saves of graft.successor_state that failed (disk "
                                     "full, file too large...); each is tried again at "
                                     "the next period and serving goes on.",
    "stage_none": "Trees built without drafting (retrieval_only).",
    "stage_full": "Trees whose drafting was not pruned.",
}
_STAGE_PREFIX = "stage_"


@dataclass
class GraftSchedulerStats(SchedulerStats):
    graft_stats: dict[str, int] | None = None


def with_graft_stats(stats: SchedulerStats | None, counts: Counter) -> SchedulerStats | None:
    if stats is None or not counts:
        return stats
    values = {f.name: getattr(stats, f.name) for f in fields(SchedulerStats)}
    out = GraftSchedulerStats(**values, graft_stats=dict(counts))
    counts.clear()
    return out


def counter_help(name: str) -> str:
    if name in GRAFT_COUNTERS:
        return GRAFT_COUNTERS[name]
    if name.startswith(_STAGE_PREFIX):
        return f"Trees whose drafting stopped at checkpoint {name[len(_STAGE_PREFIX):]}."
    return f"Graft counter {name}."


class GraftPrometheus:
    """``vllm:graft_*`` counters per engine, created on first sight of each name."""

    def __init__(self, per_engine_labelvalues: dict[int, list[object]]):
        self.per_engine_labelvalues = per_engine_labelvalues
        self.counters: dict[str, dict[int, object]] = {}

    def _counter(self, name: str, engine_idx: int):
        if name not in self.counters:
            metric = prometheus_client.Counter(
                name=f"vllm:graft_{name}", documentation=counter_help(name),
                labelnames=["model_name", "engine"])
            self.counters[name] = create_metric_per_engine(metric, self.per_engine_labelvalues)
        return self.counters[name][engine_idx]

    def declare(self, names) -> None:
        for name in names:
            for engine_idx in self.per_engine_labelvalues:
                self._counter(name, engine_idx)

    def observe(self, scheduler_stats, engine_idx: int) -> None:
        counts = getattr(scheduler_stats, "graft_stats", None)
        if not counts:
            return
        for name, value in counts.items():
            if value:
                self._counter(name, engine_idx).inc(value)
