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
