"""A synchronizing clock for start-up measurements, and the target's compute time.

A step's phases are timed without waiting for the device (:mod:`vllm_graft.step_clock`);
:func:`device_clock` waits, and serves the start-up cost profile only."""

from __future__ import annotations

import sys
import time
from collections import Counter

import torch

#: device clock reads per calling function, on any device: on a GPU each one is a
#: host-device synchronisation, so tests hold steps to none
CLOCK_READS: Counter[str] = Counter()


def device_clock(device: torch.device | str) -> float:
    """Wall clock after waiting for ``device``, so a timed span holds its GPU work: for
    measurements outside decoding steps (the start-up cost profile), never inside one
    (a step's phases are marks of its :class:`~vllm_graft.step_clock.StepClock`)."""
    CLOCK_READS[sys._getframe(1).f_code.co_name] += 1
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    if kind == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class TargetComputeClock:
    """Wall seconds the target model spent in its forward and its logits, summed over
    engine steps: the benchmark splits each step into that and everything else (the
    engine's scheduling and sampling, a drafter's forwards, Graft's bookkeeping). The
    target's compute runs as fast or as slow as the process and the machine let it;
    the rest is what a speculative method adds, and its difference from plain decoding
    is measurable without the process-to-process spread of whole runs.

    Installed on an engine in this process (:func:`install_target_clock`) as instance
    wrappers of ``GPUModelRunner._model_forward`` and the model's ``compute_logits``;
    CPU only (on a GPU the forward returns before the device finishes it)."""

    def __init__(self, runner):
        self.seconds = 0.0
        for owner, name in ((runner, "_model_forward"), (runner.model, "compute_logits")):
            setattr(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


#: the clocks installed in this process, by the engine's ``id`` (see install_target_clock)
TARGET_CLOCKS: dict[int, TargetComputeClock] = {}


def _install_in_worker(worker, key: int) -> bool:
    """Run in the worker through ``LLM.collective_rpc``."""
    runner = worker.model_runner
    if runner.device.type != "cpu":
        return False
    TARGET_CLOCKS[key] = TargetComputeClock(runner)
    return True


def install_target_clock(llm) -> TargetComputeClock | None:
    """A :class:`TargetComputeClock` on ``llm``'s worker, or None where the worker runs
    in another process or on a GPU (the benchmark then reports no split)."""
    key = id(llm)
    installed = llm.collective_rpc(_install_in_worker, args=(key,))
    return TARGET_CLOCKS.pop(key, None) if all(installed) else None
