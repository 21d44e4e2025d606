"""Timing Graft's phases on any device."""

from __future__ import annotations

import contextlib
import sys
import time
from collections import Counter

import torch

#: device clock reads per calling function, on any device: on a GPU each one is a
#: host-device synchronisation, so tests hold them to a fixed few per step
CLOCK_READS: Counter[str] = Counter()


def device_clock(device: torch.device | str) -> float:
    """Wall clock after waiting for ``device``, so a timed span holds its GPU work.
    Called at the phase boundaries of a step only: a fixed few synchronisations per
    step, never one per request, level or layer (nor around the target's forward,
    which :class:`SpanTimer` times)."""
    CLOCK_READS[sys._getframe(1).f_code.co_name] += 1
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    if kind == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class SpanTimer:
    """Sums the time of many spans inside a phase without waiting for the device in
    between: on a GPU each span is a pair of CUDA events, read by :meth:`take_seconds`
    after the phase's own :func:`device_clock`; elsewhere spans are wall time."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self.seconds = 0.0
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def span(self):
        if self.cuda:
            start, end = (torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True))
            start.record()
            yield
            end.record()
            self.events.append((start, end))
        else:
            begin = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - begin

    def take_seconds(self) -> float:
        """The spans' total since the last call (reads the events: call it after the
        device has finished them)."""
        total = self.seconds + sum(s.elapsed_time(e) for s, e in self.events) / 1e3
        self.seconds, self.events = 0.0, []
        return total


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
