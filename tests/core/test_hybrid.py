import random

import pytest
import torch

from tests.core.helpers import reference_trie_merge
from vllm_graft.core.hybrid import (SOURCE_BOTH, SOURCE_DRAFT, SOURCE_RETRIEVED,
                                    HybridTree, ancestor_mask, merge_and_flatten)
from vllm_graft.testing.op_counter import OpCounter


def _random_part(rng, n, vocab, invalid_rate=0.1):
    tokens, parents, depths = [], [], []
    for i in range(n):
        p = rng.randrange(-1, i) if i else -1
        parents.append(p)
        depths.append(1 if p < 0 else depths[p] + 1)
        tokens.append(-1 if rng.random() < invalid_rate else rng.randrange(vocab))
    return tokens, parents, depths


def _check_invariants(tree, budget):
    b, rows = tree.tokens.shape
    assert rows == budget + 1
    for r in range(b):
        n = int(tree.num_nodes[r])
        assert 1 <= n <= budget + 1
        assert tree.valid[r, :n].all() and not tree.valid[r, n:].any()
        assert (tree.tokens[r, n:] == -1).all()
        parents = tree.parents[r].tolist()
        seen = set()
        for i in range(1, n):
            assert 0 <= parents[i] < i  # parents before children
            assert int(tree.depths[r, i]) == int(tree.depths[r, parents[i]]) + 1
            key = (parents[i], int(tree.tokens[r, i]))
            assert key not in seen  # siblings are distinct tokens
            seen.add(key)
        # the mask agrees with the parent pointers
        for i in range(rows):
            expected = set()
            j = i if i < n else None
            while j is not None and j >= 0:
                expected.add(j)
                j = parents[j] if j else None
            assert set(torch.nonzero(tree.ancestor[r, i]).flatten().tolist()) == expected


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("budget", [1, 8, 60])
def test_matches_sequential_trie_merge(seed, budget):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 50])  # tiny vocabularies force many duplicates
    batch = 4
    roots, draft, retrieved = [], [], []
    for _ in range(batch):
        roots.append(rng.randrange(vocab))
        draft.append(_random_part(rng, 40, vocab, invalid_rate=0.0))
        retrieved.append(_random_part(rng, 70, vocab))
    as_t = lambda parts, i: torch.tensor([p[i] for p in parts])
    tree = merge_and_flatten(
        torch.tensor(roots),
        [(as_t(draft, 0), as_t(draft, 1), as_t(draft, 2), SOURCE_DRAFT),
         (as_t(retrieved, 0), as_t(retrieved, 1), as_t(retrieved, 2), SOURCE_RETRIEVED)],
        budget)
    _check_invariants(tree, budget)
    for b in range(batch):
        expected = reference_trie_merge(
            roots[b], [(draft[b][0], draft[b][1], SOURCE_DRAFT),
                       (retrieved[b][0], retrieved[b][1], SOURCE_RETRIEVED)], budget)
        n = int(tree.num_nodes[b])
        got = list(zip(tree.tokens[b, :n].tolist(), tree.parents[b, :n].tolist(),
                       tree.source[b, :n].tolist()))
        assert got == expected


def test_retrieved_token_equal_to_drafted_sibling_merges():
    # root 9; draft: 4 -> 5; retrieved: 4 -> 6 and 7. The retrieved 4 merges into the draft 4.
    tree = merge_and_flatten(
        torch.tensor([9]),
        [(torch.tensor([[4, 5]]), torch.tensor([[-1, 0]]), torch.tensor([[1, 2]]), SOURCE_DRAFT),
         (torch.tensor([[4, 6, 7]]), torch.tensor([[-1, 0, -1]]), torch.tensor([[1, 2, 1]]),
          SOURCE_RETRIEVED)],
        budget=10)
    n = int(tree.num_nodes[0])
    assert tree.tokens[0, :n].tolist() == [9, 4, 5, 6, 7]
    assert tree.parents[0, :n].tolist() == [-1, 0, 1, 1, 0]
    assert tree.source[0, :n].tolist() == [0, SOURCE_BOTH, SOURCE_DRAFT, SOURCE_RETRIEVED,
                                          SOURCE_RETRIEVED]


def test_budget_cuts_in_priority_order():
    tree = merge_and_flatten(
        torch.tensor([0]),
        [(torch.tensor([[1, 2, 3]]), torch.tensor([[-1, -1, -1]]), torch.ones(1, 3, dtype=torch.long),
          SOURCE_DRAFT)], budget=2)
    assert tree.tokens[0].tolist() == [0, 1, 2]


def test_ancestor_mask_deep_chain():
    n = 40
    parents = torch.arange(-1, n - 1).unsqueeze(0)
    mask = ancestor_mask(parents, torch.ones(1, n, dtype=torch.bool), n - 1)
    assert torch.equal(mask[0], torch.tril(torch.ones(n, n, dtype=torch.bool)))


def test_a_tree_score_follows_its_rows_through_trimming_and_padding():
    from vllm_graft.core.hybrid import pad_to_budget, trim_tree

    tokens = torch.tensor([[0, 5, 6, 7]])
    parents = torch.tensor([[-1, 0, 0, 1]])
    depths = torch.tensor([[0, 1, 1, 2]])
    valid = torch.ones(1, 4, dtype=torch.bool)
    tree = HybridTree(tokens=tokens, parents=parents, depths=depths, valid=valid,
                      source=torch.zeros(1, 4, dtype=torch.uint8), num_nodes=valid.sum(1))
    assert tree.score is None and tree.to("cpu").score is None
    with pytest.raises(ValueError, match="shape of its tokens"):
        tree.with_score(torch.zeros(1, 3))
    scored = tree.with_score(torch.tensor([[0.0, 0.1, 0.2, 0.3]]))
    keep = torch.tensor([[True, True, False, True]])  # drop row 2: row 3 moves up
    trimmed = trim_tree(scored, keep)
    assert trimmed.tokens[0].tolist() == [0, 5, 7, -1]
    assert trimmed.score[0].tolist() == pytest.approx([0.0, 0.1, 0.3, 0.0])
    padded = pad_to_budget(trimmed, vocab_size=50)
    assert padded.score[0].tolist() == pytest.approx([0.0, 0.1, 0.3, 0.0])


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_merge_launches_six_ops_per_depth_and_waits_once(batch):
    """On a GPU the merge is bound by kernel launches: per depth one pass of validity
    (a gather, an and) and one of canonicalisation (a gather, a comparison, an and, an
    argmax), with the comparisons that no pass changes made once; the source flags in
    one scatter; and one wait for the host (the depth). Before: 13 ops per depth and
    186 in all for two parts of depth 8."""
    rng = random.Random(batch)
    depth, parts = 0, []
    for flag in (SOURCE_DRAFT, SOURCE_RETRIEVED):
        part = [_random_part(rng, 60, 50) for _ in range(batch)]
        as_t = lambda i: torch.tensor([p[i] for p in part])
        parts.append((as_t(0), as_t(1), as_t(2), flag))
        depth = max(depth, int(as_t(2).max()))
    with OpCounter() as counter:
        merge_and_flatten(torch.zeros(batch, dtype=torch.long), parts, 60)
    assert counter.host_waits == 1
    assert counter.ops <= 6 * depth + 80, (counter.ops, depth)


def test_a_depth_bound_above_the_real_depth_merges_alike_without_waiting():
    rng = random.Random(7)
    parts = []
    for flag in (SOURCE_DRAFT, SOURCE_RETRIEVED):
        part = [_random_part(rng, 40, 5) for _ in range(3)]
        as_t = lambda i: torch.tensor([p[i] for p in part])
        parts.append((as_t(0), as_t(1), as_t(2), flag))
    depth = max(int(p[2].max()) for p in parts)
    roots = torch.tensor([1, 2, 3])
    read = merge_and_flatten(roots, parts, 30)
    with OpCounter() as counter:
        bounded = merge_and_flatten(roots, parts, 30, max_depth=depth + 3)
    assert counter.host_waits == 0
    for name in ("tokens", "parents", "depths", "valid", "source", "num_nodes"):
        assert torch.equal(getattr(bounded, name), getattr(read, name)), name
