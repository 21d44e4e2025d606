"""The start-up cost profile: a burst of other work during the measurement slows one
turn of every token count, so the fastest timing of each count stays its own."""

import time
from types import SimpleNamespace

from vllm_graft.vllm.cost_profile import PROFILE_TOKENS, measure

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
    model = measure(runner, repeats=5)
    tokens, ms = model.curves[1]
    assert tokens == [float(n) for n in counts]
    for n, measured in zip(counts, ms):
        expected = BASE_MS + PER_TOKEN_MS * n
        assert expected <= measured < expected + BURST_MS / 2, (n, measured)
    assert runner.calls == warm_up + 5 * len(counts)
