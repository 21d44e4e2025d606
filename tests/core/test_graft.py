import pytest
import torch

from tests.core.helpers import TableDrafter
from vllm_graft.core.acceptance import SamplingBatch, accept_tree
from vllm_graft.core.config import GraftConfig
from vllm_graft.core.graft import GraftTreeBuilder, accepted_by_source
from vllm_graft.core.hybrid import SOURCE_DRAFT, SOURCE_RETRIEVED
from vllm_graft.core.successor import SuccessorMatrix
from vllm_graft.testing.op_counter import OpCounter

VOCAB = 64


def _matrix():
    g = torch.Generator().manual_seed(3)
    m = SuccessorMatrix.empty(VOCAB, 8)
    m.update_(torch.arange(VOCAB),
              torch.stack([torch.randperm(VOCAB, generator=g)[:8] for _ in range(VOCAB)]))
    return m


# after token 1 the drafter is unsure, after token 2 it is sure of one child
CONFIDENCE = {1: 0.05, **{t: 0.99 for t in range(2, VOCAB)}}


@pytest.mark.parametrize("variant", ["graft", "dense_tree", "prune_only", "retrieval_only"])
@pytest.mark.parametrize("budget", [8, 60])
def test_variants_fill_the_budget_as_designed(variant, budget):
    cfg = GraftConfig(variant=variant, budget=budget, checkpoints=(0, 1, 5),
                      draft_keep=(min(8, budget), min(24, budget), min(40, budget)))
    builder = GraftTreeBuilder(cfg, _matrix())
    drafter = TableDrafter(VOCAB, cfg.top_k, confidence=CONFIDENCE)
    roots = torch.tensor([1, 2, 1, 2])
    tree, stats = builder.build(roots, drafter)
    assert tree.tokens.shape == (4, budget + 1)
    draft = (tree.source & SOURCE_DRAFT).bool() & tree.valid
    retrieved = (tree.source == SOURCE_RETRIEVED) & tree.valid
    nodes = tree.num_nodes - 1
    if variant == "graft":
        assert stats.stage.tolist() == [0, 3, 0, 3]
        assert (nodes == budget).all()  # retrieval refills what pruning freed
        assert draft.sum(1).tolist()[::2] == [min(8, budget)] * 2
        assert (retrieved.sum(1)[[0, 2]] > 0).all() if budget > 8 else True
    elif variant == "dense_tree":
        assert (nodes == budget).all() and not retrieved.any()
        assert stats.draft_steps.tolist() == [cfg.max_depth] * 4
    elif variant == "prune_only":
        assert nodes.tolist() == [min(8, budget), budget, min(8, budget), budget]
        assert not retrieved.any()
    else:
        assert stats.draft_steps.tolist() == [0] * 4 and not draft.any()
        assert (nodes == budget).all()


def test_retrieval_only_needs_no_drafter_but_others_do():
    with pytest.raises(ValueError, match="needs a drafter"):
        GraftTreeBuilder(GraftConfig(), _matrix()).build(torch.tensor([1]))
    tree, _ = GraftTreeBuilder(GraftConfig(variant="retrieval_only"), _matrix()).build(
        torch.tensor([5]))
    assert int(tree.num_nodes[0]) == 61


def test_observe_learns_every_verified_row():
    m = SuccessorMatrix.empty(VOCAB, 8)
    builder = GraftTreeBuilder(GraftConfig(variant="dense_tree", budget=12, top_k=3, max_depth=3,
                                           checkpoints=(), draft_keep=()), m)
    tree, _ = builder.build(torch.tensor([4, 9]), TableDrafter(VOCAB, 3))
    logits = torch.randn(2, 13, VOCAB)
    builder.observe(tree, logits)
    flat_tokens = tree.tokens.reshape(-1).tolist()
    flat_logits = logits.reshape(26, VOCAB)
    last_row = {t: i for i, t in enumerate(flat_tokens) if t >= 0}  # last occurrence wins
    assert sorted(m.touched_rows().tolist()) == sorted(last_row)
    for token, i in last_row.items():
        assert m.table[token].tolist() == flat_logits[i].topk(8).indices.tolist()


def test_retrieval_learns_the_target_while_decoding():
    """A target that always continues t -> t+1. Decoding with retrieval only, the matrix
    learns from every verification; once a token's successors are known, the whole
    rank-0 chain of the template is accepted in one step."""
    m = SuccessorMatrix.empty(VOCAB, 8)
    builder = GraftTreeBuilder(GraftConfig(variant="retrieval_only", budget=20), m)
    template = builder.expander.template.prefix(20)  # the nodes that fit the budget
    chain, node = 0, -1
    while (node := next((j for j, (p, r) in enumerate(zip(template.parents, template.ranks))
                         if p == node and r == 0), None)) is not None:
        chain += 1
    token, accepted, emitted = 0, [], [0]
    for _ in range(80):  # the first lap over the vocabulary teaches the matrix
        tree, _ = builder.build(torch.tensor([token]))
        logits = torch.nn.functional.one_hot((tree.tokens.clamp(min=0) + 1) % VOCAB, VOCAB) * 10.0
        result = accept_tree(tree, logits, SamplingBatch.greedy(1))
        builder.observe(tree, logits)
        n = int(result.num_accepted[0])
        accepted.append(n)
        emitted += result.output_tokens[0, :n + 1].tolist()
        token = emitted[-1]
    assert emitted == [t % VOCAB for t in range(len(emitted))]  # greedy output is the target's
    assert accepted[0] == 0 and accepted[-1] >= chain >= 6
    assert accepted_by_source(tree, result) == {"draft": 0, "retrieved": accepted[-1], "both": 0,
                                                "context": 0, "padding": 0}


def test_context_nodes_come_first_merge_with_others_and_are_counted():
    """Copied nodes lead the merge (the budget cut falls on retrieval), a copied token
    equal to a drafted or retrieved sibling merges into one node carrying both tags, and
    stats and acceptance counts classify copied nodes as ``context``."""
    from vllm_graft.core.acceptance import AcceptanceResult
    from vllm_graft.core.hybrid import SOURCE_CONTEXT

    cfg = GraftConfig(budget=8, checkpoints=(0, 1, 5), draft_keep=(2, 4, 6))
    builder = GraftTreeBuilder(cfg, _matrix())
    drafter = TableDrafter(VOCAB, cfg.top_k, confidence=CONFIDENCE)
    roots = torch.tensor([1, 2])
    plain_tree, _ = builder.build(roots, drafter)
    first_child = int(plain_tree.tokens[0, 1])  # the tree's best candidate for request 0
    # request 0 copies a chain whose first token is that candidate; request 1 copies 3
    # nodes no other source proposes (tokens above the table drafter's range are rare)
    context = (torch.tensor([[first_child, 60, 61], [62, 63, 5]]),
               torch.tensor([[-1, 0, 1], [-1, 0, -1]]),
               torch.tensor([[1, 2, 3], [1, 2, 1]]))
    tree, stats = builder.build(roots, drafter, context)
    assert (tree.num_nodes == 9).all()
    copied = (tree.source & SOURCE_CONTEXT).bool() & tree.valid
    assert stats.context_nodes.tolist() == copied.sum(1).tolist()
    assert tree.tokens[0, 1] == first_child and tree.source[0, 1] & SOURCE_DRAFT
    assert tree.source[0, 1] & SOURCE_CONTEXT  # merged: both tags
    assert tree.tokens[1, 1:4].tolist() == [62, 63, 5]  # parents first, in the given order
    assert copied[1, 1:4].all()
    assert tree.num_nodes.tolist() == plain_tree.num_nodes.tolist()  # same budget
    # the copied chain of request 1 is accepted: 2 context nodes, classified as context
    path = [int((tree.tokens[1] == 62).nonzero()), int((tree.tokens[1] == 63).nonzero())]
    result = AcceptanceResult(accepted_rows=torch.tensor([[-1, -1], path]),
                              output_tokens=torch.zeros(2, 3, dtype=torch.long),
                              num_accepted=torch.tensor([0, 2]))
    counts = accepted_by_source(tree, result)
    assert counts["context"] == 2 and counts["draft"] == counts["retrieved"] == 0


def test_a_scoring_builder_scores_drafted_nodes_by_the_drafter_and_retrieved_by_rank():
    """With ``score_nodes`` (budget auto's acceptance model reads it), a drafted node
    scores its probability under the drafter given its parent, a retrieved node
    ``1 / (1 + its successor rank)``, a node both proposed the higher; the tree itself is
    the one an unscored build makes."""
    cfg = GraftConfig(budget=60)
    matrix = _matrix()
    drafter = TableDrafter(VOCAB, cfg.top_k, confidence=CONFIDENCE)
    roots = torch.tensor([1, 2])
    plain, _ = GraftTreeBuilder(cfg, matrix).build(roots, drafter)
    tree, _ = GraftTreeBuilder(cfg, matrix, score_nodes=True).build(roots, drafter)
    assert plain.score is None
    assert torch.equal(tree.tokens, plain.tokens) and torch.equal(tree.source, plain.source)
    checked = set()
    for b in range(2):
        for row in range(1, int(tree.num_nodes[b])):
            token = int(tree.tokens[b, row])
            parent = int(tree.tokens[b, int(tree.parents[b, row])])
            expected = []
            if tree.source[b, row] & SOURCE_DRAFT:
                expected.append(drafter.logprobs[parent, token].exp().item())
            if tree.source[b, row] & SOURCE_RETRIEVED:
                rank = matrix.table[parent].tolist().index(token)
                expected.append(1.0 / (1 + rank))
            assert tree.score[b, row].item() == pytest.approx(max(expected), rel=1e-5)
            checked.add(int(tree.source[b, row]))
    assert checked >= {SOURCE_DRAFT, SOURCE_RETRIEVED}


@pytest.mark.parametrize("roots", [[1, 2, 3, 1], [1], [2, 3]])
def test_a_whole_build_waits_for_the_host_at_most_once_per_checkpoint_and_once_more(roots):
    """A tree build as the engine runs it (an unchecked matrix) waits for the host at
    each checkpoint the drafting reaches (which requests go on) and once in the merge
    (its depth): four times at most with three checkpoints, whatever the batch. It
    waited ten times before (three boolean-mask indexings per checkpoint)."""
    g = torch.Generator().manual_seed(3)
    matrix = SuccessorMatrix.empty(VOCAB, 8, check=False)
    matrix.update_(torch.arange(VOCAB), torch.stack(
        [torch.randperm(VOCAB, generator=g)[:8] for _ in range(VOCAB)]))
    cfg = GraftConfig(checkpoints=(0, 1, 5))
    builder = GraftTreeBuilder(cfg, matrix)
    drafter = TableDrafter(VOCAB, cfg.top_k, confidence=CONFIDENCE)
    with OpCounter() as counter:
        builder.build(torch.tensor(roots), drafter)
    assert 1 <= counter.host_waits <= len(cfg.checkpoints) + 1, counter.host_waits


@pytest.mark.parametrize("variant", ["graft", "dense_tree", "prune_only", "retrieval_only"])
@pytest.mark.parametrize("tree_shape", ["dynamic", "fixed"])
@pytest.mark.parametrize("with_context", [False, True])
@pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused"])
def test_a_wait_free_build_is_the_same_tree_with_no_wait_for_the_host(variant, tree_shape,
                                                                      with_context, fused):
    """What a CUDA graph can capture: a wait-free builder (every request drafts to the
    full depth, the merge takes the depth bound the host knows) builds the very tree the
    waiting one does, context copies included, and reads nothing from the device; a
    greedy walk bounded by the builder's ``depth_bound`` accepts what the unbounded walk
    does, so the whole greedy bookkeeping of a step is free of waits."""
    from vllm_graft.core.acceptance import greedy_walk

    g = torch.Generator().manual_seed(5)
    matrix = SuccessorMatrix.empty(VOCAB, 8, check=False)
    matrix.update_(torch.arange(VOCAB), torch.stack(
        [torch.randperm(VOCAB, generator=g)[:8] for _ in range(VOCAB)]))
    cfg = GraftConfig(variant=variant, budget=24, checkpoints=(0, 1, 5), draft_keep=(2, 4, 8),
                      tree_shape=tree_shape)
    drafter = TableDrafter(VOCAB, cfg.top_k, confidence=CONFIDENCE)
    roots = torch.tensor([1, 2, 3, 1, 7])
    context = None
    if with_context:  # each request copies its tree's deepest path: merges at every depth
        plain, _ = GraftTreeBuilder(cfg, matrix, fused=fused).build(roots, drafter)
        width = 6
        tokens = torch.full((5, width), -1)
        for b in range(5):
            row, path = int(plain.depths[b].argmax()), []
            while row > 0:
                path.insert(0, int(plain.tokens[b, row]))
                row = int(plain.parents[b, row])
            tokens[b, :len(path[:width])] = torch.tensor(path[:width])
        assert int((tokens >= 0).sum(1).max()) >= 4
        context = (tokens, torch.arange(-1, width - 1).expand(5, -1),
                   torch.arange(1, width + 1).expand(5, -1))
    waiting, waiting_stats = GraftTreeBuilder(cfg, matrix, fused=fused).build(roots, drafter,
                                                                              context)
    builder = GraftTreeBuilder(cfg, matrix, wait_free=True, fused=fused)
    with OpCounter() as counter:
        tree, stats = builder.build(roots, drafter, context)
    assert counter.host_waits == 0
    for name in ("tokens", "parents", "depths", "valid", "source", "num_nodes"):
        assert torch.equal(getattr(tree, name), getattr(waiting, name)), name
    for name in ("stage", "draft_steps", "draft_nodes", "retrieved_nodes", "context_nodes",
                 "padded_nodes"):
        assert torch.equal(getattr(stats, name), getattr(waiting_stats, name)), name
    bound = builder.depth_bound(0 if context is None else context[0].shape[1])
    assert tree.max_depth <= bound
    # a target that follows the tree's first child at every row, and a stranger elsewhere
    first_child = torch.full_like(tree.tokens, VOCAB - 1)
    for b in range(tree.tokens.shape[0]):
        for row in range(tree.tokens.shape[1] - 1, 0, -1):
            if tree.valid[b, row]:
                first_child[b, tree.parents[b, row]] = tree.tokens[b, row]
    walked, bounded = greedy_walk(tree, first_child), greedy_walk(tree, first_child, bound)
    assert torch.equal(walked.num_accepted, bounded.num_accepted)
    assert bool((walked.num_accepted >= 1).all())
    depth = walked.accepted_rows.shape[1]
    assert torch.equal(bounded.accepted_rows[:, :depth], walked.accepted_rows)
    assert torch.equal(bounded.output_tokens[:, :depth + 1], walked.output_tokens)


@pytest.mark.parametrize("variant", ["graft", "dense_tree", "retrieval_only"])
def test_a_wait_free_greedy_step_runs_on_the_meta_device(variant):
    """What a CUDA graph needs, checked without a GPU: tensors on the ``meta`` device
    have no data, so any read of the device (a scalar, ``nonzero``, a boolean mask, a
    depth read by the host) raises, and so does mixing in a tensor made on the host. The
    wait-free build, the target's top-k at its rows, the walk bounded by the builder's
    depth bound and the matrix update all run there; the waiting build does not."""
    from vllm_graft.core.acceptance import greedy_walk

    meta = torch.device("meta")
    cfg = GraftConfig(variant=variant, budget=24, checkpoints=(0, 1, 5), draft_keep=(2, 4, 8),
                      tree_shape="fixed")
    matrix = SuccessorMatrix(torch.empty(VOCAB, 8, dtype=torch.int32, device=meta),
                             check=False)  # the compiled ops, as the engine runs them
    drafter = TableDrafter(VOCAB, cfg.top_k, confidence=CONFIDENCE)
    drafter.logprobs = drafter.logprobs.to(meta)
    roots = torch.empty(5, dtype=torch.long, device=meta)
    builder = GraftTreeBuilder(cfg, matrix, device=meta, wait_free=True)
    tree, stats = builder.build(roots, drafter)
    assert tree.tokens.shape == (5, cfg.budget + 1) and tree.tokens.device == meta
    logits = torch.empty(5, cfg.budget + 1, VOCAB, device=meta)
    top = builder.target_topk(tree, logits)
    result = greedy_walk(tree, top[..., 0], builder.depth_bound())
    builder.observe(tree, logits, row_topk=top)
    assert result.num_accepted.device == meta
    if variant != "retrieval_only":  # its build never drafts, so it never waited either
        with pytest.raises((RuntimeError, NotImplementedError)):
            GraftTreeBuilder(cfg, matrix, device=meta, fused=False).build(roots, drafter)


def test_the_depth_bound_holds_a_tail_chain_and_a_walk_refuses_a_bound_too_small():
    """Graft-TAIL's chains are ``budget`` deep; a walk given a bound below its tree's
    depth would cut the accepted path short, so the CPU, where reading the depth costs
    nothing, refuses it."""
    from vllm_graft.core.acceptance import greedy_walk

    cfg = GraftConfig(variant="tail", budget=6)
    builder = GraftTreeBuilder(cfg, _matrix())
    drafter = TableDrafter(VOCAB, 1, confidence={t: 0.99 for t in range(VOCAB)})
    chain, _ = builder.build(torch.tensor([2, 3]), drafter)
    assert 2 <= chain.max_depth <= builder.depth_bound() == cfg.budget
    row_tokens = torch.zeros_like(chain.tokens)
    greedy_walk(chain, row_tokens, builder.depth_bound())
    with pytest.raises(ValueError, match="past its bound"):
        greedy_walk(chain, row_tokens, chain.max_depth - 1)
