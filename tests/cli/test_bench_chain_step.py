"""``scripts/bench_chain_step.py`` times what it says: its verified steps are the walks
of its chains, and a short run writes a row per batch size."""

from __future__ import annotations

import json
import random
import sys

import pytest

from tests.cli.helpers import script_module
from vllm_graft.core.acceptance import greedy_chain_walk_lists


@pytest.fixture(scope="module")
def bench():
    with script_module("bench_chain_step") as module:
        yield module


def test_the_timed_result_is_what_the_chains_walk_to(bench):
    rng = random.Random(3)
    host = bench.chains(16, rng)
    accepted, row_tokens = bench.verified(host, rng)
    assert greedy_chain_walk_lists([tokens[1:] for tokens in host.tokens], row_tokens) \
        == accepted
    assert len(set(accepted)) > 1


def test_a_short_run_writes_every_batch(bench, tmp_path, monkeypatch):
    out = tmp_path / "chain.json"
    monkeypatch.setattr(sys, "argv", ["bench_chain_step.py", "--batch", "1", "4",
                                      "--repeats", "3", "--evict-mib", "1",
                                      "--json", str(out)])
    bench.main()
    rows = json.loads(out.read_text())["rows"]
    assert [row["batch"] for row in rows] == [1, 4]
    assert all(row["total_us"] > 0 for row in rows)
