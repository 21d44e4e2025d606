"""Fixed-shape trees (``graft.tree_shape``): exactly ``budget`` nodes per request, valid,
deterministic, and lossless under acceptance."""

import pytest
import torch

from tests.core.helpers import TableDrafter
from tests.core.stats import chi_square_pvalue
from tests.core.test_acceptance import _python_greedy_walk
from tests.core.test_hybrid import _check_invariants
from vllm_graft.core.acceptance import SamplingBatch, accept_tree, sampling_probs
from vllm_graft.core.config import GraftConfig, GraftConfigError, TreeShape, resolve_tree_shape
from vllm_graft.core.graft import GraftTreeBuilder, accepted_by_source, learnable_tokens
from vllm_graft.core.hybrid import (SOURCE_DRAFT, SOURCE_PAD, SOURCE_RETRIEVED,
                                    merge_and_flatten, pad_to_budget)
from vllm_graft.core.successor import SuccessorMatrix

VOCAB = 64
VARIANTS = ["graft", "dense_tree", "prune_only", "retrieval_only"]
# after token 1 the drafter is unsure (prunes at the root), after others it is sure
CONFIDENCE = {1: 0.05, **{t: 0.99 for t in range(2, VOCAB)}}


def _matrix(rows: int, seed: int = 3, vocab: int = VOCAB) -> SuccessorMatrix:
    """A matrix that knows the successors of tokens ``[0, rows)`` only."""
    g = torch.Generator().manual_seed(seed)
    m = SuccessorMatrix.empty(vocab, 8)
    if rows:
        m.update_(torch.arange(rows),
                  torch.stack([torch.randperm(vocab, generator=g)[:8] for _ in range(rows)]))
    return m


# ---- configuration -------------------------------------------------------------------
def test_resolution_table():
    assert GraftConfig().tree_shape is TreeShape.AUTO
    expected = {("auto", True): "fixed", ("auto", False): "dynamic",
                ("fixed", True): "fixed", ("fixed", False): "fixed",
                ("dynamic", True): "dynamic", ("dynamic", False): "dynamic"}
    for (setting, graphs), shape in expected.items():
        assert resolve_tree_shape(setting, graphs) is TreeShape(shape)
        assert resolve_tree_shape(TreeShape(setting), graphs) is TreeShape(shape)
    with pytest.raises(GraftConfigError, match=r"graft\.tree_shape"):
        resolve_tree_shape("static", True)


def test_bad_tree_shape_names_the_key():
    with pytest.raises(GraftConfigError, match=r"graft\.tree_shape"):
        GraftConfig.from_dict({"tree_shape": "static"})
    assert GraftConfig.from_dict({"tree_shape": "fixed"}).tree_shape is TreeShape.FIXED


def test_builder_resolves_the_config_unless_told():
    m = _matrix(VOCAB)
    assert not GraftTreeBuilder(GraftConfig(), m).fixed_shape  # auto, no CUDA graphs known
    assert GraftTreeBuilder(GraftConfig(tree_shape="fixed"), m).fixed_shape
    assert GraftTreeBuilder(GraftConfig(), m, tree_shape=resolve_tree_shape("auto", True)
                            ).fixed_shape
    assert not GraftTreeBuilder(GraftConfig(tree_shape="fixed"), m,
                                tree_shape=TreeShape.DYNAMIC).fixed_shape
    with pytest.raises(ValueError, match="budget"):
        GraftTreeBuilder(GraftConfig(tree_shape="fixed", budget=60), _matrix(0, vocab=40))


# ---- shape and validity --------------------------------------------------------------
@pytest.mark.parametrize("known_rows", [0, 8, VOCAB], ids=["cold", "partial", "warm"])
@pytest.mark.parametrize("budget", [8, 60])
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_tree_has_exactly_budget_valid_nodes(variant, budget, known_rows):
    cfg = GraftConfig(variant=variant, budget=budget, tree_shape="fixed")
    builder = GraftTreeBuilder(cfg, _matrix(known_rows))
    roots = torch.tensor([1, 2, 3, 5, 9, 40, 63, 0])
    drafter = TableDrafter(VOCAB, cfg.top_k, confidence=CONFIDENCE)
    tree, stats = builder.build(roots, drafter)
    assert tree.tokens.shape == (roots.numel(), budget + 1)
    assert tree.valid.all() and (tree.num_nodes == budget + 1).all()
    assert ((tree.tokens >= 0) & (tree.tokens < VOCAB)).all()
    assert torch.equal(tree.tokens[:, 0], roots)
    _check_invariants(tree, budget)  # parents first, depths, distinct siblings, mask
    # padding only where nothing real was left, and it is counted
    assert torch.equal(stats.padded_nodes, (tree.source == SOURCE_PAD).sum(1))
    assert (stats.padded_nodes + stats.draft_nodes + stats.retrieved_nodes == budget).all()
    if known_rows == VOCAB and variant in ("graft", "retrieval_only") and budget == 8:
        assert not stats.padded_nodes.any()  # a warm matrix fills small trees
    if variant == "dense_tree":
        assert not stats.padded_nodes.any()  # the drafter alone fills the budget
    if variant == "prune_only":  # freed slots hold padding, never spare drafts
        pruned = stats.stage == 0
        assert (stats.draft_nodes[pruned] == cfg.draft_keep[0]).all()
        assert (stats.padded_nodes[pruned] == budget - cfg.draft_keep[0]).all()
    # determinism: the same inputs give the same tree, from this builder and a new one
    again, _ = builder.build(roots, TableDrafter(VOCAB, cfg.top_k, confidence=CONFIDENCE))
    fresh, _ = GraftTreeBuilder(cfg, _matrix(known_rows)).build(
        roots, TableDrafter(VOCAB, cfg.top_k, confidence=CONFIDENCE))
    for name in ("tokens", "parents", "depths", "valid", "source", "ancestor", "num_nodes"):
        assert torch.equal(getattr(tree, name), getattr(again, name)), name
        assert torch.equal(getattr(tree, name), getattr(fresh, name)), name


def test_padding_is_last_and_bounded_in_depth():
    """Cold matrix, retrieval only: the whole tree is padding under the root (depth 1);
    with some real nodes, padding hangs under the last one, one level deeper."""
    cfg = GraftConfig(variant="retrieval_only", budget=20, tree_shape="fixed")
    tree, stats = GraftTreeBuilder(cfg, _matrix(0)).build(torch.tensor([7]))
    assert tree.parents[0, 1:].tolist() == [0] * 20 and tree.depths[0, 1:].tolist() == [1] * 20
    assert tree.tokens[0, 1:].tolist() == [(7 + 1 + i) % VOCAB for i in range(20)]
    assert stats.padded_nodes.tolist() == [20]
    cfg = GraftConfig(variant="prune_only", budget=20, tree_shape="fixed")
    tree, stats = GraftTreeBuilder(cfg, _matrix(0)).build(
        torch.tensor([1]), TableDrafter(VOCAB, cfg.top_k, confidence=CONFIDENCE))
    n = cfg.draft_keep[0] + 1
    assert (tree.source[0, 1:n] == SOURCE_DRAFT).all() and (tree.source[0, n:] == SOURCE_PAD).all()
    assert (tree.parents[0, n:] == n - 1).all()
    assert (tree.depths[0, n:] == tree.depths[0, n - 1] + 1).all()


def test_pad_to_budget_keeps_real_rows_and_refuses_small_vocabularies():
    parts = [(torch.tensor([[4, 5, -1], [4, 4, 6]]), torch.tensor([[-1, 0, -1], [-1, -1, 0]]),
              torch.tensor([[1, 2, 1], [1, 1, 2]]), SOURCE_RETRIEVED)]
    tree = merge_and_flatten(torch.tensor([9, 5]), parts, budget=6)
    padded = pad_to_budget(tree, vocab_size=10)
    for b in range(2):
        n = int(tree.num_nodes[b])
        for name in ("tokens", "parents", "depths", "source"):
            assert torch.equal(getattr(padded, name)[b, :n], getattr(tree, name)[b, :n])
    assert padded.tokens.tolist() == [[9, 4, 5, 6, 7, 8, 9], [5, 4, 6, 7, 8, 9, 0]]
    _check_invariants(padded, 6)
    with pytest.raises(ValueError, match="distinct"):
        pad_to_budget(tree, vocab_size=5)


def test_fixed_equals_dynamic_where_the_dynamic_tree_is_full():
    """Pruned requests with a warm matrix: the fixed tree is the dynamic one."""
    m = _matrix(VOCAB)
    cfg = GraftConfig(budget=60)
    roots = torch.tensor([1, 1])
    drafter = lambda: TableDrafter(VOCAB, cfg.top_k, confidence=CONFIDENCE)  # noqa: E731
    dynamic, _ = GraftTreeBuilder(cfg, m, tree_shape="dynamic").build(roots, drafter())
    fixed, _ = GraftTreeBuilder(cfg, m, tree_shape="fixed").build(roots, drafter())
    assert (dynamic.num_nodes == 61).all()
    for name in ("tokens", "parents", "depths", "valid"):
        assert torch.equal(getattr(dynamic, name), getattr(fixed, name)), name


# ---- replacement of low-confidence drafted nodes -------------------------------------
def test_low_confidence_drafted_nodes_make_room_for_retrieval():
    """A sure drafter at the root (stage_full): nodes below the last threshold are
    replaced by retrieved ones, never below draft_keep[-1]; zero thresholds replace
    nothing."""
    m = _matrix(VOCAB)
    sure = {t: 0.9 for t in range(VOCAB)}  # best path 0.9 ** depth: passes 0.15 at depth 6
    roots = torch.tensor([2, 3, 4])
    cfg = GraftConfig(budget=60, tree_shape="fixed")
    builder = GraftTreeBuilder(cfg, m)
    tree, stats = builder.build(roots, TableDrafter(VOCAB, cfg.top_k, confidence=sure))
    assert (stats.stage == builder.full_stage).all()
    assert (stats.replaced_nodes > 0).all()
    assert (stats.draft_nodes >= cfg.draft_keep[-1]).all() and (stats.retrieved_nodes > 0).all()
    assert not stats.padded_nodes.any()
    # the retained drafted nodes are the best ones: the dropped ones are all below tau
    plain = GraftTreeBuilder(cfg, m, tree_shape="dynamic")
    dense, _ = plain.build(roots, TableDrafter(VOCAB, cfg.top_k, confidence=sure))
    drafter = TableDrafter(VOCAB, cfg.top_k, confidence=sure)
    draft = builder.drafter_tree.build(roots.long(), drafter)
    tau = builder.thresholds[-1]
    for b in range(3):
        confident = int((draft.scores[b].exp() >= tau).sum())
        kept = max(cfg.draft_keep[-1], confident)
        assert int(stats.replaced_nodes[b]) == cfg.budget - kept
        assert int(stats.draft_nodes[b]) >= kept
        assert int((dense.source[b] == SOURCE_DRAFT).sum()) == cfg.budget
    # zero thresholds: nothing is below them, the tree is the dense one
    zero = GraftTreeBuilder(GraftConfig(budget=60, tree_shape="fixed", thresholds=[0, 0, 0]), m)
    tree0, stats0 = zero.build(roots, TableDrafter(VOCAB, cfg.top_k, confidence=sure))
    assert not stats0.replaced_nodes.any()
    assert torch.equal(tree0.tokens, dense.tokens) and torch.equal(tree0.parents, dense.parents)


def test_observe_skips_padding():
    m = _matrix(0)
    builder = GraftTreeBuilder(GraftConfig(variant="retrieval_only", budget=12,
                                           tree_shape="fixed"), m)
    tree, _ = builder.build(torch.tensor([3]))
    assert (tree.source[0, 1:] == SOURCE_PAD).all()
    assert learnable_tokens(tree)[0].tolist() == [3] + [-1] * 12
    builder.observe(tree, torch.randn(1, 13, VOCAB))
    assert m.touched_rows().tolist() == [3]  # the root only


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_fixed_shape_on_cuda_matches_cpu():
    cfg = GraftConfig(budget=60, tree_shape="fixed", ops_backend="reference")
    roots = torch.tensor([1, 2, 3, 40])
    trees = []
    for device in ("cpu", "cuda"):
        m = _matrix(8)
        m = SuccessorMatrix(m.table.to(device), backend="reference")
        drafter = TableDrafter(VOCAB, cfg.top_k, confidence=CONFIDENCE)
        drafter.logprobs = drafter.logprobs.to(device)
        tree, _ = GraftTreeBuilder(cfg, m, device=device).build(roots.to(device), drafter)
        trees.append(tree)
    for name in ("tokens", "parents", "depths", "valid", "source"):
        assert torch.equal(getattr(trees[0], name), getattr(trees[1], name).cpu()), name


# ---- lossless acceptance on fixed trees ----------------------------------------------
SMALL_VOCAB = 10
SAMPLES = 120_000


def _padded_tree(batch, duplicate_padding=False):
    """Root 0 -> retrieved {3 -> 4}, then 6 padding nodes under the leaf 4 (tokens
    5..9, 0 for distinct padding). ``duplicate_padding``: every padding node carries
    token 5 (what a careless padding would do; the explicit rule then double-counts)."""
    m = SuccessorMatrix.empty(SMALL_VOCAB, 2)
    m.table[0] = torch.tensor([3, -1], dtype=torch.int32)  # one known successor each
    m.table[3] = torch.tensor([4, -1], dtype=torch.int32)
    cfg = GraftConfig(variant="retrieval_only", budget=8, tree_shape="fixed", successor_k=2,
                      retrieval_width=2, retrieval_depth=2, retrieval_slack=0)
    tree, _ = GraftTreeBuilder(cfg, m).build(torch.zeros(batch, dtype=torch.long))
    if duplicate_padding:
        tree.tokens[tree.source == SOURCE_PAD] = 5
    return tree


def test_padded_tree_layout():
    tree = _padded_tree(1)
    assert tree.tokens[0].tolist() == [0, 3, 4, 5, 6, 7, 8, 9, 0]
    assert tree.parents[0].tolist() == [-1, 0, 1, 2, 2, 2, 2, 2, 2]
    assert tree.source[0].tolist() == [0, SOURCE_RETRIEVED, SOURCE_RETRIEVED] + [SOURCE_PAD] * 6


def _leaf_logits(rows, seed):
    """Logits at each row; the root and row 1 favour the retrieved path, the leaf (row
    2) spreads its mass over the padding tokens so padding is accepted and rejected."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, SMALL_VOCAB, generator=g)
    logits[0, 3] += 5.0
    logits[1, 4] += 5.0
    logits[2, 5:] += 1.0
    return logits


def _sample(tree, row_logits, seed=5):
    batch = tree.tokens.shape[0]
    torch.manual_seed(seed)
    return accept_tree(tree, row_logits.unsqueeze(0).expand(batch, -1, -1),
                       SamplingBatch(temperature=torch.ones(batch)))


def _emitted_at_leaf(result):
    """Tokens emitted at the leaf row (after accepting 3, 4)."""
    out = result.output_tokens
    at_leaf = (out[:, 0] == 3) & (out[:, 1] == 4)
    return torch.bincount(out[at_leaf, 2], minlength=SMALL_VOCAB), int(at_leaf.sum())


def test_sampling_is_lossless_through_padding():
    tree = _padded_tree(SAMPLES)
    row_logits = _leaf_logits(tree.tokens.shape[1], seed=11)
    result = _sample(tree, row_logits)
    target = sampling_probs(row_logits, torch.ones(row_logits.shape[0]), None, None)
    first = torch.bincount(result.output_tokens[:, 0], minlength=SMALL_VOCAB)
    assert chi_square_pvalue(first, target[0]) > 1e-5
    counts, n = _emitted_at_leaf(result)
    assert n > 20_000
    assert chi_square_pvalue(counts, target[2]) > 1e-5, (counts.tolist(), target[2])
    # padding was really accepted (and the walk then emits from the padding row)
    accepted_padding = accepted_by_source(tree, result)["padding"]
    assert accepted_padding > 10_000


def test_duplicate_padding_would_break_the_explicit_rule():
    """Negative control: padding with one token repeated under the leaf makes the
    multi-draft rule try that token several times; the same check must flag it."""
    tree = _padded_tree(SAMPLES, duplicate_padding=True)
    row_logits = _leaf_logits(tree.tokens.shape[1], seed=11)
    result = _sample(tree, row_logits)
    target = sampling_probs(row_logits, torch.ones(row_logits.shape[0]), None, None)
    counts, _ = _emitted_at_leaf(result)
    assert chi_square_pvalue(counts, target[2]) < 1e-6


@pytest.mark.parametrize("seed", range(4))
def test_greedy_on_fixed_trees_equals_the_argmax_walk(seed):
    vocab, batch = 40, 8
    torch.manual_seed(seed)
    m = _matrix(10, seed=seed, vocab=vocab)
    builder = GraftTreeBuilder(GraftConfig(budget=20, top_k=4, max_depth=4, checkpoints=(0, 1),
                                           draft_keep=(3, 8), tree_shape="fixed"), m)
    tree, stats = builder.build(torch.randint(0, vocab, (batch,)),
                                TableDrafter(vocab, 4, seed=seed))
    assert (tree.num_nodes == 21).all()
    logits = torch.randn(batch, tree.tokens.shape[1], vocab)
    for b in range(batch):  # follow a random child with probability 0.8, padding included
        for r in range(tree.tokens.shape[1]):
            kids = [i for i in range(tree.tokens.shape[1]) if int(tree.parents[b, i]) == r]
            if kids and torch.rand(()) < 0.8:
                logits[b, r, int(tree.tokens[b, kids[torch.randint(len(kids), ())]])] += 10
    result = accept_tree(tree, logits, SamplingBatch.greedy(batch))
    for b in range(batch):
        accepted, out = _python_greedy_walk(tree, logits, b)
        assert result.accepted_rows[b, :len(accepted)].tolist() == accepted
        assert result.output_tokens[b, :len(out)].tolist() == out
