"""The fused Graft step (vllm_graft/core/fused.py) against the pure-torch path.

The same trees (tokens, parents, depths, sources, scores, build statistics) over many
seeds, batch sizes, vocabularies, variants, tree shapes, context copies and matrix
partitions; the same accepted paths and matrix updates, greedy and sampled (the sampled
walk given the same random numbers); the sampled walk's output distribution against an
exactly computed one, with a negative control it must reject; and the dispatch counts
of a whole step, the proxy of its cost on a GPU.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch

from tests.core.helpers import TableDrafter
from tests.core.stats import chi_square_pvalue
from vllm_graft.core import fused
from vllm_graft.core.acceptance import (SamplingBatch, accept_tree, greedy_walk,
                                        sampling_probs)
from vllm_graft.core.config import GraftConfig
from vllm_graft.core.graft import GraftTreeBuilder, learnable_tokens
from vllm_graft.core.hybrid import HybridTree
from vllm_graft.core.successor import SuccessorMatrix

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_core  # noqa: E402

TREE_FIELDS = ("tokens", "parents", "depths", "valid", "source", "num_nodes")
STATS_FIELDS = ("stage", "draft_steps", "draft_nodes", "retrieved_nodes", "both_nodes",
                "context_nodes", "padded_nodes", "replaced_nodes", "retrieval_lookups",
                "retrieval_hits")


def _matrix(vocab: int, seed: int, partitions: int = 1, fill: float = 0.8) -> SuccessorMatrix:
    """A random matrix whose rows are full for a share ``fill`` of the tokens."""
    g = torch.Generator().manual_seed(seed)
    matrix = SuccessorMatrix.empty(vocab, 8, check=False)
    matrix.resize_partitions_(partitions)
    rows = vocab * partitions
    table = torch.stack([torch.randperm(vocab, generator=g)[:8] for _ in range(rows)])
    empty = torch.rand(rows, generator=g) > fill
    table[empty] = -1
    matrix.table.copy_(table.int())
    return matrix


def _context(batch: int, width: int, vocab: int, seed: int) -> tuple:
    """Copied chains of random length, some repeating a prefix of another request's."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, width + 1, (batch,), generator=g)
    tokens = torch.randint(0, vocab, (batch, width), generator=g)
    tokens[torch.arange(width)[None, :] >= lengths[:, None]] = -1
    parents = torch.arange(-1, width - 1).expand(batch, -1).clone()
    depths = torch.arange(1, width + 1).expand(batch, -1).clone()
    depths[tokens < 0] = 0
    parents[tokens < 0] = -1
    return tokens, parents, depths


def _assert_same_build(reference, fused_build, scored: bool):
    (tree, stats), (ftree, fstats) = reference, fused_build
    for name in TREE_FIELDS:
        assert torch.equal(getattr(tree, name), getattr(ftree, name)), name
    if scored:
        assert torch.allclose(tree.score, ftree.score, atol=1e-6)
    for name in STATS_FIELDS:
        assert torch.equal(getattr(stats, name).long(), getattr(fstats, name).long()), name
    assert torch.equal(stats.confidence.isnan(), fstats.confidence.isnan())
    assert torch.allclose(stats.confidence.nan_to_num(), fstats.confidence.nan_to_num())


BUILDS = [dict(variant=v, tree_shape=s, budget=b)
          for v, s, b in itertools.product(("graft", "dense_tree", "prune_only", "retrieval_only"),
                                           ("dynamic", "fixed"), (8, 24, 60))]


@pytest.mark.parametrize("settings", BUILDS, ids=lambda s: "-".join(map(str, s.values())))
@pytest.mark.parametrize("seed", range(3))
def test_fused_builds_are_the_torch_builds(settings, seed):
    vocab = (61, 300, 2003)[seed]
    batch = (1, 3, 8)[seed]
    checkpoints = dict(checkpoints=(0, 1, 5), draft_keep=(
        min(8, settings["budget"]), min(24, settings["budget"]), min(40, settings["budget"])))
    cfg = GraftConfig(**settings, **checkpoints, thresholds=(0.5, 0.3, 0.2))
    matrix = _matrix(vocab, seed)
    g = torch.Generator().manual_seed(seed)
    roots = torch.randint(0, vocab, (batch,), generator=g)
    for sharpness in (0.5, 3.0):  # unsure drafters stop at the checkpoints, sure ones go on
        drafter = TableDrafter(vocab, cfg.top_k, sharpness=sharpness, seed=seed)
        torch_builder = GraftTreeBuilder(cfg, matrix, score_nodes=True, fused=False)
        fused_builder = GraftTreeBuilder(cfg, matrix, score_nodes=True, fused=True)
        _assert_same_build(torch_builder.build(roots, drafter),
                           fused_builder.build(roots, drafter), scored=True)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tree_shape", ["dynamic", "fixed"])
def test_fused_builds_merge_context_copies_and_read_their_partition(seed, tree_shape):
    """Context chains (duplicates of drafted and retrieved nodes among them) merge into
    the tree, and each request retrieves from its own partition (-1: none)."""
    vocab, batch, width = 64, 6, 16
    cfg = GraftConfig(budget=60, tree_shape=tree_shape, thresholds=(0.5, 0.3, 0.2))
    matrix = _matrix(vocab, seed, partitions=3, fill=1.0)
    g = torch.Generator().manual_seed(seed)
    roots = torch.randint(0, vocab, (batch,), generator=g)
    partitions = torch.tensor([0, 1, 2, -1, 1, 0])
    drafter = TableDrafter(vocab, cfg.top_k, sharpness=1.5, seed=seed)
    context = _context(batch, width, vocab, seed)
    torch_builder = GraftTreeBuilder(cfg, matrix, score_nodes=True, fused=False)
    fused_builder = GraftTreeBuilder(cfg, matrix, score_nodes=True, fused=True)
    reference = torch_builder.build(roots, drafter, context, partitions)
    got = fused_builder.build(roots, drafter, context, partitions)
    _assert_same_build(reference, got, scored=True)
    assert int(got[1].context_nodes.sum()) > 0 and int(got[1].both_nodes.sum()) >= 0


def test_a_fused_build_keeps_no_view_of_its_buffers():
    """The trees a builder returns survive its next build (the engine keeps them until
    they are verified)."""
    cfg = GraftConfig(budget=24, checkpoints=(0, 1, 5), draft_keep=(4, 8, 16))
    builder = GraftTreeBuilder(cfg, _matrix(97, 0), fused=True)
    drafter = TableDrafter(97, cfg.top_k)
    first, _ = builder.build(torch.tensor([1, 2]), drafter)
    kept = first.tokens.clone()
    builder.build(torch.tensor([5, 6]), drafter)
    assert torch.equal(first.tokens, kept)


def test_ancestor_bits_are_the_ancestor_mask_and_learn_rows_skip_padding():
    vocab = 131
    cfg = GraftConfig(budget=100, tree_shape="fixed", checkpoints=(0, 1, 5),
                      draft_keep=(8, 24, 40))
    matrix = _matrix(vocab, 1, partitions=2)
    builder = GraftTreeBuilder(cfg, matrix, fused=True)
    partitions = torch.tensor([1, 0, -1])
    buffers = builder.fused.build(torch.tensor([3, 4, 5]), TableDrafter(vocab, cfg.top_k),
                                  partitions=partitions, successors=matrix.table)
    tree = buffers.tree()
    mask = tree.ancestor
    rows = tree.tokens.shape[1]
    bits = buffers.ancestor_bits  # [B, R, 2]: 101 rows need two words
    assert bits.shape[2] == 2
    columns = torch.arange(rows)
    from_bits = ((bits[:, :, columns // 64] >> (columns % 64)) & 1).bool()
    assert torch.equal(from_bits, mask)
    expected = matrix.partition_rows(learnable_tokens(tree), partitions[:, None])
    assert torch.equal(buffers.learn_rows, expected)
    assert bool((tree.source == 4).any())  # there was padding to skip


def _steered(tree: HybridTree, vocab: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return bench_core.steer_logits(tree, vocab, tree.tokens.shape[0], seed) * scale


@pytest.mark.parametrize("tree_shape", ["dynamic", "fixed"])
@pytest.mark.parametrize("batch, vocab", [(1, 97), (5, 1000), (8, 5003)])
def test_fused_greedy_acceptance_is_the_walk_and_the_update(tree_shape, batch, vocab):
    cfg = GraftConfig(budget=60, tree_shape=tree_shape)
    builder, drafter, roots = bench_core.build_inputs(batch, vocab, "compiled", cfg, "cpu",
                                                      fused_ops=True)
    buffers = builder.fused.build(roots, drafter, successors=builder.matrix.table)
    tree = buffers.tree()
    logits = _steered(tree, vocab, batch)
    top = builder.target_topk(tree, logits)
    expected = greedy_walk(tree, top[..., 0], max_depth=builder.fused.recipe.levels)
    reference = SuccessorMatrix(builder.matrix.table.clone(), check=False)
    reference.update_(learnable_tokens(tree).reshape(-1), top.reshape(-1, top.shape[-1]))
    fused.accept_greedy(buffers, logits.view(-1, vocab), builder.matrix.table, vocab)
    assert int(buffers.num_accepted.sum()) > batch  # the walks went deep
    assert torch.equal(buffers.accepted_rows, expected.accepted_rows)
    assert torch.equal(buffers.output_tokens, expected.output_tokens)
    assert torch.equal(buffers.num_accepted, expected.num_accepted)
    assert torch.equal(builder.matrix.table, reference.table)
    from vllm_graft.core.graft import accepted_by_source
    counts = accepted_by_source(tree, expected)
    assert buffers.accepted_sources.sum(0).tolist() == [counts[name] for name in
                                                        fused.SOURCE_CLASSES]


SAMPLED = [dict(temperature=1.0), dict(temperature=0.7, top_k=3),
           dict(temperature=1.3, top_p=0.8), dict(temperature=0.9, top_k=20, top_p=0.9),
           dict(temperature=0.0)]


@pytest.mark.parametrize("settings", SAMPLED, ids=lambda s: ",".join(f"{k}={v}" for k, v in
                                                                      s.items()))
@pytest.mark.parametrize("seed", range(3))
def test_fused_sampled_acceptance_walks_as_the_reference_given_its_random_numbers(settings,
                                                                                  seed):
    vocab, batch = (97, 1000, 300)[seed], (4, 7, 2)[seed]
    cfg = GraftConfig(budget=60, tree_shape=("dynamic", "fixed", "dynamic")[seed])
    builder, drafter, roots = bench_core.build_inputs(batch, vocab, "compiled", cfg, "cpu",
                                                      fused_ops=True)
    buffers = builder.fused.build(roots, drafter, successors=builder.matrix.table)
    tree = buffers.tree()
    logits = _steered(tree, vocab, seed, scale=0.6)  # peaked enough to accept, not always
    n = torch.full((batch,), 1.0)
    sampling = SamplingBatch(
        temperature=n * settings["temperature"],
        top_k=(n * settings["top_k"]).long() if "top_k" in settings else None,
        top_p=n * settings["top_p"] if "top_p" in settings else None)
    accepted = 0
    for draw in range(4):
        torch.manual_seed(100 * seed + draw)
        fused.accept_sampled(buffers, logits.view(-1, vocab), fused.SamplingTensors.of(sampling),
                             builder.matrix.table.clone(), vocab)
        expected = accept_tree(tree, logits, sampling, uniforms=buffers.uniforms.clone())
        width = expected.output_tokens.shape[1]
        assert torch.equal(buffers.num_accepted, expected.num_accepted)
        assert torch.equal(buffers.output_tokens[:, :width], expected.output_tokens)
        assert bool((buffers.output_tokens[:, width:] == -1).all())
        accepted += int(buffers.num_accepted.sum())
    assert accepted > 0


class _Chain3Tree:
    """A fixed tree over a 6-token vocabulary for the distribution test: the root has
    children 1, 2, 4; node 1 has children 0, 3; node 3 a child 5 (rows in that order)."""

    tokens = [0, 1, 2, 4, 0, 3, 5]
    parents = [-1, 0, 0, 0, 1, 1, 5]

    @classmethod
    def tree(cls, batch: int) -> HybridTree:
        tokens = torch.tensor(cls.tokens).expand(batch, -1).contiguous()
        parents = torch.tensor(cls.parents).expand(batch, -1).contiguous()
        depths = torch.tensor([0, 1, 1, 1, 2, 2, 3]).expand(batch, -1).contiguous()
        valid = torch.ones_like(tokens, dtype=torch.bool)
        return HybridTree(tokens=tokens, parents=parents, depths=depths, valid=valid,
                          source=torch.ones_like(tokens, dtype=torch.uint8),
                          num_nodes=torch.full((batch,), tokens.shape[1]))


def _exact_first_two(logits: torch.Tensor, sampling: dict) -> torch.Tensor:
    """[V, V] the exact probability of plain sampling's first two tokens, where the
    second is sampled only after a token the tree continues (row 1 after token 1, row 5
    after its child 3): otherwise the walk stops and the pair is (token, -1), counted
    in the last column."""
    vocab = logits.shape[1]
    t = torch.tensor([sampling["temperature"]])
    k = torch.tensor([sampling.get("top_k", 0)])
    p = torch.tensor([sampling.get("top_p", 1.0)])
    probs = [sampling_probs(logits[r:r + 1].double(), t, k, p)[0] for r in range(logits.shape[0])]
    node_after = {1: 1, 2: 2, 4: 3}  # first token -> its tree row
    joint = torch.zeros(vocab, vocab + 1, dtype=torch.float64)
    for first in range(vocab):
        if first in node_after:
            joint[first, :vocab] = probs[0][first] * probs[node_after[first]]
        else:
            joint[first, vocab] = probs[0][first]
    return joint


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.8, top_k=4),
                                      dict(temperature=1.2, top_p=0.85)],
                         ids=["t1", "t0.8-k4", "t1.2-p0.85"])
def test_fused_sampled_walk_has_plain_sampling_distribution(sampling):
    """The first two emitted tokens of 240,000 walks against their exact distribution
    under plain sampling (a chi-square test over the joint); a walk whose random
    numbers favour acceptance by 1 % of the mass (uniforms scaled by 0.99) must fail the
    same test, so it can catch an error of that size."""
    vocab, batch, rounds = 6, 40_000, 6
    tree = _Chain3Tree.tree(batch)
    g = torch.Generator().manual_seed(7)
    base = torch.randn(7, vocab, generator=g) * 1.2  # one logits row per tree row
    logits = base.repeat(batch, 1)
    exact = _exact_first_two(base, sampling)
    rows = tree.tokens.shape[1]
    buffers = fused.StepBuffers.allocate(fused.TreeRecipe(
        budget=rows - 1, top_k=0, max_depth=0, checkpoint_steps=(), thresholds=torch.empty(0),
        keep_by_stage=torch.empty(0, dtype=torch.long), draft_capacity=0,
        retrieval_keep=torch.empty(0, dtype=torch.long),
        template_parents=torch.empty(0, dtype=torch.long),
        template_ranks=torch.empty(0, dtype=torch.long), template_scores=torch.empty(0),
        replace_below=0.0, replace_keep=0, spare=False, fixed_shape=False,
        vocab_size=vocab, successor_k=2, levels=3), batch, "cpu")
    buffers.tree_parents.copy_(tree.parents)
    buffers.tree_valid.copy_(tree.valid)
    buffers.tree_source.copy_(tree.source)
    buffers.tree_tokens.copy_(tree.tokens)
    buffers.learn_rows.fill_(-1)
    tensors = fused.SamplingTensors.of(SamplingBatch(
        temperature=torch.full((batch,), sampling["temperature"]),
        top_k=torch.full((batch,), sampling.get("top_k", 0)),
        top_p=torch.full((batch,), sampling.get("top_p", 1.0))))
    table = torch.full((vocab, 2), -1, dtype=torch.int32)

    def counts(bias: float) -> torch.Tensor:
        torch.manual_seed(11)
        joint = torch.zeros(vocab, vocab + 1, dtype=torch.float64)
        for _ in range(rounds):
            torch.rand(buffers.uniforms.shape, out=buffers.uniforms)
            buffers.uniforms.mul_(bias)
            top = torch.zeros(batch * rows, 2, dtype=torch.long)
            from vllm_graft import ops
            ops.graft_accept_sampled(logits, buffers.row_index, buffers.tree_tokens,
                                     buffers.tree_parents, buffers.tree_valid,
                                     buffers.tree_source, tensors.temperature, tensors.top_k,
                                     tensors.top_p, buffers.uniforms, top, buffers.learn_rows,
                                     vocab, table, fused._accept_out(buffers))
            out = buffers.output_tokens
            second = torch.where(out[:, 1] >= 0, out[:, 1], vocab)
            joint.view(-1).index_add_(0, out[:, 0] * (vocab + 1) + second,
                                      torch.ones(batch, dtype=torch.float64))
        return joint

    honest = chi_square_pvalue(counts(1.0).view(-1), exact.view(-1))
    biased = chi_square_pvalue(counts(0.99).view(-1), exact.view(-1))
    assert honest > 1e-4, honest
    assert biased < 1e-6, biased


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_a_fused_step_is_a_dozen_ops_and_one_read_of_the_device(batch):
    """The dispatch count of :func:`bench_core.graft_step` (the drafter's own lookups
    excluded): at most 16 ops greedy and 24 sampled, one host read, the same at every
    batch size (the pure-torch step dispatched 294 to 528 ops with 6 to 25 reads)."""
    cfg = GraftConfig(budget=60)
    greedy = bench_core.count_step(batch, 4096, cfg, sampled=False)
    sampled = bench_core.count_step(batch, 4096, cfg, sampled=True)
    assert greedy["ops"] <= 16 and greedy["host_reads"] == 1, greedy
    assert sampled["ops"] <= 24 and sampled["host_reads"] == 1, sampled
    assert greedy["by_name"]["graft_draft_step"] == cfg.max_depth
    assert (greedy["ops"], sampled["ops"]) == (cfg.max_depth + 4, cfg.max_depth + 5), \
        (greedy["by_name"], sampled["by_name"])


def test_the_packed_result_holds_what_the_host_needs():
    """One copy to the host carries the trees (draft tokens, node counts), the accepted
    paths and their sources, and the build statistics."""
    batch, vocab = 3, 500
    cfg = GraftConfig(budget=60)
    builder, drafter, roots = bench_core.build_inputs(batch, vocab, "compiled", cfg, "cpu",
                                                      fused_ops=True)
    logits = bench_core.step_logits(builder, drafter, roots, vocab)
    host = bench_core.graft_step(builder, drafter, roots, logits)
    buffers = builder.fused.buffers.view(batch)
    for name in ("stage", "steps", "num_nodes", "stats", "num_accepted", "accepted_sources",
                 "tree_tokens", "output_tokens", "accepted_rows"):
        column = host[:, buffers.columns[name]]
        assert torch.equal(column.squeeze(1) if column.shape[1] == 1 and
                           getattr(buffers, name).dim() == 1 else column,
                           getattr(buffers, name)), name
