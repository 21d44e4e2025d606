
import pytest
import torch

from tests.core.helpers import TableDrafter
from vllm_graft.core.draft_tree import DraftTreeBuilder
from vllm_graft.testing.op_counter import OpCounter


def _all_paths(drafter, root, top_k, depth):
    """Brute force EAGLE-2 expansion: returns {path tuple: score} of every pool candidate."""
    lp = drafter.logprobs
    pool = {}
    frontier = [((), 0.0, root)]
    for step in range(depth):
        new = []
        for path, score, tok in frontier:
            values, ids = lp[tok].topk(top_k)
            for v, i in zip(values.tolist(), ids.tolist()):
                new.append((path + (i,), score + v, i))
        pool.update({p: s for p, s, _ in new})
        frontier = sorted(new, key=lambda x: -x[1])[:top_k]
    return pool


@pytest.mark.parametrize("top_k, depth, keep", [(3, 3, 10), (4, 4, 25), (10, 7, 60), (2, 5, 9),
                                                (1, 7, 8)])  # top_k 1: a chain
def test_selection_is_best_m_and_prefix_closed(top_k, depth, keep):
    vocab = 50
    drafter = TableDrafter(vocab, top_k, seed=top_k)
    builder = DraftTreeBuilder(top_k=top_k, max_depth=depth, full_keep=keep)
    roots = torch.tensor([3, 17, 42])
    tree = builder.build(roots, drafter)
    for b, root in enumerate(roots.tolist()):
        pool = _all_paths(drafter, root, top_k, depth)
        n = int(tree.valid[b].sum())
        assert n == min(keep, len(pool))
        best = sorted(pool.values(), reverse=True)[:n]
        got = tree.scores[b, :n].tolist()
        assert got == pytest.approx(best, abs=1e-5)
        # every node's path is in the pool with that score, parents come first
        paths = []
        for i in range(n):
            p = int(tree.parents[b, i])
            assert p < i
            path = (paths[p] if p >= 0 else ()) + (int(tree.tokens[b, i]),)
            paths.append(path)
            assert pool[path] == pytest.approx(float(tree.scores[b, i]), abs=1e-5)
            assert int(tree.depths[b, i]) == len(path)
    assert tree.steps.tolist() == [depth] * 3


def test_pruning_stops_at_the_checkpoint_and_saves_drafter_calls():
    vocab, top_k = 40, 4
    # after token 5 the drafter is unsure (top-1 prob 0.1); after token 6 it is sure
    drafter = TableDrafter(vocab, top_k, confidence={5: 0.1, 6: 0.97, 7: 0.97, 8: 0.97})
    builder = DraftTreeBuilder(top_k=top_k, max_depth=5, checkpoints=(0, 1, 3),
                               draft_keep=(3, 6, 10), thresholds=(0.3, 0.2, 0.0), full_keep=12)
    roots = torch.tensor([5, 6, 5])
    tree = builder.build(roots, drafter)
    assert tree.stage.tolist() == [0, 3, 0]  # 3 = drafted to full depth
    # the recorded confidences are what the gate compared; NaN after a request stopped
    assert abs(float(tree.confidence[0, 0]) - 0.1) < 1e-5
    assert torch.isnan(tree.confidence[0, 1:]).all() and not torch.isnan(tree.confidence[1]).any()
    assert tree.steps.tolist() == [1, 5, 1]
    assert tree.valid.sum(1).tolist() == [3, 12, 3]
    # after step 0 only the confident request was still sent to the drafter
    assert [c.active.tolist() for c in drafter.calls] == [[0, 1, 2]] + [[1]] * 4


def test_a_build_waits_for_the_host_once_per_checkpoint_it_reaches():
    """On a GPU each wait for the host stalls the launch queue: a checkpoint learns
    which requests go on with one ``nonzero`` (before, three boolean-mask indexings
    per checkpoint), and nothing else in the build waits."""
    drafter = TableDrafter(40, 4, confidence={5: 0.1, 6: 0.97, 7: 0.97, 8: 0.97})
    builder = DraftTreeBuilder(top_k=4, max_depth=5, checkpoints=(0, 1, 3),
                               draft_keep=(3, 6, 10), thresholds=(0.3, 0.2, 0.0), full_keep=12)
    for roots, reached in (([5, 6, 5], 3), ([5, 5], 1), ([6], 3)):
        with OpCounter() as counter:
            builder.build(torch.tensor(roots), drafter)
        assert counter.host_waits == reached, (roots, counter.host_waits)


def _assert_same_tree(a, b):
    for name in ("tokens", "parents", "depths", "valid", "stage", "steps",
                 "candidate_tokens", "candidate_parents", "candidate_depths"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(a.scores, b.scores)
    assert torch.equal(a.confidence.isnan(), b.confidence.isnan())
    assert torch.equal(a.confidence.nan_to_num(), b.confidence.nan_to_num())


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("prune", [True, False])
def test_a_wait_free_build_drafts_the_same_tree_without_waiting(seed, prune):
    """A CUDA graph cannot hold a read of the device: the wait-free build keeps every
    request in every drafter call, masks what a stopped one drafts, and selects the very
    same tree, with no host wait at all (the waiting build pays one per checkpoint)."""
    g = torch.Generator().manual_seed(seed)
    vocab, top_k = 30, 3
    sure = torch.randperm(vocab, generator=g)[:vocab // 2].tolist()
    drafter = TableDrafter(vocab, top_k, seed=seed, sharpness=2.0,
                           confidence={t: 0.95 for t in sure})
    builder = DraftTreeBuilder(top_k=top_k, max_depth=6, checkpoints=(0, 1, 4),
                               draft_keep=(2, 5, 9), thresholds=(0.5, 0.4, 0.3), full_keep=14)
    roots = torch.randint(0, vocab, (9,), generator=g)
    waiting = builder.build(roots, drafter, prune=prune)
    calls = len(drafter.calls)
    with OpCounter() as counter:
        wait_free = builder.build(roots, drafter, prune=prune, wait_free=True)
    assert counter.host_waits == 0
    _assert_same_tree(waiting, wait_free)
    # every request in every one of the full depth's drafter calls
    assert [c.active.tolist() for c in drafter.calls[calls:]] == [list(range(9))] * 6
    if prune:
        assert len(set(waiting.stage.tolist())) > 1, "the case should stop some requests"


def test_a_wait_free_build_hands_a_stopped_request_no_tokens():
    drafter = TableDrafter(40, 4, confidence={5: 0.1, 6: 0.97, 7: 0.97, 8: 0.97})
    builder = DraftTreeBuilder(top_k=4, max_depth=3, checkpoints=(0,), draft_keep=(3,),
                               thresholds=(0.3,), full_keep=12)
    builder.build(torch.tensor([5, 6]), drafter, wait_free=True)
    later = drafter.calls[1:]
    assert all((c.tokens[0] == -1).all() and (c.tokens[1] >= 0).all() for c in later)


def test_pruning_switched_off_drafts_full_depth():
    drafter = TableDrafter(40, 4, confidence={5: 0.1})
    builder = DraftTreeBuilder(top_k=4, max_depth=3, checkpoints=(0,), draft_keep=(2,),
                               thresholds=(0.9,), full_keep=10)
    tree = builder.build(torch.tensor([5]), drafter, prune=False)
    assert tree.steps.tolist() == [3] and int(tree.valid.sum()) == 10


def test_non_finite_drafter_scores_are_never_selected():
    def drafter(step):
        a, w = step.tokens.shape
        values = torch.full((a, w, 3), float("-inf"))
        values[..., 0] = -0.1  # only one finite child per node
        values[..., 1] = float("nan")
        ids = torch.arange(3).expand(a, w, 3) + 10 * (step.step + 1)
        return values, ids
    builder = DraftTreeBuilder(top_k=3, max_depth=3, full_keep=9)
    tree = builder.build(torch.tensor([1]), drafter)
    assert int(tree.valid.sum()) == 3  # a single chain
    assert tree.tokens[0, :3].tolist() == [10, 20, 30]
    assert torch.isfinite(tree.scores[tree.valid]).all()


def test_drafter_shape_errors_are_clear():
    builder = DraftTreeBuilder(top_k=3, max_depth=2, full_keep=4)
    with pytest.raises(ValueError, match="drafter returned"):
        builder.build(torch.tensor([1]), lambda s: (torch.zeros(1, 1, 2), torch.zeros(1, 1, 2)))
