"""``scripts/bench_chain_step.py`` times what it says: its verified steps are the walks
of its chains, and a short run writes a row per batch size."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.cli.helpers import script_module
from vllm_graft.core.acceptance import greedy_chain_walk


@pytest.fixture(scope="module")
def bench():
    with script_module("bench_chain_step") as module:
        yield module


def test_the_timed_result_is_what_the_chains_walk_to(bench):
    generator = torch.Generator().manual_seed(3)
    tree = bench.chains(16, generator)
    result, row_tokens = bench.verified(tree, generator)
    walked = greedy_chain_walk(tree, row_tokens)
    assert walked.num_accepted.tolist() == result.num_accepted.tolist()
    assert torch.equal(walked.accepted_rows, result.accepted_rows)


def test_a_short_run_writes_every_batch(bench, tmp_path, monkeypatch):
    out = tmp_path / "chain.json"
    monkeypatch.setattr(sys, "argv", ["bench_chain_step.py", "--batch", "1", "4",
                                      "--repeats", "3", "--evict-mib", "1",
                                      "--json", str(out)])
    bench.main()
    rows = json.loads(out.read_text())["rows"]
    assert [row["batch"] for row in rows] == [1, 4]
    assert all(row["total_us"] > 0 for row in rows)
