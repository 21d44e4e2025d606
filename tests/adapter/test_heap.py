"""The worker's heap trimmer: when it trims, when it stays off, and that a trim really
hands kept memory back to the system."""

import ctypes

import psutil
import pytest

from vllm_graft.vllm.heap import HeapTrimmer, glibc_malloc_trim


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_trims_once_per_interval_of_steps():
    clock, calls = Clock(), []
    trimmer = HeapTrimmer(10.0, clock=clock, trim=lambda pad: calls.append(pad) or 1)
    assert trimmer.active
    assert trimmer.maybe_trim() is None  # the interval counts from start-up
    clock.now += 9.9
    assert trimmer.maybe_trim() is None and calls == []
    clock.now += 0.2
    seconds = trimmer.maybe_trim()
    assert seconds is not None and seconds >= 0 and calls == [0]
    clock.now += 5
    assert trimmer.maybe_trim() is None  # counted from the last trim
    clock.now += 5
    assert trimmer.maybe_trim() is not None and calls == [0, 0]


def test_zero_interval_never_trims_and_a_negative_one_is_refused():
    calls = []
    trimmer = HeapTrimmer(0.0, trim=calls.append)
    assert not trimmer.active and trimmer.maybe_trim() is None and calls == []
    with pytest.raises(ValueError, match="heap trim interval"):
        HeapTrimmer(-1.0)


@pytest.mark.parametrize("preload", ["/usr/lib/libtcmalloc_minimal.so.4",
                                     "/opt/libiomp5.so:/usr/lib/libjemalloc.so.2"])
def test_off_where_another_allocator_is_preloaded(preload):
    assert glibc_malloc_trim({"LD_PRELOAD": preload}) is None


def test_a_trim_returns_freed_heap_pages_to_the_system():
    """Many small blocks (inside glibc's heap, not mmapped) are written and freed, all
    but the last, which pins the heap's top so that ``free`` alone cannot shrink it:
    the pages stay resident until a trim hands them back."""
    trim = glibc_malloc_trim({})
    assert trim is not None, "this test machine runs glibc"
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    block, count = 4096, 50_000  # about 200 MB
    blocks = [libc.malloc(block) for _ in range(count)]
    assert all(blocks)
    for address in blocks:
        ctypes.memset(address, 1, block)
    for address in blocks[:-1]:
        libc.free(address)
    kept = psutil.Process().memory_info().rss
    clock = Clock()
    trimmer = HeapTrimmer(1.0, clock=clock, trim=trim)
    clock.now += 2
    assert trimmer.maybe_trim() is not None
    returned = kept - psutil.Process().memory_info().rss
    libc.free(blocks[-1])
    assert returned > 150e6, f"a trim returned {returned / 1e6:.1f} MB of about 200 MB freed"
