"""Graft's counters, from the worker to ``/metrics`` and ``LLM.get_metrics()``.

vLLM's own speculative counters stay meaningful for trees (``num_speculative_tokens``
is the tree budget, so drafts = verified nodes and accepted = accepted path length).
Graft adds its own, which travel like this:

worker  ``ModelRunnerOutput.graft_stats`` (pickled with the output)
  -> engine core: the scheduler adds them up and ships them in
     :class:`GraftSchedulerStats`, a ``SchedulerStats`` with one more declared field
     (msgspec serialises declared fields only; every process registers the subclass as
     the type of ``EngineCoreOutputs.scheduler_stats``)
  -> front end: :class:`GraftPrometheus` counters, created after vLLM's Prometheus
     logger has unregistered every ``vllm:`` metric.

The worker counts under short names (``accepted_draft``, ``guard_tree_steps``,
``stage_0``, times in ``*_us`` microseconds); :data:`GRAFT_METRICS` says how each is
exported by Prometheus' conventions: ``vllm:graft_<family>_total``, one family per
quantity with a label where the worker has one name per value (``source``, ``mode``,
``stage``), times in seconds. ``docs/metrics.md`` lists every old and new name.

Gauges (:data:`GRAFT_GAUGES`) travel in the same dict; the scheduler keeps each one's
latest value instead of adding them up, and the front end shows it as
``vllm:graft_<name>``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields

import prometheus_client

from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.metrics.utils import create_metric_per_engine


@dataclass(frozen=True)
class Family:
    """One exported counter family: its help text, and the worker counters it sums —
    one (``counters`` a name), or one per value of ``label`` (``counters`` maps the
    label's value to the worker's name). Exported value = worker count x ``scale``."""

    help: str
    counters: str | dict[str, str]
    label: str | None = None
    scale: float = 1.0


MICROSECONDS = 1e-6
#: the stage family's worker counters are ``stage_<checkpoint>``, ``stage_full`` and
#: ``stage_none``; the checkpoints come from the configuration
STAGES = "drafting_stops"
_STAGE_PREFIX = "stage_"

#: exported family (``vllm:graft_<family>_total``) -> how it is made
GRAFT_METRICS: dict[str, Family] = {
    "trees_built": Family("Hybrid trees built (one per drafting request per step).",
                          "trees_built"),
    "verified_trees": Family("Hybrid trees verified by the target.", "verified_trees"),
    "verified_nodes": Family("Tree nodes verified (the root excluded).", "verified_nodes"),
    "draft_forwards": Family("Draft-head tree steps run, summed over requests.",
                             "draft_forwards"),
    "draft_nodes": Family("Tree nodes proposed by the drafter (merged ones included).",
                          "draft_nodes"),
    "retrieved_nodes": Family("Tree nodes proposed by the successor matrix alone.",
                              "retrieved_nodes"),
    "merged_nodes": Family("Retrieved nodes that equalled a drafted sibling.",
                           "merged_nodes"),
    "context_nodes": Family("Tree nodes copied from the request's own context (prompt "
                            "lookup), whatever else proposed them too.", "context_nodes"),
    "padded_nodes": Family("Padding nodes that filled fixed-shape trees up to the budget.",
                           "padded_nodes"),
    "replaced_nodes": Family("Low-confidence drafted nodes that fixed-shape trees replaced "
                             "with retrieved ones.", "replaced_nodes"),
    "retrieval_lookups": Family("Successor-matrix lookups made for retrieval.",
                                "retrieval_lookups"),
    "retrieval_hits": Family("Lookups that found a successor (matrix hit rate = hits / "
                             "lookups).", "retrieval_hits"),
    "accepted_tokens": Family(
        "Accepted tokens by who proposed them: the drafter alone (draft), the successor "
        "matrix alone (retrieved), both, the request's own context (context: counted "
        "there only), or padding nodes of fixed-shape trees (padding).",
        {"draft": "accepted_draft", "retrieved": "accepted_retrieved",
         "both": "accepted_both", "context": "accepted_context",
         "padding": "accepted_padding"}, label="source"),
    STAGES: Family(
        "Trees by where their drafting stopped: at a checkpoint of graft.checkpoints "
        "(stage: its depth), not pruned (full), or built without drafting (none: "
        "retrieval_only).", {}, label="stage"),
    "steps": Family(
        "Steps by what budget \"auto\"'s throughput guard ran: Graft trees (tree), copy "
        "chains (chain: copied context continued by the successor matrix, no drafter), "
        "or plain decoding (plain: the other modes measured slower, or no request was "
        "ready to draft).",
        {"tree": "guard_tree_steps", "chain": "guard_chain_steps",
         "plain": "guard_plain_steps"}, label="mode"),
    "auto_chosen_nodes": Family("Tree nodes budget \"auto\" chose to verify (the root "
                                "excluded).", "auto_chosen_nodes"),
    "auto_predicted_accepted_tokens": Family(
        "Accepted tokens budget \"auto\" predicted (compare with accepted_tokens).",
        "auto_predicted_accepted_milli", scale=1e-3),
    "chains_built": Family("Copy chains proposed (the throughput guard's chain mode).",
                           "chains_built"),
    "chain_nodes": Family("Nodes of copy chains (the root excluded).", "chain_nodes"),
    "chain_scout_looks": Family("Plain steps at which the chain scout built the batch's "
                                "copy chains to predict whether they beat plain decoding.",
                                "chain_scout_looks"),
    "chain_scout_steps": Family("Steps run with copy chains because the chain scout "
                                "predicted them faster than plain decoding (counted in "
                                "steps{mode=\"chain\"} too).", "chain_scout_steps"),
    "chain_shadow_trials": Family("Copy-chain nodes the acceptance model learned without "
                                  "verifying them: a chain (a scout's, or a chain step's "
                                  "past its cut) scored against the tokens decoding "
                                  "emitted at its positions.", "chain_shadow_trials"),
    "one_pass_verifications": Family("Sampling steps of all-greedy batches done from one "
                                     "top-k pass over the verified rows' logits (no "
                                     "per-level sampler calls; the same pass teaches the "
                                     "successor matrix).", "one_pass_verifications"),
    "fused_sampled_verifications": Family("Sampling steps walked by one fused op for the "
                                          "whole batch (temperature, top-k and top-p "
                                          "alone; no per-level sampler calls).",
                                          "fused_sampled_verifications"),
    "errors": Family("Failures in Graft's hooks; each made its step decode plainly "
                     "(vllm_graft/vllm/faults.py).", "errors"),
    "bookkeeping_seconds": Family("Seconds of Graft's own work outside model forwards.",
                                  "bookkeeping_us", scale=MICROSECONDS),
    "draft_forward_seconds": Family("Seconds of draft-head forwards (catch-up and tree "
                                    "steps).", "draft_forward_us", scale=MICROSECONDS),
    "tree_attention_seconds": Family("Seconds recomputing tree rows' attention in the "
                                     "target (CPU only: on a GPU it is part of the "
                                     "forward).", "tree_attention_us", scale=MICROSECONDS),
    "tree_preparation_seconds": Family(
        "Seconds of the drafter's catch-up outside tree steps (budget \"auto\": reading "
        "new prompts, keeping the rows of the requests it follows), charged to trees by "
        "the throughput guard.", "tree_preparation_us", scale=MICROSECONDS),
    "heap_trims": Family("Times the worker handed the memory its C allocator kept after "
                         "frees back to the system (graft.heap_trim_s).", "heap_trims"),
    "heap_trim_seconds": Family("Seconds those hand-backs took.", "heap_trim_us",
                                scale=MICROSECONDS),
    "successor_state_save_failures": Family(
        "Saves of graft.successor_state that failed (disk full, file too large...); each "
        "is tried again at the next period and serving goes on.",
        "successor_state_save_failures"),
}


def _exports() -> dict[str, tuple[str, dict[str, str]]]:
    out = {}
    for family, spec in GRAFT_METRICS.items():
        if isinstance(spec.counters, str):
            out[spec.counters] = (family, {})
        else:
            out.update({worker: (family, {spec.label: value})
                        for value, worker in spec.counters.items()})
    return out


_EXPORT_OF = _exports()
#: the worker-side names of the counters, less the stages of the configured checkpoints
#: (``stage_<checkpoint>``)
GRAFT_COUNTERS = (*_EXPORT_OF, f"{_STAGE_PREFIX}full", f"{_STAGE_PREFIX}none")
_WORKER_OF = {(family, tuple(labels.values())): worker
              for worker, (family, labels) in _EXPORT_OF.items()}


def export_of(worker: str) -> tuple[str, dict[str, str], float]:
    """The exported family, labels and scale of a worker counter; a name the table does
    not know is exported as ``vllm:graft_<name>_total`` unchanged."""
    if worker in _EXPORT_OF:
        family, labels = _EXPORT_OF[worker]
        return family, labels, GRAFT_METRICS[family].scale
    if worker.startswith(_STAGE_PREFIX):
        return STAGES, {"stage": worker.removeprefix(_STAGE_PREFIX)}, 1.0
    return worker, {}, 1.0


def worker_of(family: str, labels: dict[str, str]) -> tuple[str, float]:
    """The inverse of :func:`export_of`: the worker counter and the scale to undo."""
    if family == STAGES:
        return f"{_STAGE_PREFIX}{labels['stage']}", 1.0
    if family in GRAFT_METRICS:
        spec = GRAFT_METRICS[family]
        key = (labels[spec.label],) if spec.label else ()
        return _WORKER_OF[(family, key)], spec.scale
    return family, 1.0


def series_name(worker: str) -> str:
    """How a worker counter shows on ``/metrics``, Graft's labels included, e.g.
    ``vllm:graft_accepted_tokens_total{source="draft"}``."""
    family, labels, _ = export_of(worker)
    tags = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"vllm:graft_{family}_total" + (f"{{{tags}}}" if tags else "")


def read_graft_values(registry=prometheus_client.REGISTRY) -> dict[str, float]:
    """This process's exported Graft counters and gauges by worker-side name, counters
    in the worker's units (microseconds, thousandths), summed over engines: what
    Graft's offline tools report. Read from the registry because ``LLM.get_metrics()``
    rounds counters to integers."""
    out: dict[str, float] = {}
    for metric in registry.collect():
        name = metric.name.removeprefix("vllm:graft_")
        if metric.type == "gauge" and name in GRAFT_GAUGES:
            out[name] = sum(s.value for s in metric.samples)
        if metric.type != "counter" or not metric.name.startswith("vllm:graft_"):
            continue
        for sample in metric.samples:
            if sample.name != f"{metric.name}_total":
                continue
            labels = {k: v for k, v in sample.labels.items()
                      if k not in ("model_name", "engine")}
            worker, scale = worker_of(name, labels)
            out[worker] = out.get(worker, 0) + round(sample.value / scale)
    return out


#: name -> help text; values the worker measures after each step, steps that only
#: retired requests included (vllm_graft.vllm.replacements.runner_steps)
GRAFT_GAUGES = {
    "request_table_entries": "Entries in Graft's per-request tables (drafts pending, "
                             "context indexes, tenant bindings...), summed over the "
                             "tables: back to zero once no request is running.",
}


def request_table_values(sizes: dict[str, int]) -> dict[str, int]:
    """The proposer's ``request_state_counts()`` as gauge values (its cumulative
    ``matrix_refusals`` is not a table)."""
    return {"request_table_entries": sum(n for name, n in sizes.items()
                                         if name != "matrix_refusals")}


@dataclass
class GraftSchedulerStats(SchedulerStats):
    graft_stats: dict[str, int] | None = None
    graft_gauges: dict[str, int] | None = None


def split_gauges(values: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """A worker's step values as (counters, gauges)."""
    counts = {k: v for k, v in values.items() if k not in GRAFT_GAUGES}
    return counts, {k: v for k, v in values.items() if k in GRAFT_GAUGES}


def with_graft_stats(stats: SchedulerStats | None, counts: Counter,
                     gauges: dict[str, int] | None = None) -> SchedulerStats | None:
    """``stats`` with the counts since the last stats (then cleared) and the gauges'
    latest values (kept: sent again with every stats)."""
    if stats is None or not (counts or gauges):
        return stats
    values = {f.name: getattr(stats, f.name) for f in fields(SchedulerStats)}
    out = GraftSchedulerStats(**values, graft_stats=dict(counts) or None,
                              graft_gauges=dict(gauges) if gauges else None)
    counts.clear()
    return out


@dataclass
class _Series:
    child: object
    scale: float


class GraftPrometheus:
    """``vllm:graft_*`` counter families per engine (:data:`GRAFT_METRICS`), each series
    created on first sight of its worker counter, and the :data:`GRAFT_GAUGES`."""

    def __init__(self, per_engine_labelvalues: dict[int, list[object]]):
        self.per_engine_labelvalues = per_engine_labelvalues
        self.families: dict[str, prometheus_client.Counter] = {}
        self.series: dict[tuple[str, int], _Series] = {}
        self.gauges = {name: create_metric_per_engine(prometheus_client.Gauge(
            name=f"vllm:graft_{name}", documentation=documentation,
            labelnames=["model_name", "engine"], multiprocess_mode="mostrecent"),
            per_engine_labelvalues) for name, documentation in GRAFT_GAUGES.items()}

    def _series(self, worker: str, engine_idx: int) -> _Series:
        key = (worker, engine_idx)
        if key not in self.series:
            family, labels, scale = export_of(worker)
            if family not in self.families:
                spec = GRAFT_METRICS.get(family)
                self.families[family] = prometheus_client.Counter(
                    name=f"vllm:graft_{family}",
                    documentation=spec.help if spec else f"Graft counter {family}.",
                    labelnames=["model_name", "engine", *labels])
            child = self.families[family].labels(
                *self.per_engine_labelvalues[engine_idx], *labels.values())
            self.series[key] = _Series(child, scale)
        return self.series[key]

    def declare(self, names) -> None:
        """Export these worker counters at zero before they first count."""
        for name in names:
            for engine_idx in self.per_engine_labelvalues:
                self._series(name, engine_idx)

    def observe(self, scheduler_stats, engine_idx: int) -> None:
        for name, value in (getattr(scheduler_stats, "graft_gauges", None) or {}).items():
            if name in self.gauges:
                self.gauges[name][engine_idx].set(value)
        counts = getattr(scheduler_stats, "graft_stats", None)
        if not counts:
            return
        for name, value in counts.items():
            if value:
                series = self._series(name, engine_idx)
                series.child.inc(value * series.scale)
