"""Cost-aware tree size on synthetic curves and on the H200 profile the GPU check
measured: the chooser verifies about a full tree at batch 1 on a GPU-like curve and
fewer nodes per request as the batch grows; its choice is always a set of subtrees."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_graft.core.budget import (AcceptanceModel, CostModel, choose_nodes,
                                    path_probability)

ROOT = Path(__file__).resolve().parents[2]
H200_PROFILE = ROOT / "bench/results/gpu/2026-11-30-h200/verification_cost_cuda_graphs.json"


def gpu_like_cost(batches=(1, 8, 32)) -> CostModel:
    """Flat up to 64 query tokens (memory-bound: the weights are read once whatever the
    token count), then linear in tokens."""
    curves = {}
    for batch in batches:
        base = 10.0 + 0.4 * batch  # larger batches read more KV
        tokens = [float(batch), 64.0, 4096.0]
        if batch >= 64:
            tokens = [float(batch), float(batch) + 1.0, 4096.0]
        curves[batch] = (tokens, [base, base, base + (4096.0 - tokens[1]) * 0.04])
    return CostModel(curves=curves)


CHILD_ACCEPTANCE = (0.6, 0.2, 0.08)  # P(child accepted | parent), by sibling rank


def bushy_tree(batch: int, nodes: int):
    """Trees of ``nodes`` + root, three children per node, whose conditional acceptance
    falls with the sibling rank (siblings exclude each other: their sum stays below 1)."""
    parents = torch.full((batch, nodes + 1), -1, dtype=torch.long)
    depths = torch.zeros(batch, nodes + 1, dtype=torch.long)
    conditional = torch.ones(batch, nodes + 1, dtype=torch.float64)
    for i in range(1, nodes + 1):
        parent = (i - 1) // 3
        parents[:, i] = parent
        depths[:, i] = depths[0, parent] + 1
        conditional[:, i] = CHILD_ACCEPTANCE[(i - 1) % 3]
    valid = torch.ones(batch, nodes + 1, dtype=torch.bool)
    return parents, depths, valid, path_probability(parents, depths, valid, conditional)


def is_subtree_set(keep: torch.Tensor, parents: torch.Tensor) -> bool:
    parent_kept = keep.gather(1, parents.clamp(min=0))
    return bool((~keep[:, 1:] | parent_kept[:, 1:]).all())


def test_gpu_like_curve_full_tree_at_batch_1_fewer_nodes_as_batch_grows():
    cost = gpu_like_cost()
    chosen = {}
    for batch in (1, 8, 32):
        parents, _, valid, prob = bushy_tree(batch, 60)
        choice = choose_nodes(prob, valid, cost)
        assert is_subtree_set(choice.keep, parents)
        chosen[batch] = float(choice.nodes_per_request.double().mean())
    assert chosen[1] == 60  # flat up to 64 tokens: every node is free
    assert chosen[1] > chosen[8] > chosen[32] > 0


def test_h200_profile_gives_the_same_ordering():
    cost = CostModel.from_gpu_check(H200_PROFILE, context=1024)
    assert sorted(cost.curves) == [1, 8, 32]
    chosen = []
    for batch in (1, 8, 32):
        parents, _, valid, prob = bushy_tree(batch, 60)
        choice = choose_nodes(prob, valid, cost)
        assert is_subtree_set(choice.keep, parents)
        chosen.append(float(choice.nodes_per_request.double().mean()))
    print("H200, context 1024, nodes per request at batch 1/8/32:", chosen)
    assert chosen[0] > chosen[1] > chosen[2] > 0


def test_no_node_is_worth_it_when_verification_is_expensive():
    # a CPU-like curve: every extra token costs nearly a full step
    cost = CostModel(curves={1: ([1.0, 2.0, 64.0], [10.0, 19.0, 577.0])}, overhead_ms=2.0)
    parents, _, valid, prob = bushy_tree(1, 60)
    choice = choose_nodes(prob, valid, cost)
    assert int(choice.nodes_per_request[0]) == 0 and bool(choice.keep[0, 0])


def test_choice_prefers_likely_nodes_across_requests():
    cost = CostModel(curves={2: ([2.0, 4.0, 6.0, 100.0], [10.0, 10.0, 20.0, 300.0])})
    # request 0 has a sure child, request 1 an unlikely one: with room for two tokens
    # only (4 total with the roots) the sure child and the next best are taken
    parents = torch.tensor([[-1, 0, 1], [-1, 0, 0]])
    depths = torch.tensor([[0, 1, 2], [0, 1, 1]])
    valid = torch.ones(2, 3, dtype=torch.bool)
    prob = path_probability(parents, depths, valid,
                            torch.tensor([[1.0, 0.99, 0.9], [1.0, 0.05, 0.01]]))
    choice = choose_nodes(prob, valid, cost)
    assert choice.keep.tolist() == [[True, True, True], [True, False, False]]


def test_path_probability_multiplies_along_ancestors():
    parents = torch.tensor([[-1, 0, 0, 1, -1]])
    depths = torch.tensor([[0, 1, 1, 2, 0]])
    valid = torch.tensor([[True, True, True, True, False]])
    conditional = torch.tensor([[1.0, 0.5, 0.25, 0.5, 0.9]])
    got = path_probability(parents, depths, valid, conditional)
    assert torch.allclose(got, torch.tensor([[1.0, 0.5, 0.25, 0.25, 0.0]], dtype=torch.float64))


def test_cost_model_interpolates_extrapolates_and_tracks_measurements(tmp_path):
    cost = CostModel(curves={1: ([1.0, 65.0], [10.0, 12.0]), 9: ([9.0, 585.0], [20.0, 60.0])},
                     key={"model": "m", "device": "d", "dtype": "bf16", "layout": "tp1"})
    assert float(cost.verify_ms(1, torch.tensor(33.0))) == pytest.approx(11.0)
    assert float(cost.verify_ms(1, torch.tensor(129.0))) == pytest.approx(14.0)  # last slope
    # batch 5: halfway between the curves at the same tokens per request
    mid = float(cost.verify_ms(5, torch.tensor(5.0)))
    assert mid == pytest.approx((10.0 + 20.0) / 2)
    for _ in range(50):
        cost.observe(1, 1, 20.0, rate=0.2)
    assert float(cost.verify_ms(1, torch.tensor(1.0))) == pytest.approx(20.0, rel=0.02)
    path = tmp_path / "profile.json"
    cost.save(path)
    again = CostModel.load(path, expected_key=cost.key)
    assert again.curves == cost.curves
    with pytest.raises(ValueError, match="was measured for"):
        CostModel.load(path, expected_key={**cost.key, "device": "other"})
    with pytest.raises(ValueError, match="tokens must increase"):
        CostModel(curves={1: ([2.0, 1.0], [1.0, 2.0])})


def test_acceptance_model_learns_per_source_and_depth():
    model = AcceptanceModel(max_depth=4, score_buckets=2)
    generator = torch.Generator().manual_seed(0)
    n = 20_000
    source = torch.randint(1, 3, (n,), generator=generator)  # drafted or retrieved
    depth = torch.randint(1, 5, (n,), generator=generator)
    score = torch.rand(n, generator=generator)
    truth = torch.where(source == 1, 0.8, 0.3) * (1.0 - 0.1 * (depth - 1))
    accepted = torch.rand(n, generator=generator) < truth
    model.observe(source, depth, score, torch.ones(n, dtype=torch.bool), accepted)
    estimate = model.conditional(source, depth, score)
    assert torch.allclose(estimate, truth.double(), atol=0.04)
    # nodes whose parent was rejected teach nothing
    before = model.trials.clone()
    model.observe(source, depth, score, torch.zeros(n, dtype=torch.bool), accepted)
    assert torch.equal(model.trials, before)
