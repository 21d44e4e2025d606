"""The step clock: phase times between marks, read only once the device has passed them.

Runs on the CPU and, where there is one, on a CUDA device (the GPU check runs this
folder): there a mark is a CUDA event, and a time read before the device has passed
it would raise (``cudaErrorNotReady``) or, worse, be a wait the step must not have.
"""

from __future__ import annotations

import time

import pytest
import torch

from vllm_graft.step_clock import Spans, SpanTimer, StepClock

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="no CUDA device")),
]


def _work(device: str, size: int = 512, rounds: int = 8) -> torch.Tensor:
    x = torch.randn(size, size, device=device)
    for _ in range(rounds):
        x = (x @ x).tanh()
    return x


class _NotYet:
    """A mark the device has not passed (as a CUDA event still queued reads)."""

    def __init__(self):
        self.done = False

    def passed(self) -> bool:
        return self.done


@pytest.mark.parametrize("device", DEVICES)
def test_span_timer_hands_over_its_spans_once(device):
    timer = SpanTimer(device)
    for _ in range(3):
        with timer.span():
            _work(device)
            if device == "cpu":
                time.sleep(0.01)
    spans = timer.take()
    assert len(spans.pairs) == 3
    total = spans.seconds(wait=True)
    assert 0.0 < total < 10.0
    if device == "cpu":
        assert total >= 0.03
    assert timer.take().seconds() == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_phases_are_read_when_the_device_has_passed_them_and_never_waited_for(device):
    clock = StepClock(device)
    times = []
    start = clock.mark()
    inner = SpanTimer(device)
    with inner.span():
        result = _work(device)
    _work(device)
    less = inner.take()
    clock.phase(times.append, start, (less,))
    # the step's one read of its result: after it every mark before it has passed
    result.sum().item()
    assert clock.settle() == 0
    assert len(times) == 1
    whole = times[0] + less.seconds()
    assert 0.0 < less.seconds() < whole


def test_what_waits_for_an_unpassed_mark_runs_at_a_later_settle_in_order():
    clock = StepClock("cpu")
    ran = []
    pending = _NotYet()
    clock.later(lambda: ran.append("first"), pending)
    clock.later(lambda: ran.append("second"))
    clock.later(lambda: ran.append("third"), pending)
    assert clock.settle() == 2
    assert ran == ["second"]
    pending.done = True
    assert clock.settle() == 0
    assert ran == ["second", "first", "third"]


def test_a_scaled_share_of_a_span():
    clock = StepClock("cpu")
    start = clock.mark()
    time.sleep(0.02)
    share = Spans([(start, clock.mark())], scale=0.25)
    assert 0.004 <= share.seconds() <= 0.25 * 1.0
    assert Spans().seconds() == 0.0 and Spans().passed()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_a_gpu_a_mark_is_queued_work_not_a_wait():
    """Marks behind a long queue have not passed when the host records them, and the
    clock keeps their reads for later instead of waiting."""
    clock = StepClock("cuda")
    torch.cuda.synchronize()
    start = clock.mark()
    _work("cuda", size=4096, rounds=40)
    times = []
    clock.phase(times.append, start)
    left = clock.settle()  # the host is far ahead of the device here
    torch.cuda.synchronize()
    clock.settle()
    assert len(times) == 1 and times[0] > 0.0
    assert left in (0, 1)  # 1 on any GPU the queue above keeps busy for a moment


def test_a_read_that_raises_is_dropped_and_the_rest_still_run():
    clock = StepClock("cpu")
    ran = []

    def broken():
        raise RuntimeError("an event of a lost context")

    clock.later(broken)
    clock.later(lambda: ran.append("after"))
    assert clock.settle() == 0
    assert ran == ["after"] and clock.failures == 1
