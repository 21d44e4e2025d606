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
    if torch.device(device).type == "cuda":
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
