"""The host sides of a tree step: its trees' masks built at once, each equal to its own;
its acceptance result read in one copy."""

from __future__ import annotations

import torch

from vllm_graft.core.hybrid import ancestor_mask
from vllm_graft.vllm.draft_records import PendingTree
from vllm_graft.vllm.tree_verification import tree_masks


def random_tree(nodes: int, generator: torch.Generator) -> PendingTree:
    """A flattened tree of ``nodes`` rows, root first, each row's parent an earlier row."""
    parents = torch.tensor([-1] + [int(torch.randint(i, (1,), generator=generator))
                                   for i in range(1, nodes)])
    depths = torch.zeros(nodes, dtype=torch.long)
    for i in range(1, nodes):
        depths[i] = depths[parents[i]] + 1
    return PendingTree(tokens=torch.arange(nodes), parents=parents, depths=depths,
                       source=torch.zeros(nodes, dtype=torch.uint8))


def test_each_trees_mask_is_its_own_whatever_the_others():
    generator = torch.Generator().manual_seed(0)
    trees = [random_tree(nodes, generator) for nodes in (1, 2, 61, 7, 33, 61, 12)]
    for tree, mask in zip(trees, tree_masks(trees)):
        nodes = tree.tokens.numel()
        alone = ancestor_mask(tree.parents.view(1, -1), torch.ones(1, nodes, dtype=torch.bool),
                              max(int(tree.depths.max()), 1))[0]
        assert torch.equal(mask, alone)
        # a row sees exactly itself and its ancestors
        for row in range(nodes):
            seen, node = set(), row
            while node >= 0:
                seen.add(node)
                node = int(tree.parents[node])
            assert set(torch.nonzero(mask[row]).flatten().tolist()) == seen


def test_the_acceptance_result_reaches_the_host_in_one_read():
    """The step's acceptance result is read once (one copy of the three tensors packed),
    each tensor back with its shape, dtype and values."""
    from vllm_graft.core.acceptance import AcceptanceResult
    from vllm_graft.testing.op_counter import OpCounter
    from vllm_graft.vllm.tree_sampling import to_host

    result = AcceptanceResult(
        accepted_rows=torch.tensor([[3, 7, -1], [-1, -1, -1]], dtype=torch.int32),
        output_tokens=torch.tensor([[11, 12, 13, -1], [40, -1, -1, -1]]),
        num_accepted=torch.tensor([2, 0], dtype=torch.int32))
    with OpCounter() as counter:
        host = to_host(result)
    assert counter.host_waits == 1
    for name in ("accepted_rows", "output_tokens", "num_accepted"):
        sent, got = getattr(result, name), getattr(host, name)
        assert got.dtype == sent.dtype and torch.equal(got, sent), name


def test_many_tensors_of_any_dtype_reach_the_host_in_one_read():
    """A tree and its build's facts travel in one copy: every dtype the step carries
    (floating ones by their bits, NaN and -0.0 included) comes back exactly, with its
    shape; None stays None."""
    from vllm_graft.core.transfer import to_host_at_once
    from vllm_graft.testing.op_counter import OpCounter

    sent = [torch.tensor([[1, -2], [3, 4]]), torch.tensor([True, False, True]),
            torch.tensor([7, 255], dtype=torch.uint8), None,
            torch.tensor([[0.1, float("nan")], [-0.0, 1e30]]),
            torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
            torch.tensor([3.0, float("-inf")], dtype=torch.float16),
            torch.tensor([2 ** 40 + 1, -5], dtype=torch.int64),
            torch.tensor([-(2 ** 31), 2 ** 31 - 1], dtype=torch.int32),
            torch.zeros((0, 3), dtype=torch.int64), torch.tensor(9, dtype=torch.int16),
            torch.arange(12).view(3, 4)[:, 1:3],  # slices of a wider buffer
            torch.arange(12).view(3, 4)[:, 1:2], torch.arange(12).view(3, 4)[:, 2],
            torch.arange(12).view(3, 4)[:1, 2], torch.arange(12).view(3, 4)[:1, 2:3]]
    with OpCounter() as counter:
        got = to_host_at_once(sent)
    assert counter.host_waits == 1
    assert got[3] is None
    for a, b in zip(sent, got):
        if a is None:
            continue
        assert b.dtype == a.dtype and b.shape == a.shape
        torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)
        if a.is_floating_point():
            assert torch.equal(torch.signbit(b), torch.signbit(a))
