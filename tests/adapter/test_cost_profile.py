"""The start-up cost profile: a burst of other work during the measurement slows one
turn of every token count, so the fastest timing of each count stays its own; the
counts reach a step of full trees, within a time budget; a cached profile that reaches
less is measured again, unless its measurement was cut short by that budget."""

import time
from types import SimpleNamespace

import pytest

from vllm_graft.core.budget import CostModel
from vllm_graft.vllm.cost_profile import (PROFILE_TOKENS, _cached, measure, profile_path,
                                          profiled_tokens)

BASE_MS, PER_TOKEN_MS, BURST_MS = 2.0, 0.05, 25.0


class BurstyRunner:
    """A runner whose dummy forward takes ``BASE_MS + PER_TOKEN_MS * tokens``, and
    ``BURST_MS`` more while its calls fall in ``burst`` (another job on the device)."""

    def __init__(self, limit: int, burst: range):
        self.scheduler_config = SimpleNamespace(max_num_batched_tokens=limit)
        self.device = "cpu"
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(model="toy", dtype="float32"),
            parallel_config=SimpleNamespace(tensor_parallel_size=1))
        self.burst = burst
        self.calls = 0

    def _dummy_run(self, num_tokens: int) -> None:
        extra = BURST_MS if self.calls in self.burst else 0.0
        self.calls += 1
        time.sleep((BASE_MS + PER_TOKEN_MS * num_tokens + extra) / 1e3)


def test_a_burst_after_the_first_turn_leaves_the_profile_unharmed():
    limit = 64
    counts = [n for n in PROFILE_TOKENS if n <= limit]
    warm_up = len(counts)
    # clean warm-up and first turn, then other work for every later turn: timed one
    # count after another, every count past the second would be measured in the burst
    runner = BurstyRunner(limit, burst=range(warm_up + len(counts), 10**6))
    model = measure(runner, counts, repeats=5)
    tokens, ms = model.curves[1]
    assert tokens == [float(n) for n in counts]
    for n, measured in zip(counts, ms):
        expected = BASE_MS + PER_TOKEN_MS * n
        assert expected <= measured < expected + BURST_MS / 2, (n, measured)
    assert runner.calls == warm_up + 5 * len(counts)


@pytest.mark.parametrize("limit, requests, budget, reach", [
    (8192, 1, 60, 64),        # one tree of 61 rows
    (8192, 32, 60, 2048),     # 32 of them: 1,952 rows
    (1024, 32, 60, 1024),     # no further than a step can schedule
    (8192, 256, 60, 8192),
    (100, 1, 8, 16),
])
def test_the_profile_reaches_a_step_of_full_trees(limit, requests, budget, reach):
    counts = profiled_tokens(limit, requests, budget)
    assert counts[0] == 1 and counts[-1] == reach
    assert counts == [n for n in PROFILE_TOKENS if n <= reach]


def test_a_cached_profile_that_reaches_too_few_tokens_is_measured_again(tmp_path,
                                                                       monkeypatch):
    monkeypatch.setenv("VLLM_GRAFT_CACHE", str(tmp_path))
    key = {"model": "toy", "device": "cpu", "dtype": "float32", "layout": "tp1"}
    path = profile_path(key)
    path.parent.mkdir(parents=True)
    CostModel(curves={1: ([1.0, 256.0], [10.0, 20.0])}, key=key).save(path)
    assert _cached(key, [1, 2, 256]) is not None
    assert _cached(key, [1, 2, 256, 512]) is None
    # a pinned profile is what its writer wants, whatever it reaches
    CostModel(curves={1: ([1.0, 256.0], [10.0, 20.0])}, key=key, frozen=True).save(path)
    assert _cached(key, [1, 2, 256, 512]) is not None
    # a measurement its time budget cut short would be cut as short again
    CostModel(curves={1: ([1.0, 256.0], [10.0, 20.0])}, key=key,
              requested_tokens=512).save(path)
    assert _cached(key, [1, 2, 256, 512]) is not None
    assert _cached(key, [1, 2, 256, 512, 1024]) is None


def test_the_measurement_stops_within_its_time_budget():
    """A slow device (1 ms a token here, the shape of a CPU's bf16 curve) measures the
    counts whose forwards fit in the budget, and the profile says what it aimed for:
    a cached profile cut short by its budget is not measured again at every start."""
    clock = {"ms": 0.0}
    calls = []

    def timed(n: int) -> float:  # a simulated forward: 5 ms + 1 ms per token
        calls.append(n)
        clock["ms"] += 5.0 + n
        return 5.0 + n

    runner = BurstyRunner(8192, burst=range(0))
    import vllm_graft.vllm.cost_profile as cost_profile

    real_clock = cost_profile.device_clock
    cost_profile.device_clock = lambda device: clock["ms"] / 1e3
    try:
        counts = [n for n in PROFILE_TOKENS if n <= 8192]
        model = measure(runner, counts, repeats=5, seconds=2.0, timed=timed)
    finally:
        cost_profile.device_clock = real_clock
    tokens, ms = model.curves[1]
    assert 2 <= len(tokens) < len(counts) and tokens[-1] <= 512
    assert clock["ms"] <= 2.0e3  # the whole measurement within its budget
    assert ms == [5.0 + t for t in tokens]
    assert model.requested_tokens == counts[-1]
    assert sum(1 for n in calls if n == 1) >= 3  # cheap counts were repeated
