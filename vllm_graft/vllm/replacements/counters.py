"""Patches 13-15: Graft's counters travel from the model runner to Prometheus.

13 sums the counters each step's runner output carries in the scheduler and attaches
them to its stats; 14 makes ``EngineCoreOutputs.scheduler_stats`` declare the stats
type that carries them; 15 exports them as ``vllm:graft_*`` counters
(:mod:`vllm_graft.vllm.metrics` describes the route)."""

from __future__ import annotations

from collections import Counter

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.metrics.loggers import PrometheusStatLogger

from vllm_graft.vllm.config import ADDITIONAL_CONFIG_KEY
from vllm_graft.vllm.metrics import (GRAFT_COUNTERS, GraftPrometheus, GraftSchedulerStats,
                                     split_gauges, with_graft_stats)
from vllm_graft.vllm.patching import call_original

#: 14: the annotation ``EngineCoreOutputs`` gets for the stats carrying the counters
SCHEDULER_STATS_ANNOTATION = {"scheduler_stats": GraftSchedulerStats | None}


def update_from_output(self, scheduler_output, model_runner_output):
    """13: ``Scheduler.update_from_output``; adds up the step's counters."""
    values = getattr(model_runner_output, "graft_stats", None)
    if values:
        counts, gauges = split_gauges(values)
        self.__dict__.setdefault("_graft_counts", Counter()).update(counts)
        self.__dict__.setdefault("_graft_gauges", {}).update(gauges)
    return call_original(Scheduler, "update_from_output")(
        self, scheduler_output, model_runner_output)


def make_stats(self, *args, **kwargs):
    """13: ``Scheduler.make_stats``; the stats carry the counters summed since the last."""
    stats = call_original(Scheduler, "make_stats")(self, *args, **kwargs)
    return with_graft_stats(stats, self.__dict__.get("_graft_counts", Counter()),
                            self.__dict__.get("_graft_gauges"))


def prometheus_init(self, vllm_config, *args, **kwargs):
    """15: ``PrometheusStatLogger.__init__``; a Graft engine's logger declares Graft's
    counters."""
    call_original(PrometheusStatLogger, "__init__")(self, vllm_config, *args, **kwargs)
    self.graft_prom = None
    graft = (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    if graft is not None:
        self.graft_prom = GraftPrometheus(self.per_engine_labelvalues)
        stages = [f"stage_{cp}" for cp in graft.get("checkpoints", (0, 1, 5))]
        self.graft_prom.declare([*GRAFT_COUNTERS, *stages])


def prometheus_record(self, scheduler_stats, *args, **kwargs):
    """15: ``PrometheusStatLogger.record``; exports the counters the stats carry."""
    call_original(PrometheusStatLogger, "record")(self, scheduler_stats, *args, **kwargs)
    if getattr(self, "graft_prom", None) is not None and scheduler_stats is not None:
        engine_idx = kwargs.get("engine_idx", args[2] if len(args) > 2 else 0)
        self.graft_prom.observe(scheduler_stats, engine_idx)
