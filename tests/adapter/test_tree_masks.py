"""A step's tree masks are built for all its trees at once, each equal to its own."""

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
