"""Timing the phases of a step without waiting for the device.

On a GPU the host runs ahead of the device: a phase's wall time says when its kernels
were launched, not when they ran, and reading a clock after ``torch.cuda.synchronize``
drains the queue the next phase's launches would have overlapped. So a phase boundary
is a :class:`Mark` (a CUDA event recorded on the current stream; the wall clock where
there is no such queue), and a time between marks is read only once the device has
passed both: :class:`StepClock` queues what each step wants done with its times and
runs it when the marks have passed, which the step's own one device-to-host read of
its result makes true by the time the next step asks. Nothing here ever synchronizes
unless asked to wait (:meth:`Spans.seconds` with ``wait``, for a value the caller needs
now).

Free of vLLM, so the device checks run it where vLLM is not installed.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from typing import Callable

import torch

logger = logging.getLogger(__name__)


class Mark:
    """A point in the device's work: a recorded CUDA event on a GPU, the wall clock
    elsewhere (where an op's work is done when it returns)."""

    __slots__ = ("event", "wall")

    def __init__(self, cuda: bool):
        if cuda:
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
            self.wall = None
        else:
            self.event, self.wall = None, time.perf_counter()

    def passed(self) -> bool:
        """Whether the device has done the work before the mark (never waits)."""
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def since(self, earlier: Mark) -> float:
        """Seconds from ``earlier`` to this mark; both must have passed."""
        if self.event is None:
            return self.wall - earlier.wall
        return earlier.event.elapsed_time(self.event) / 1e3


class Spans:
    """Spans between pairs of marks, whose total (times ``scale``) is read once they
    have passed: a timer's spans of one step, or a share of one span."""

    def __init__(self, pairs: list[tuple[Mark, Mark]] | None = None, scale: float = 1.0):
        self.pairs = pairs or []
        self.scale = scale

    def passed(self) -> bool:
        return all(end.passed() for _, end in self.pairs)

    def seconds(self, wait: bool = False) -> float:
        """The spans' total; ``wait``: first wait for the last of them if the device has
        not passed it yet (without it, every span must have passed)."""
        if wait and self.pairs and not self.passed():
            self.pairs[-1][1].wait()
        return self.scale * sum(end.since(start) for start, end in self.pairs)


class SpanTimer:
    """Collects spans of a phase (head forwards, the drafter's catch-up, the target's
    forward) as pairs of marks; :meth:`take` hands them over."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self.pairs: list[tuple[Mark, Mark]] = []

    @contextlib.contextmanager
    def span(self):
        start = Mark(self.cuda)
        yield
        self.pairs.append((start, Mark(self.cuda)))

    def take(self) -> Spans:
        """The spans since the last call."""
        taken, self.pairs = Spans(self.pairs), []
        return taken


class StepClock:
    """One runner's marks and what its steps do with the times between them.

    :meth:`later` queues a function with the marks or spans it reads; :meth:`settle`
    (called once a step, when its counters ship) runs, in order, every queued function
    whose marks have passed and keeps the rest for the next call."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self.waiting: deque[tuple[tuple, Callable[[], None]]] = deque()
        self.failures = 0  # queued reads that raised (dropped: times are metrics)

    def mark(self) -> Mark:
        return Mark(self.cuda)

    def later(self, fn: Callable[[], None], *awaited: Mark | Spans) -> None:
        self.waiting.append((awaited, fn))

    def settle(self) -> int:
        """Run what can run now (never waits); returns how many still wait. A read
        that raises is dropped, logged once: a time is never worth a step."""
        kept: deque = deque()
        while self.waiting:
            awaited, fn = self.waiting.popleft()
            try:
                if all(item.passed() for item in awaited):
                    fn()
                else:
                    kept.append((awaited, fn))
            except Exception:
                self.failures += 1
                if self.failures == 1:
                    logger.exception("Graft: a step's time could not be read; it is "
                                     "dropped (later ones are dropped without a log line)")
        self.waiting = kept
        return len(kept)

    def phase(self, add_seconds: Callable[[float], None], start: Mark,
              less: tuple[Spans, ...] = ()) -> Mark:
        """Marks the end of a phase begun at ``start`` and queues ``add_seconds`` of its
        time less the ``less`` spans inside it (a forward timed on its own, the share
        plain decoding spends too); returns the end mark."""
        end = self.mark()
        self.later(lambda: add_seconds(
            end.since(start) - sum(spans.seconds() for spans in less)), end, *less)
        return end
