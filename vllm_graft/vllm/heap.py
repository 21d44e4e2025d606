"""Hand the memory glibc's allocator keeps after frees back to the system, now and then.

A long-running engine's resident size climbs in steps under varied load although
nothing leaks (``scripts/heap_trace.py``; the soak runs of 2026-12-02 in
bench/results/LOG.md): glibc keeps freed chunks inside its heaps for reuse, and a batch
larger than any before (tree rows' logits, a long prefill) leaves a new high-water mark
that ``free`` never returns.
``malloc_trim(0)`` gives back every whole free page, from the middle of the heaps too,
so after each trim the resident size is what is live again. One trim of a worker's
multi-GB heap took 7 to 20 ms here; once per ``every_s`` seconds of engine steps that
is a fraction of a per cent of the time.

Where glibc's allocator is not the one in use (another allocator preloaded, such as
tcmalloc or jemalloc, which return memory on their own terms, or a C library without
``malloc_trim``), the trimmer stays off.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable

#: allocators that replace glibc's malloc when preloaded
_OTHER_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")


def glibc_malloc_trim(environ=os.environ) -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where glibc's allocator is not in use."""
    if any(name in environ.get("LD_PRELOAD", "") for name in _OTHER_ALLOCATORS):
        return None
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class HeapTrimmer:
    """``maybe_trim()`` once per engine step: trims once ``every_s`` seconds have passed
    since the last trim (``every_s`` 0: never)."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic,
                 trim: Callable[[int], int] | None = None):
        if every_s < 0:
            raise ValueError(f"heap trim interval must be >= 0 s, got {every_s}")
        self.every_s = every_s
        self._clock = clock
        self._trim = None if every_s == 0 else (trim or glibc_malloc_trim())
        self._last = clock()

    @property
    def active(self) -> bool:
        return self._trim is not None

    def maybe_trim(self) -> float | None:
        """Trim if it is time: the seconds the trim took, or None when it did not trim."""
        if self._trim is None or self._clock() - self._last < self.every_s:
            return None
        start = time.perf_counter()
        self._trim(0)
        seconds = time.perf_counter() - start
        self._last = self._clock()
        return seconds
