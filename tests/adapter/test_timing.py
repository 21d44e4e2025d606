"""Phase timers: spans add up and are taken once."""

import time

from vllm_graft.vllm.timing import SpanTimer


def test_span_timer_sums_spans_and_clears_on_take():
    timer = SpanTimer("cpu")
    for _ in range(3):
        with timer.span():
            time.sleep(0.01)
    total = timer.take_seconds()
    assert 0.03 <= total < 1.0
    assert timer.take_seconds() == 0.0
