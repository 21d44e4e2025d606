"""Cost-aware tree size on synthetic curves and on the H200 profile the GPU check
measured: the chooser verifies about a full tree at batch 1 on a GPU-like curve and
fewer nodes per request as the batch grows; its choice is always a set of subtrees."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_graft.core.acceptance import SamplingBatch, accept_tree
from vllm_graft.core.budget import (SOURCE_NAMES, AcceptanceModel, CostModel, TreeSizer,
                                    ThroughputGuard, choose_nodes, path_probability)
from vllm_graft.core.budget.scout import fired_step_gained
from vllm_graft.core.config import StepMode
from vllm_graft.core.hybrid import (SOURCE_BOTH, SOURCE_CONTEXT, SOURCE_DRAFT, SOURCE_RETRIEVED,
                                    HybridTree, trim_tree)

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


def test_past_its_last_point_a_curve_grows_at_least_at_its_mean_slope():
    """A last segment that noise flattened (pooled flat with its neighbour) would price
    every larger step as the last point: the sizer, at a large batch, would then fill
    every tree. Past the last point the curve grows at its mean slope at least, and at
    its last slope where that is steeper."""
    flat_end = CostModel(curves={1: ([1.0, 128.0, 256.0], [10.0, 20.0, 19.0])})
    assert flat_end.curves[1][1] == [10.0, 19.5, 19.5]  # pooled: flat past 128
    mean_slope = 9.5 / 255.0
    for tokens in (512.0, 2048.0):
        expected = 19.5 + (tokens - 256.0) * mean_slope
        assert float(flat_end.verify_ms(1, torch.tensor(tokens))) == pytest.approx(expected)
    steep_end = CostModel(curves={1: ([1.0, 128.0, 256.0], [10.0, 10.0, 30.0])})
    assert float(steep_end.verify_ms(1, torch.tensor(512.0))) == pytest.approx(70.0)
    # the sizer no longer takes the flat end for free nodes: at batch 64 it verifies
    # part of each tree, where it took all 64 x 60 nodes (3,904 query tokens at 19.5 ms)
    _, _, valid, prob = bushy_tree(64, 60)
    chosen = int(choose_nodes(prob, valid, flat_end).nodes_per_request.sum())
    assert 0 < chosen < 64 * 30, chosen


@pytest.mark.parametrize("text, complaint", [
    ('{"curves": null}', "no 'curves' object"),
    ("[]", "no 'curves' object"),
    ("[" * 100_000 + "]" * 100_000, "cost profile"),  # nested past the parser's depth
    ('{"curves": {"1": {"tokens": [1, 2], "ms": [NaN, 2]}}}', "finite and > 0"),
    ('{"curves": {"1": {"tokens": [1, 2], "ms": [0, 0]}}}', "finite and > 0"),
    ('{"curves": {"1": {"tokens": [1, 2], "ms": [-3, 2]}}}', "finite and > 0"),
    ('{"curves": {"1": {"tokens": [1, 2], "ms": [1, Infinity]}}}', "finite and > 0"),
    ('{"curves": {"0": {"tokens": [1, 2], "ms": [1, 2]}}}', "batch sizes start at 1"),
    ('{"curves": {"1": {"tokens": [1, 2], "ms": [1, 2]}}, "frozen": "false"}', "'frozen'"),
    ('{"curves": {"1": {"tokens": [1, 2], "ms": [1, 2]}}, "per_node_ms": NaN}',
     "per_node_ms"),
    ('{"curves": {"1": {"tokens": [1, 2], "ms": [1, 2]}}, "key": ["m"]}', "'key'"),
])
def test_a_bad_cost_profile_file_is_refused_naming_it(tmp_path, text, complaint):
    """Whatever a cached profile holds (written by another version, edited, cut short),
    loading it raises ValueError naming the file, which start-up takes as "measure
    again"; nothing loads that would price a step at nothing or never learn."""
    path = tmp_path / "profile.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=complaint) as error:
        CostModel.load(path)
    assert str(path) in str(error.value)


def test_a_saved_profile_replaces_the_file_whole(tmp_path):
    """Engines starting together each write their profile: each write replaces the file
    with a whole one (a renamed temporary), so a reader never sees half of one. Written
    in place, a reader beside 300 writes found the file empty or cut short in about a
    third of its reads."""
    import threading
    import time

    path = tmp_path / "profile.json"
    path.write_text("{not json")
    tokens = [float(n) for n in range(1, 400)]
    cost = CostModel(curves={1: (tokens, tokens)}, key={"model": "m"})
    cost.save(path)
    written = threading.Event()

    def write():
        for _ in range(300):
            cost.save(path)
        written.set()
    writer = threading.Thread(target=write)
    writer.start()
    reads, torn = 0, 0
    while not written.is_set():
        try:
            assert CostModel.load(path).curves == cost.curves
        except ValueError:
            torn += 1
        reads += 1
        time.sleep(0)  # let the writer run
    writer.join()
    assert reads > 0 and torn == 0, (reads, torn)
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]
    # readable as any file the process writes (a cache directory may be shared)
    probe = tmp_path / "probe"
    probe.write_text("")
    assert path.stat().st_mode & 0o777 == probe.stat().st_mode & 0o777


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


def test_every_node_is_counted_in_the_class_of_its_source_depth_and_score():
    """The flat class index lays out (source class, depth, score bucket) as the counts'
    dimensions: a copied node is ``context`` whatever else proposed it, depths past the
    model's last share it, and each observation lands in its own cell."""
    model = AcceptanceModel(max_depth=3, score_buckets=4)
    tags = [SOURCE_DRAFT, SOURCE_RETRIEVED, SOURCE_DRAFT | SOURCE_RETRIEVED,
            SOURCE_CONTEXT, SOURCE_CONTEXT | SOURCE_DRAFT, SOURCE_CONTEXT | SOURCE_BOTH]
    classes = ["draft", "retrieved", "both", "context", "context", "context"]
    depths = [1, 2, 3, 4, 9, 1]
    scores = [0.0, 0.3, 0.5, 1.0, 0.26, 0.74]
    source = torch.tensor(tags, dtype=torch.uint8)
    flat = model._bucket(source, torch.tensor(depths), torch.tensor(scores))
    assert [np.unravel_index(i, tuple(model.trials.shape)) for i in flat] == [
        (SOURCE_NAMES.index(c), min(d, 3) - 1, b)
        for c, d, b in zip(classes, depths, [0, 1, 2, 3, 1, 2])]
    before = model.trials.clone()
    model.observe(source, torch.tensor(depths), torch.tensor(scores),
                  torch.ones(len(tags), dtype=torch.bool), torch.zeros(len(tags)))
    assert (model.trials - before).sum() == len(tags)
    assert (model.trials - before).view(-1)[torch.from_numpy(flat)].tolist() == [1.0] * 6


def _tally(**sources):
    """An acceptance tally of 4 score buckets; ``sources``: name -> (trials, accepts) per
    depth, each a list per bucket."""
    from vllm_graft.core.calibration import AcceptanceTally, SourceAcceptance

    return AcceptanceTally(score_buckets=4, sources={
        name: SourceAcceptance(trials=trials, accepts=accepts)
        for name, (trials, accepts) in sources.items()})


def test_a_calibrations_measured_rates_seed_the_model_as_capped_evidence():
    model = AcceptanceModel(max_depth=4)
    model.seed(_tally(draft=([[0, 0, 0, 1000], [0, 0, 0, 10]], [[0, 0, 0, 900], [0, 0, 0, 1]]),
                      context=([[0] * 4, [0] * 4, [8, 0, 0, 0]], [[0] * 4, [0] * 4, [8, 0, 0, 0]])))

    def rate(source, depth, score):
        return model.conditional(torch.tensor([source]), torch.tensor([depth]),
                                 torch.tensor([score])).item()
    # 1000 trials count as 32 beside the prior of 1 in 4; 10 trials as 10
    assert rate(SOURCE_DRAFT, 1, 0.9) == pytest.approx((1 + 32 * 0.9) / (4 + 32))
    assert rate(SOURCE_DRAFT, 2, 0.9) == pytest.approx((1 + 1) / (4 + 10))
    assert rate(SOURCE_CONTEXT, 3, 0.1) == pytest.approx((1 + 8) / (4 + 8))
    # what was not measured stays at the prior: other buckets, sources and depths
    assert rate(SOURCE_DRAFT, 1, 0.1) == rate(SOURCE_RETRIEVED, 1, 0.9) == pytest.approx(0.25)
    # serving's own trials soon outweigh the calibration's
    n = 200
    model.observe(torch.full((n,), SOURCE_DRAFT), torch.ones(n, dtype=torch.long),
                  torch.full((n,), 0.9), torch.ones(n, dtype=torch.bool),
                  torch.arange(n) < 40)
    assert rate(SOURCE_DRAFT, 1, 0.9) < 0.35
    with pytest.raises(ValueError, match="acceptance.score_buckets"):
        AcceptanceModel(score_buckets=2).seed(_tally())


def test_what_a_model_learned_is_a_tally_that_seeds_another_model():
    """:meth:`AcceptanceModel.learned` gives the counts beyond the prior per source,
    depth and score bucket (a calibration's ``chain_acceptance``); seeding a fresh model
    with it gives each class the learned rate, weighing at most the calibration cap."""
    from vllm_graft.core.budget import CALIBRATION_EVIDENCE_TRIALS

    learner = AcceptanceModel()
    assert learner.learned().sources == {}
    # 50 copy chains, a copied node then a walked one: 43 copied nodes accepted, so 43
    # walked nodes tried, 1 of them accepted
    accepted = [2] + [1] * 42 + [0] * 7
    learner.observe_chains([([SOURCE_CONTEXT, SOURCE_RETRIEVED], [0.9, -1.0], count, 0)
                            for count in accepted])
    tally = learner.learned()
    assert set(tally.sources) == {"context", "retrieved"}
    copied, walked = tally.sources["context"], tally.sources["retrieved"]
    assert sum(copied.trials[0]) == 50 and sum(copied.accepts[0]) == 43
    assert len(walked.trials) == 2 and sum(walked.trials[0]) == 0
    assert sum(walked.trials[1]) == 43 and sum(walked.accepts[1]) == 1

    def rate(model, source, depth, score):
        return model.conditional(torch.tensor([source]), torch.tensor([depth]),
                                 torch.tensor([score])).item()
    seeded = AcceptanceModel()
    seeded.seed(tally)
    cap = CALIBRATION_EVIDENCE_TRIALS
    assert rate(seeded, SOURCE_CONTEXT, 1, 0.9) == pytest.approx((1 + cap * 43 / 50) / (4 + cap))
    assert rate(seeded, SOURCE_RETRIEVED, 2, -1.0) == pytest.approx((1 + cap / 43) / (4 + cap))
    assert rate(seeded, SOURCE_DRAFT, 1, 0.9) == pytest.approx(0.25)  # never tried
    with pytest.raises(ValueError, match="learned"):
        seeded.learned()  # a seeded model's counts are not whole trials of its own


def test_a_seeded_sizer_keeps_the_nodes_its_calibration_found_likely_from_the_start():
    """A node must be accepted more than half the time to pay for its verification on
    this curve: the cold sizer, at its prior, verifies nothing; seeded by a calibration
    that measured confident drafted children (score >= 0.75) at 0.9 and unsure ones at
    0.01, it keeps the confident child and cuts the unsure one. The copy-chain model is
    not seeded by tree runs."""
    cost = CostModel(curves={1: ([1.0, 101.0], [10.0, 510.0])})
    tree = HybridTree(tokens=torch.tensor([[5, 6, 7]]), parents=torch.tensor([[-1, 0, 0]]),
                      depths=torch.tensor([[0, 1, 1]]), valid=torch.ones(1, 3, dtype=torch.bool),
                      source=torch.tensor([[0, SOURCE_DRAFT, SOURCE_DRAFT]], dtype=torch.uint8),
                      num_nodes=torch.tensor([3]), score=torch.tensor([[0.0, 0.8, 0.1]]))
    assert TreeSizer(cost).choose(tree).keep.tolist() == [[True, False, False]]
    seeded = AcceptanceModel()
    seeded.seed(_tally(draft=([[1000, 0, 0, 1000]], [[10, 0, 0, 900]])))
    sizer = TreeSizer(cost, seeded)
    assert sizer.choose(tree).keep.tolist() == [[True, True, False]]
    assert torch.equal(sizer.chain_acceptance.trials, AcceptanceModel().trials)


# ---- trimming and learning on hybrid trees ----------------------------------------------
VOCAB = 50


def hybrid_bushy(batch: int, nodes: int, generator: torch.Generator) -> HybridTree:
    """Bushy trees (three children per node) with distinct sibling tokens; even rows
    drafted, odd rows retrieved."""
    parents, depths, valid, _ = bushy_tree(batch, nodes)
    tokens = torch.randint(0, VOCAB, (batch, nodes + 1), generator=generator)
    for i in range(1, nodes + 1):  # siblings distinct: offset by the sibling rank
        tokens[:, i] = (tokens[:, parents[0, i]] * 7 + (i - 1) % 3 + 1) % VOCAB
    source = torch.where(torch.arange(nodes + 1) % 2 == 0, SOURCE_DRAFT, SOURCE_RETRIEVED)
    source = source.to(torch.uint8).expand(batch, -1).clone()
    source[:, 0] = 0
    return HybridTree(tokens=tokens, parents=parents, depths=depths, valid=valid,
                      source=source, num_nodes=valid.sum(1))


def sibling_score(tree: HybridTree) -> torch.Tensor:
    """1 / (1 + sibling rank): what the builder knows of a node's order among siblings."""
    rank = (torch.arange(tree.tokens.shape[1]) - 1) % 3
    return (1.0 / (1.0 + rank.double())).expand(tree.tokens.shape[0], -1)


def greedy_logits(tree: HybridTree, successor: torch.Tensor) -> torch.Tensor:
    """A deterministic target: after token t it always says successor[t]."""
    return torch.nn.functional.one_hot(successor[tree.tokens.clamp(min=0)], VOCAB).double()


def test_trimmed_tree_is_valid_and_accepts_a_prefix_of_the_full_walk():
    generator = torch.Generator().manual_seed(8)
    tree = hybrid_bushy(4, 30, generator)
    # a target that follows the first child twice, then disagrees
    successor = torch.randint(0, VOCAB, (VOCAB,), generator=generator)
    keep = torch.zeros_like(tree.valid)
    keep[:, :8] = True  # rows 0..7: a parents-first prefix is closed under parents
    keep[1, 20] = True  # and a deep row of request 1 with its ancestors
    row = 20
    while row > 0:
        keep[1, row] = True
        row = int(tree.parents[1, row])
    trimmed = trim_tree(tree, keep)
    assert trimmed.tokens.shape == tree.tokens.shape
    assert trimmed.num_nodes.tolist() == keep.sum(1).tolist()
    for b in range(4):
        n = int(trimmed.num_nodes[b])
        kept_tokens = tree.tokens[b][keep[b]]
        assert trimmed.tokens[b, :n].tolist() == kept_tokens.tolist()
        assert (trimmed.parents[b, 1:n] < torch.arange(1, n)).all()  # parents first
    full = accept_tree(tree, greedy_logits(tree, successor), SamplingBatch.greedy(4))
    cut = accept_tree(trimmed, greedy_logits(trimmed, successor), SamplingBatch.greedy(4))
    for b in range(4):
        n = int(cut.num_accepted[b])
        assert n <= int(full.num_accepted[b])
        assert cut.output_tokens[b, :n].tolist() == full.output_tokens[b, :n].tolist()


def test_sizer_learns_acceptance_and_cuts_where_nodes_do_not_pay():
    generator = torch.Generator().manual_seed(9)
    cost = CostModel.from_gpu_check(H200_PROFILE, context=1024)
    sizer = TreeSizer(cost)
    truth = {SOURCE_DRAFT: 0.55, SOURCE_RETRIEVED: 0.15}
    for _ in range(60):  # verified steps: accept children with the true odds
        tree = hybrid_bushy(8, 60, generator)
        accepted = torch.full((8, 10), -1, dtype=torch.long)
        for b in range(8):
            node, depth = 0, 0
            while depth < 10:
                children = [c for c in range(1, 61) if int(tree.parents[b, c]) == node]
                taken = next((c for c in children if torch.rand(1, generator=generator)
                              < truth[int(tree.source[b, c])]), None)
                if taken is None:
                    break
                accepted[b, depth], node, depth = taken, taken, depth + 1
        result = type("R", (), {"accepted_rows": accepted})()
        sizer.observe(tree, result, score=sibling_score(tree))
    # first-ranked children are tried first, so their learned odds are the true ones:
    # a retrieved one sits at depth 1 (row 1), a drafted one at depth 2 (row 4)
    first = torch.ones(1, dtype=torch.float64)
    for source, depth in ((SOURCE_RETRIEVED, 1), (SOURCE_DRAFT, 2)):
        got = float(sizer.acceptance.conditional(torch.tensor([source]),
                                                 torch.tensor([depth]), first)[0])
        assert abs(got - truth[source]) < 0.08, (source, got, truth[source])
    small_tree, large_tree = hybrid_bushy(1, 60, generator), hybrid_bushy(32, 60, generator)
    small = sizer.choose(small_tree, sibling_score(small_tree)).nodes_per_request.double()
    large = sizer.choose(large_tree, sibling_score(large_tree)).nodes_per_request.double()
    assert 0 < large.mean() < small.mean()
    trimmed, choice = sizer.trim(large_tree, sibling_score(large_tree))
    assert trimmed.num_nodes.tolist() == (choice.nodes_per_request + 1).tolist()


def test_frozen_profile_ignores_measurements():
    frozen = CostModel(curves={1: ([1.0, 2.0], [10.0, 11.0])}, overhead_ms=3.0,
                       per_node_ms=0.5, frozen=True)
    frozen.observe(1, 1, 50.0)
    for nodes in range(1, 20):
        frozen.observe_step(StepMode.TREE, 1, nodes, 100.0 + 10 * nodes, 10.0)
    assert frozen.curves[1][1] == [10.0, 11.0]
    assert frozen.other_costs(1, StepMode.TREE) == (0.0, 3.0, 0.5)


def test_step_costs_learn_each_modes_fixed_and_per_node_cost_from_whole_steps():
    """Whole steps less their forwards are points (nodes, ms) of a line per mode: the
    fixed part per batch bucket (drafting grows with the batch), the part per node
    shared by the buckets, plain decoding's own fixed part too; noisy steps and a stall
    of the host do not move them far."""
    generator = torch.Generator().manual_seed(0)
    cost = CostModel(curves={1: ([1.0, 64.0], [10.0, 10.0])}, overhead_ms=1.0)
    truth = {StepMode.TREE: ({1: 20.0, 8: 45.0}, 1.5), StepMode.CHAIN: ({1: 6.0, 8: 9.0}, 0.8)}
    plain = {1: 4.0, 8: 7.0}
    for step in range(600):
        batch = (1, 8)[step % 2]
        nodes = int(torch.randint(1, 4 * batch + 8, (1,), generator=generator))
        noise = float(torch.randn(1, generator=generator)) * 2.0
        for mode, (fixed, per_node) in truth.items():
            cost.observe_step(mode, batch, nodes, 30.0 + fixed[batch] + per_node * nodes
                              + noise, forward_ms=30.0)
        cost.observe_step(StepMode.PLAIN, batch, 0, 30.0 + plain[batch] + noise, 30.0)
    cost.observe_step(StepMode.TREE, 1, 3, 5000.0, 30.0)  # the host stalled
    for mode, (fixed, per_node) in truth.items():
        for batch in (1, 8):
            got_plain, got_fixed, got_per_node = cost.other_costs(batch, mode)
            assert got_plain == pytest.approx(plain[batch], abs=0.5)
            assert got_fixed == pytest.approx(fixed[batch], abs=2.5 if mode is StepMode.TREE
                                              and batch == 1 else 1.5), (mode, batch)
            assert got_per_node == pytest.approx(per_node, abs=0.15), mode
    # a batch size between buckets uses the nearest measured one
    assert cost.other_costs(6, StepMode.CHAIN)[1] == pytest.approx(9.0, abs=1.5)
    # plain decoding not among the modes: verifying nothing saves nothing of a chain's cost
    chains_only = CostModel(curves={1: ([1.0, 64.0], [10.0, 10.0])})
    for nodes in range(1, 30):
        chains_only.observe_step(StepMode.CHAIN, 1, nodes % 5, 30.0 + nodes % 5, 10.0)
    plain_ms, fixed_ms, _ = chains_only.other_costs(1, StepMode.CHAIN)
    assert plain_ms == fixed_ms == pytest.approx(20.0, abs=1.5)
    # steps of one size only: the slope stays near its prior instead of swinging
    even = CostModel(curves={1: ([1.0, 64.0], [10.0, 10.0])}, per_node_ms=0.3)
    for _ in range(3):
        even.observe_step(StepMode.TREE, 1, 4, 40.0, 10.0)
    assert even.other_costs(1, StepMode.TREE)[2] == pytest.approx(0.3)


def test_the_sizer_verifies_fewer_nodes_once_it_has_learned_their_cost():
    """On a curve that is flat in query tokens the forward alone makes every likely node
    free; a per-node cost measured from whole steps makes the sizer cut the tree, and
    a tree step's fixed cost is paid only by steps that verify a node."""
    cost = CostModel(curves={1: ([1.0, 64.0], [20.0, 20.0])})
    parents, _, valid, prob = bushy_tree(1, 60)
    before = int(choose_nodes(prob, valid, cost).nodes_per_request[0])
    for step in range(200):
        nodes = 1 + step % 12
        cost.observe_step(StepMode.TREE, 1, nodes, 20.0 + 5.0 + 3.0 * nodes, 20.0)
        cost.observe_step(StepMode.PLAIN, 1, 0, 22.0, 20.0)
    after = int(choose_nodes(prob, valid, cost).nodes_per_request[0])
    assert 0 < after < before
    step_ms = cost.step_ms(1, torch.tensor([0, 1, 10]))
    assert step_ms.tolist() == pytest.approx([22.0, 28.0, 55.0], abs=0.5)


def test_acceptance_model_learns_context_copies_as_their_own_source():
    """A copied node is its own class, whatever else proposed it: its odds are learned
    apart from drafted and retrieved nodes of the same depth."""
    from vllm_graft.core.budget import SOURCE_NAMES, AcceptanceModel
    from vllm_graft.core.hybrid import SOURCE_CONTEXT, SOURCE_DRAFT, SOURCE_RETRIEVED

    model = AcceptanceModel(prior_accepts=1.0, prior_trials=2.0)
    copied = torch.tensor([SOURCE_CONTEXT, SOURCE_CONTEXT | SOURCE_DRAFT,
                           SOURCE_CONTEXT | SOURCE_RETRIEVED] * 10)
    depth = torch.ones_like(copied)
    score = torch.full(copied.shape, 0.5)
    model.observe(copied, depth, score, torch.ones_like(copied, dtype=torch.bool),
                  torch.ones_like(copied, dtype=torch.bool))
    drafted = torch.tensor([SOURCE_DRAFT])
    assert float(model.conditional(copied[:1], depth[:1], score[:1])) == 31 / 32
    assert float(model.conditional(drafted, depth[:1], score[:1])) == 0.5
    assert model.accepts.shape[0] == len(SOURCE_NAMES) == 4


def run_guard(rates: dict, steps: int = 640, batch: int = 4, yields=None, seed: int = 0,
              guard=None, **kwargs):
    """Drive a guard whose modes take ``batch / rates[mode]`` seconds per step and emit
    ``batch`` tokens, or ``yields[mode](rng)`` tokens where given; returns the modes
    chosen, the guard and the tokens per second achieved."""
    import random

    from vllm_graft.core.budget import ThroughputGuard

    rng = random.Random(seed)
    guard = guard or ThroughputGuard(modes=tuple(rates), **kwargs)
    modes, tokens, seconds = [], 0, 0.0
    for _ in range(steps):
        mode = guard.choose(batch)
        modes.append(mode)
        emitted = yields[mode](rng) if yields and mode in yields else batch
        spent = batch / rates[mode]
        guard.observe(mode, batch, tokens=emitted, seconds=spent)
        tokens, seconds = tokens + emitted, seconds + spent
    return modes, guard, tokens / seconds


def test_throughput_guard_runs_the_measured_faster_mode_and_keeps_checking():
    from vllm_graft.core.config import StepMode

    tree, plain = StepMode.TREE, StepMode.PLAIN
    modes, guard, _ = run_guard({tree: 50.0, plain: 100.0}, steps=2000)
    assert guard.preferred(4) is plain
    assert modes[:2] == [tree, plain]  # every mode measured first
    # afterwards trees run only now and then, to check they did not become faster
    assert 0 < modes[8:].count(tree) < 0.03 * len(modes), modes.count(tree)
    assert tree in modes[1000:]
    modes, guard, _ = run_guard({tree: 150.0, plain: 100.0}, steps=2000)
    assert guard.preferred(3) is tree  # 3 and 4 share a bucket
    # plain decoding only to keep its rate fresh: one step in plain_refresh + 1
    assert modes.count(plain) <= len(modes) / (guard.plain_refresh + 1) + 3
    modes, guard, _ = run_guard({tree: 150.0, plain: 100.0}, steps=2000, plain_refresh=0)
    assert modes.count(plain) < 0.03 * len(modes)


@pytest.mark.parametrize("seed", [0, 1])  # seeds whose noise let chains win the probes
def test_a_stale_slow_plain_rate_does_not_keep_a_slower_mode_running(seed):
    """The first steps of a fresh engine run cold (here at 0.6 of their later speed),
    and those are the steps in which every mode is first measured. Chains are really
    13 % slower than plain decoding; once warm they look faster than the cold plain
    rate. The guard measures plain again every ``plain_refresh`` steps and goes back to
    it after a few; without that it ran the slower chains for most of the next 180.
    (Batch 32, uncharged: the batch charge also keeps a slower mode away.)"""
    import random

    from vllm_graft.core.budget import ThroughputGuard
    from vllm_graft.core.config import StepMode

    tree, chain, plain = StepMode.TREE, StepMode.CHAIN, StepMode.PLAIN

    def run(**kwargs) -> list[StepMode]:
        rng, guard, modes = random.Random(seed), ThroughputGuard(
            modes=(tree, chain, plain), batch_charge=0.0, **kwargs), []
        for step in range(200):
            mode = guard.choose(32)
            speed = (0.6 if step < 4 else 1.0) * rng.uniform(0.9, 1.1)
            rate = {tree: 0.3, chain: 0.87, plain: 1.0}[mode] * speed * 6400.0
            guard.observe(mode, 32, tokens=32, seconds=32 / rate)
            modes.append(mode)
        return modes

    assert run()[20:].count(chain) < 40
    # what the stale rate did (without the probe gate, which also keeps chains away)
    assert run(plain_refresh=0, probe_share=None)[20:].count(chain) > 90


def test_a_mode_is_within_reach_until_measured_well_below_the_fastest():
    from vllm_graft.core.budget import ThroughputGuard
    from vllm_graft.core.config import StepMode

    tree, chain, plain = StepMode.TREE, StepMode.CHAIN, StepMode.PLAIN
    guard = ThroughputGuard(modes=(tree, chain, plain))
    assert guard.within_reach(8, tree)  # nothing measured yet
    for _ in range(20):
        guard.observe(plain, 8, tokens=8, seconds=0.1)  # 80 tokens/s
        guard.observe(tree, 8, tokens=4, seconds=0.1)  # 40
    # well below plain decoding: chains, not measured at batch 8 yet, change nothing
    assert not guard.within_reach(8, tree)
    for _ in range(20):
        guard.observe(chain, 8, tokens=10, seconds=0.1)  # 100
    assert not guard.within_reach(8, tree)  # well below the fastest
    assert guard.within_reach(8, chain) and guard.within_reach(8, plain)
    guard.steps += 30  # trees' next probe (a loss of 0.6 steps) due within the window
    assert guard.within_reach(8, tree, share=0.4)
    # a batch size not measured is judged by a neighbour (half or twice) that was
    assert not guard.within_reach(16, tree) and not guard.within_reach(4, tree)
    assert guard.within_reach(32, tree) and guard.within_reach(1, tree)  # none measured
    for _ in range(20):  # measured at 16 itself: trees as fast as the rest there
        for mode in (tree, chain, plain):
            guard.observe(mode, 16, tokens=16, seconds=0.1)
    assert guard.within_reach(16, tree) and guard.within_reach(32, tree)
    assert not ThroughputGuard(modes=(chain, plain)).within_reach(1, tree)
    # while trees do not run their measurements fade, and they come within reach
    # again: their bound widens until they are worth another look
    for _ in range(300):
        assert guard.choose(8, unavailable=(tree,)) is not tree
    assert not guard.within_reach(8, tree)  # at 0.4 of the fastest, looked at rarely
    for _ in range(500):
        guard.choose(8, unavailable=(tree,))
    assert guard.within_reach(8, tree)


def test_a_mode_is_not_within_reach_while_its_next_probe_is_far_away():
    """Batch 8 on this repository's CPU: a tree step takes five plain steps at 0.3 of
    plain decoding's rate (charged 10 % at several requests: 5.5 and 0.27), so the probe
    rule runs trees again only 800 steps after the last (a probe loses 4 plain steps,
    at most 0.5 % of the steps). Their record fades meanwhile and their bound reaches
    0.8 of plain's rate within about 350 steps; the drafter would then follow every
    request for some 450 steps in which no tree runs. In reach only once the probe is
    due within ``window`` steps."""
    from vllm_graft.core.budget import ThroughputGuard
    from vllm_graft.core.config import StepMode

    tree, plain = StepMode.TREE, StepMode.PLAIN
    guard = ThroughputGuard(modes=(tree, plain), plain_refresh=0)
    modes, reach, bound_reached = [], [], None
    for step in range(900):
        mode = guard.choose(8)
        modes.append(mode)
        guard.observe(mode, 8, tokens=12 if mode is tree else 8,
                      seconds=0.5 if mode is tree else 0.1)  # 24 and 80 tokens/s
        reach.append(guard.within_reach(8, tree))
        if bound_reached is None and guard.bound_of(8, tree) >= 0.8 * 80:
            bound_reached = step
    probe = modes.index(tree, 1)  # the first tree step after the first probe
    assert reach[0]  # plain decoding not measured yet: nothing to compare with
    first = reach.index(True, 1)
    assert 780 <= probe <= 820, probe
    assert probe - 110 <= first <= probe - 90, (first, probe)  # a window before it
    assert not any(reach[1:first]) and all(reach[first:probe])
    assert bound_reached < first - 300  # where the bound alone put trees in reach


def test_a_charge_slows_a_modes_record_without_running_it():
    """Time spent outside a mode's steps for it lowers its rate and prices its next
    probe higher; its steps, tokens and the step it last ran stay, and the charge fades
    with the record as if it had been a step's time."""
    from vllm_graft.core.budget import ThroughputGuard
    from vllm_graft.core.config import StepMode

    tree, plain = StepMode.TREE, StepMode.PLAIN
    guard = ThroughputGuard(modes=(tree, plain))
    guard.charge(tree, 32, 1.0)  # nothing measured there yet: nothing to charge
    assert guard.rate_of(32, tree) is None
    guard.observe(tree, 32, tokens=40, seconds=0.5)
    guard.observe(plain, 32, tokens=32, seconds=0.125)
    for _ in range(50):
        guard.choose(32, unavailable=(tree,))
        guard.observe(plain, 32, tokens=32, seconds=0.125)
    before = guard._stats(32, tree)
    loss = guard._probe_loss(32, tree, plain)
    guard.charge(tree, 32, 0.25)
    guard.charge(tree, 32, 0.0)
    guard.charge(tree, 32, -1.0)
    after = guard._stats(32, tree)
    assert after.seconds == pytest.approx(before.seconds + 0.25)
    assert (after.weight, after.tokens, after.tokens_sq) == \
        (before.weight, before.tokens, before.tokens_sq)
    assert guard.stats[(32, tree)].step == 0  # when trees last ran: the probe clock
    assert guard.rate_of(32, tree) == pytest.approx(before.tokens / (before.seconds + 0.25))
    assert guard._probe_loss(32, tree, plain) > 1.4 * loss
    guard.steps += 30
    keep = (1 - 1 / guard.window) ** 30
    assert guard._stats(32, tree).seconds == pytest.approx((before.seconds + 0.25) * keep)


def test_what_following_a_batch_for_trees_costs_is_charged_to_trees():
    """Batch 32 on this repository's CPU (SmolLM2-135M): a tree step takes four plain
    steps for 1.3 plain steps' tokens, and each batch the drafter follows (for a tree
    probe due within ``window`` steps) costs a quarter of a second of catch-up outside
    tree steps: reading its prompts, keeping its rows. Counted in the steps where it
    fell, that time was no cost of trees: the guard priced a probe at its own step and
    probed every 350 steps or so, following a batch in four, and trees with their
    preparation took 0.9 % of the time. Charged to trees, it takes at most the probe
    rule's 0.5 %."""
    from vllm_graft.core.budget import ThroughputGuard
    from vllm_graft.core.config import StepMode

    tree, plain = StepMode.TREE, StepMode.PLAIN
    plain_s, tree_s, tree_tokens, preparation = 0.134, 0.53, 42, 0.25

    def lost_share(charged: bool) -> tuple[float, int]:
        guard = ThroughputGuard(modes=(tree, plain))
        lost = elapsed = 0.0
        followed = 0
        for _ in range(100):  # batches of 64 steps, all requests new
            follows = guard.within_reach(32, tree)
            pending = 0.0
            if follows:
                followed += 1
                lost, elapsed = lost + preparation, elapsed + preparation
                if charged:
                    guard.charge(tree, 32, preparation)
                else:
                    pending = preparation  # the first step after the prefill paid it
            for _ in range(64):
                mode = guard.choose(32, () if follows else (tree,))
                seconds, tokens = (tree_s, tree_tokens) if mode is tree else (plain_s, 32)
                if mode is tree:
                    lost += tree_s - tokens / 32 * plain_s
                elapsed += seconds
                guard.observe(mode, 32, tokens, seconds + pending)
                pending = 0.0
        return lost / elapsed, followed

    uncharged, followed_uncharged = lost_share(False)
    charged, followed_charged = lost_share(True)
    assert uncharged > 0.008 and followed_uncharged >= 10
    assert charged <= 0.005 and followed_charged < followed_uncharged / 3


def test_an_unavailable_mode_is_neither_probed_nor_chosen():
    from vllm_graft.core.budget import ThroughputGuard
    from vllm_graft.core.config import StepMode

    tree, chain, plain = StepMode.TREE, StepMode.CHAIN, StepMode.PLAIN
    guard = ThroughputGuard(modes=(tree, chain, plain))
    assert guard.choose(4, unavailable=(tree,)) is chain  # probes skip it too
    guard.observe(chain, 4, tokens=4, seconds=0.1)
    assert guard.choose(4, unavailable=(tree,)) is plain
    guard.observe(plain, 4, tokens=4, seconds=0.1)
    assert guard.choose(4) is tree  # available again: measured first
    assert guard.choose(4, unavailable=(tree, chain, plain)) is plain


def chain_yield(extra_mean: float, longest: int = 8):
    """Tokens of one chain step at batch 1: the bonus token plus a geometric number of
    accepted nodes (the shape of real acceptance), mean about ``1 + extra_mean``."""
    accept = extra_mean / (1.0 + extra_mean)

    def draw(rng) -> int:
        accepted = 0
        while accepted < longest and rng.random() < accept:
            accepted += 1
        return 1 + accepted

    return draw


@pytest.mark.parametrize("seed", range(3))
def test_throughput_guard_is_not_fooled_by_the_noise_of_speculative_yields(seed):
    """Chains yield 1.5 tokens a step on average at 1.15x a plain step's time (1.3x
    plain's rate), trees 2 at 3x: step by step, chains often look slower than plain.
    The guard still runs chains nearly always and gets within a few % of the best."""
    from vllm_graft.core.config import StepMode

    tree, chain, plain = StepMode.TREE, StepMode.CHAIN, StepMode.PLAIN
    rates = {tree: 1 / 3.0, chain: 1 / 1.15, plain: 1.0}  # steps per second, batch 1
    modes, guard, achieved = run_guard(
        rates, steps=3000, batch=1, seed=seed,
        yields={tree: chain_yield(1.0), chain: chain_yield(0.5)})
    assert guard.preferred(1) is chain
    assert modes.count(chain) > 0.85 * len(modes)
    best = 1.5 / 1.15
    assert achieved > 0.93 * best, (achieved, best)


@pytest.mark.parametrize("outlier_steps, chains_win", [(3.0, True), (None, False)])
def test_one_stalled_step_does_not_hold_a_faster_mode_down(outlier_steps, chains_win):
    """Copy chains yield 1.4 tokens a step at 1.1x a plain step's time (1.27x plain's
    rate); the twelfth chain step stalls for 20 steps' time (kernels set up for a new
    query length, say). Capped at 3 mean steps it leaves chains the faster mode, and they
    run in nearly every one of the last 200 steps; counted whole it makes chains measure
    slower, and the guard decodes plainly for most of them."""
    from vllm_graft.core.budget import ThroughputGuard
    from vllm_graft.core.config import StepMode

    chain, plain = StepMode.CHAIN, StepMode.PLAIN
    guard = ThroughputGuard(modes=(chain, plain), outlier_steps=outlier_steps)
    modes, chain_steps = [], 0
    for _ in range(300):
        mode = guard.choose(1)
        modes.append(mode)
        if mode is chain:
            chain_steps += 1
            stalled = 20.0 if chain_steps == 12 else 1.0
            guard.observe(chain, 1, tokens=3 if chain_steps % 5 == 0 else 1,  # 1.4 a step
                          seconds=0.011 * stalled)
        else:
            guard.observe(plain, 1, tokens=1, seconds=0.010)
    assert chain_steps >= 12  # the stall happened
    assert (guard.preferred(1) is chain) == chains_win
    share = modes[100:].count(chain) / len(modes[100:])
    assert share > 0.85 if chains_win else share < 0.2, share
    with pytest.raises(ValueError, match="outlier_steps"):
        ThroughputGuard(outlier_steps=1.0)


@pytest.mark.parametrize("credit, rotating, chains_win", [
    ("progress", False, False),  # the same two requests gain every step: the batch not
    ("progress", True, True),  # the gains move among all eight: the batch gains them
    ("median", True, False),  # a step's median request emits one token, rotating or not
    ("sum", False, True),  # summed, 16 tokens look 1.54x plain however they fall
])
def test_a_batch_speculates_where_its_requests_progress(credit, rotating, chains_win):
    """At batch 8 a chain step takes 1.3 plain steps, and two requests emit 5 tokens in
    it while six emit one: the summed 16 tokens are 1.54x plain decoding's rate. Where
    the same two gain every step, the batch waits for the other six: crediting the
    median request's progress, chains measure 0.77x plain and the guard decodes
    plainly. Where the two gaining requests change from step to step, every request
    gains 4 tokens in 4 steps, the median one too, and chains run. The step's median
    request alone (``median``) sees one token either way; the sum sees 16 either way."""
    from vllm_graft.core.budget import ThroughputGuard
    from vllm_graft.core.config import StepMode

    chain, plain = StepMode.CHAIN, StepMode.PLAIN
    guard = ThroughputGuard(modes=(chain, plain), credit=credit)
    ids = [f"r{i}" for i in range(8)]
    modes = []
    for step in range(300):
        mode = guard.choose(8)
        modes.append(mode)
        rows = [1] * 8
        if mode is chain:
            first = 2 * (step % 4) if rotating else 0
            rows[first] = rows[first + 1] = 5
        seconds = 0.013 if mode is chain else 0.010
        guard.observe(mode, 8, guard.credited_tokens(rows, ids), seconds=seconds)
        guard.advance(ids, rows)
    assert (guard.preferred(8) is chain) == chains_win
    share = modes[100:].count(chain) / len(modes[100:])
    assert share > 0.85 if chains_win else share < 0.1, share


def test_the_median_requests_progress_is_credited():
    """``progress`` credits one token a request plus what the step adds to the median
    request's gain since it joined: new requests (or none named) start from none, a
    plain step adds nothing, one request alone is credited its own tokens, and a request
    missing from a step is forgotten."""
    from vllm_graft.core.budget import ThroughputGuard

    guard = ThroughputGuard()
    ids = ["a", "b", "c"]
    assert guard.credited_tokens([4, 1, 1], ids) == 3.0  # the median request gained none
    assert guard.credited_tokens([4, 3, 1]) == 3 * 3.0  # fresh: the step's median, 3
    guard.advance(ids, [4, 1, 1])
    assert guard.gains == {"a": 3.0, "b": 0.0, "c": 0.0}
    # b catches up with a: the median gain moves from 0 to 3
    assert guard.credited_tokens([1, 4, 1], ids) == 3 * (1.0 + 3.0)
    assert guard.credited_tokens([1, 1, 1], ids) == 3.0
    guard.advance(["b", "c", "d"], [4, 1, 1])  # a left, d joined
    assert guard.gains == {"b": 3.0, "c": 0.0, "d": 0.0}
    assert guard.credited_tokens([3]) == 3.0  # one request: its own tokens
    assert guard.credited_tokens([]) == 0.0
    assert ThroughputGuard(credit="median").credited_tokens([4, 3, 1], ids) == 9.0
    assert ThroughputGuard(credit="sum").credited_tokens([4, 3, 1], ids) == 8.0
    with pytest.raises(ValueError, match="credit"):
        ThroughputGuard(credit="mean")


@pytest.mark.parametrize("batch, batch_charge, chains_win", [
    (8, 0.1, False),  # 1.08x plain per step: not enough for a batch to drift apart
    (8, 0.0, True),  # uncharged, the per-step rate decides
    (1, 0.1, True),  # one request does not drift: nothing is charged
])
def test_a_batch_speculates_only_where_it_beats_plain_by_the_charge(batch, batch_charge,
                                                                   chains_win):
    """Every request of a chain step emits 3 tokens in one step of six and 1 in the
    rest (1.33 on average), at 1.23x a plain step's time: 1.08x plain decoding's rate
    per step. At several requests that does not pay for the drift of the batch (class
    doc): charged 10 %, chains measure 0.99x plain, and the guard decodes plainly in
    nearly every one of the last 200 steps. At one request, or with no charge, chains
    are the faster mode; so close to plain, they run in about a third of the steps."""
    from vllm_graft.core.budget import ThroughputGuard
    from vllm_graft.core.config import StepMode

    chain, plain = StepMode.CHAIN, StepMode.PLAIN
    guard = ThroughputGuard(modes=(chain, plain), batch_charge=batch_charge)
    modes, chain_steps = [], 0
    for _ in range(300):
        mode = guard.choose(batch)
        modes.append(mode)
        if mode is chain:
            chain_steps += 1
            emitted = 3 if chain_steps % 6 == 0 else 1
            guard.observe(chain, batch, guard.credited_tokens([emitted] * batch),
                          seconds=0.0123)
        else:
            guard.observe(plain, batch, guard.credited_tokens([1] * batch), seconds=0.010)
    assert (guard.preferred(batch) is chain) == chains_win
    share = modes[100:].count(chain) / len(modes[100:])
    assert share > 0.25 if chains_win else share < 0.05, share
    assert guard.counted_seconds(plain, 8, 0.01) == pytest.approx(0.01)  # never plain
    with pytest.raises(ValueError, match="batch_charge"):
        ThroughputGuard(batch_charge=-0.1)


@pytest.mark.parametrize("text_steps, most_chain_steps", [(2.0, 12), (1e9, None)])
@pytest.mark.parametrize("seed", range(3))
def test_a_new_batch_is_not_held_to_what_chains_measured_on_the_last(seed, text_steps,
                                                                    most_chain_steps):
    """Batch 8, a chain step at 1.25x a plain step's time. The first batch's text
    copies its context (most requests emit two or three tokens a chain step: chains run
    at about 1.4x plain's rate); then eight new requests replace it with text that does
    not (the median request emits one token: 0.73x). With the chains' record of the
    first text counting as ``text_steps`` steps once the batch is new, the guard runs
    chains in at most a dozen of the new batch's 64 steps; kept whole (the record of
    one batch outweighing the next one's evidence) it ran them in more than 50. Text
    that keeps copying keeps its chains either way."""
    import random

    from vllm_graft.core.budget import ThroughputGuard
    from vllm_graft.core.config import StepMode

    chain, plain = StepMode.CHAIN, StepMode.PLAIN

    def run(second_copies: bool) -> int:
        rng = random.Random(seed)
        guard = ThroughputGuard(modes=(chain, plain), text_steps=text_steps)
        chain_steps = 0
        for batch_text in ([1, 2, 2, 3], [1, 2, 2, 3] if second_copies else [1, 1, 1, 2]):
            guard.requests_joined(8, 8)
            chain_steps = 0
            for _ in range(64):
                noise = rng.uniform(0.9, 1.1)
                if guard.choose(8) is chain:
                    chain_steps += 1
                    rows = [rng.choice(batch_text) for _ in range(8)]
                    guard.observe(chain, 8, guard.credited_tokens(rows), 0.0125 * noise)
                else:
                    guard.observe(plain, 8, 8, 0.010 * noise)
        return chain_steps  # the second batch's

    if most_chain_steps is None:
        assert run(second_copies=False) > 50
    else:
        assert run(second_copies=False) <= most_chain_steps
    assert run(second_copies=True) > 56
    with pytest.raises(ValueError, match="text_steps"):
        ThroughputGuard(text_steps=0.5)


def test_requests_joining_shrink_the_records_of_chains_and_plain_decoding_pro_rata():
    """Chains' and plain decoding's records shrink (their rates stay); trees' stays."""
    from vllm_graft.core.budget import ThroughputGuard
    from vllm_graft.core.config import StepMode

    chain, plain, tree = StepMode.CHAIN, StepMode.PLAIN, StepMode.TREE
    guard = ThroughputGuard(modes=(tree, chain, plain), text_steps=2.0)
    for mode in [chain, plain, tree] * 6:
        guard.choose(8)
        guard.observe(mode, 8, tokens={chain: 12, plain: 8, tree: 16}[mode], seconds=0.01)
    tree_record = guard.stats[(8, tree)]
    before = {mode: (guard._stats(8, mode).weight, guard.rate_of(8, mode),
                     guard.stats[(8, mode)].step) for mode in (chain, plain)}
    guard.requests_joined(4, 8)  # half the batch is new: (2 / weight) ** 0.5 of it,
    # geometrically between the weight and two steps'
    for mode, (weight, rate, last) in before.items():
        assert guard._stats(8, mode).weight == pytest.approx(weight * (2.0 / weight) ** 0.5)
        assert guard.stats[(8, mode)].step == last  # no sooner probe, no later decay
        assert guard.rate_of(8, mode) == pytest.approx(rate)
    assert guard.stats[(8, tree)] == tree_record
    guard.requests_joined(0, 8)
    guard.requests_joined(8, 8)  # a whole new batch: two steps' worth
    assert guard._stats(8, chain).weight == pytest.approx(2.0)
    assert guard._stats(8, plain).weight == pytest.approx(2.0)
    guard.requests_joined(8, 8)  # a record of no more than that stays as it is
    assert guard._stats(8, chain).weight == pytest.approx(2.0)
    # a stalled step is capped at three mean steps (of 11 ms: 10 charged 10 %)
    assert guard.counted_seconds(chain, 8, 1.0) == pytest.approx(3 * 0.011)


def test_plain_decoding_is_measured_on_a_new_batch_before_chains_are_compared_with_it():
    """The scout compares chains on the new text with plain decoding's rate: that rate
    must be the new text's. Measured on a 2-core CPU at batch 8 (budget auto in one
    process, SmolLM2-135M): plain steps of document quotes (~600-token prompts) took
    about 90 ms, of the short chat prompts that followed 72; against the quotes' plain
    rate the chains the scout fired on the chat prompts measured faster, and the guard
    ran them in 112 of 124 steps, at 0.92-0.95x plain decoding. Here plain decoding on
    the old text took 0.0125 s a step, on the new one 0.010, and chains on the new one
    0.011 for one token a request: stale, plain measures slower than chains; measured
    again, faster."""
    from vllm_graft.core.budget import ThroughputGuard
    from vllm_graft.core.config import StepMode

    chain, plain = StepMode.CHAIN, StepMode.PLAIN
    guard = ThroughputGuard(modes=(chain, plain))
    for _ in range(100):  # the old text: chains measured once, plain decoding after
        guard.observe(guard.choose(8), 8, tokens=8, seconds=0.0125)
    assert guard.measured[(8, chain)] >= 1
    guard.requests_joined(8, 8, scouted=True)
    assert guard.choose(8) is plain and guard.measuring  # measured again, no scout look
    guard.observe(plain, 8, tokens=8, seconds=0.010)
    assert guard.choose(8) is plain and not guard.measuring
    chain_rate = 8 / guard.counted_seconds(chain, 8, 0.011)
    assert guard.rate_of(8, plain) > chain_rate  # what the scout compares with
    assert 8 / 0.0125 < chain_rate  # what it compared with before


def test_a_scouted_new_batch_runs_chains_once_they_are_measured_on_it_again():
    """Where a chain scout looks at new batches, a batch of several requests at least
    half new drops the chains' record: chains measured faster on the last batch's text
    no longer run on the new one until a chain step (the scout's) measures them there.
    A single request, a minority joining, an unscouted guard or the switch off keep the
    shrunk record, whose rate still beats plain decoding's."""
    from vllm_graft.core.budget import ThroughputGuard
    from vllm_graft.core.budget.guard import STALE_PLAIN_WEIGHT
    from vllm_graft.core.config import StepMode

    chain, plain = StepMode.CHAIN, StepMode.PLAIN

    def measured(batch: int, **fields) -> ThroughputGuard:
        guard = ThroughputGuard(modes=(chain, plain), **fields)
        for mode in [chain, plain] * 6:
            guard.choose(batch)
            guard.observe(mode, batch, tokens=(1.5 if mode is chain else 1.0) * batch,
                          seconds=0.01)
        return guard

    guard = measured(8)
    plain_rate = guard.rate_of(8, plain)
    guard.requests_joined(4, 8, scouted=True)
    assert guard.rate_of(8, chain) is None and guard.rate_of(8, plain) == plain_rate
    assert guard._stats(8, plain).weight == pytest.approx(STALE_PLAIN_WEIGHT)
    for _ in range(40):
        assert guard.choose(8) is plain
        guard.observe(plain, 8, tokens=8, seconds=0.01)
    guard.observe(chain, 8, tokens=12, seconds=0.01)  # the scout's chain step
    assert guard.choose(8) is chain

    kept = [(measured(1), 1, 1, True), (measured(8), 3, 8, True), (measured(8), 8, 8, False),
            (measured(8, scout_new_batches=False), 8, 8, True)]
    for guard, joined, batch, scouted in kept:
        guard.requests_joined(joined, batch, scouted=scouted)
        charge = 1.0 + (guard.batch_charge if batch >= 2 else 0.0)
        assert guard.rate_of(batch, chain) == pytest.approx(1.5 * batch / (0.01 * charge))
        assert guard.choose(batch) is chain


@pytest.mark.parametrize("seed", range(2))
def test_where_plain_decoding_is_fastest_exploring_costs_about_one_percent(seed):
    """Batch 32 on this repository's CPU, as a guard trace measured it: a copy-chain
    step takes 1.9 plain steps and yields about 1.6 tokens a request (0.84 of plain's
    rate), a tree step 4 plain steps for 2 (0.5). The guard keeps re-checking both as
    their measurements fade, each as often as what a probe loses allows
    (``probe_share``): 5 tree and 34-35 chain steps in 2,000, 0.99 of plain decoding's
    speed. Re-checked whenever its bound wins, a slower mode ran 10 tree and 70-76 chain
    steps (0.98). (Uncharged, as the trace measured them; the batch charge makes both
    modes slower still, and the guard runs them less.)"""
    from vllm_graft.core.config import StepMode

    tree, chain, plain = StepMode.TREE, StepMode.CHAIN, StepMode.PLAIN
    batch = 32
    rates = {tree: 1 / 4.0, chain: 1 / 1.9, plain: 1.0}  # steps per second

    def chain_tokens(rng) -> int:
        return batch + round(sum(rng.expovariate(1 / 0.6) for _ in range(batch)))

    def run(**kwargs):
        return run_guard({mode: rate * batch for mode, rate in rates.items()}, steps=2000,
                         batch=batch, seed=seed,
                         yields={tree: lambda rng: 2 * batch, chain: chain_tokens}, **kwargs)

    modes, guard, achieved = run(batch_charge=0.0)
    assert guard.preferred(batch) is plain
    assert modes.count(tree) <= 7 and modes.count(chain) <= 45, \
        (modes.count(tree), modes.count(chain))
    assert achieved > 0.985 * batch, achieved / batch
    _, _, ungated = run(probe_share=None, batch_charge=0.0)
    assert ungated < 0.985 * batch, ungated / batch
    charged_modes, _, charged = run()
    assert charged >= achieved and charged_modes.count(chain) <= modes.count(chain)


def run_scouted(guard, scout, chain_rate: float, predicted_rate: float, steps: int,
                batch: int = 32, chain_step: float = 1.9, tree_rate: float = 1.0,
                tree_step: float = 2.5):
    """Batch-32 steps with a guard and (unless None) a chain scout, as the runner's
    drafting hook runs them: a plain step takes 1 s and emits ``batch`` tokens, a chain
    step ``chain_step`` s at ``chain_rate`` times plain's rate, a tree step (where the
    guard has trees) ``tree_step`` s at ``tree_rate`` times; the sizer predicts chains at
    ``predicted_rate`` times plain's rate. Returns the modes run and the tokens per
    second achieved."""
    from vllm_graft.core.config import StepMode

    modes, tokens, seconds = [], 0.0, 0.0
    rates = {StepMode.CHAIN: chain_rate, StepMode.TREE: tree_rate, StepMode.PLAIN: 1.0}
    spans = {StepMode.CHAIN: chain_step, StepMode.TREE: tree_step, StepMode.PLAIN: 1.0}
    for _ in range(steps):
        mode = guard.choose(batch)
        predicted = predicted_rate * batch * chain_step  # tokens in chain_step seconds
        if (scout is not None and scout.looks_at(guard, mode)
                and scout.promising(predicted, chain_step * 1e3, guard.rate_of(batch, mode))):
            mode = StepMode.CHAIN
        spent = spans[mode]
        emitted = rates[mode] * batch * spent if mode is not StepMode.PLAIN else batch
        guard.observe(mode, batch, tokens=round(emitted), seconds=spent)
        if mode is StepMode.CHAIN and scout is not None:
            scout.observe(predicted, chain_step * 1e3, round(emitted), spent)
        modes.append(mode)
        tokens, seconds = tokens + emitted, seconds + spent
    return modes, tokens / seconds


@pytest.mark.parametrize("scouting", [True, False])
def test_the_chain_scout_finds_copies_where_the_guard_verifies_trees(scouting):
    """Batch 8: a warm-up on chat, where trees run at 1.25x plain's rate and chains at
    0.9x, then copy-heavy requests, where trees (their copied nodes behind the drafter's
    forwards) run at 2x and chains at 3x. The guard prefers trees and decodes plainly
    only to refresh plain's rate (steps it measures, which no look replaces), so a scout
    that looks only at plain steps never sees the copies, and the guard's own chain
    probes wait for the old record; a scout that also looks at tree steps runs chains
    from the first steps (issue 52: on the copy benchmark, Graft verified trees at every
    step and never looked at chains, where prompt lookup's bare chains ran faster)."""
    from vllm_graft.core.budget import ChainScout, ThroughputGuard
    from vllm_graft.core.config import StepMode

    chain, tree, batch = StepMode.CHAIN, StepMode.TREE, 8
    guard = ThroughputGuard(modes=(tree, chain, StepMode.PLAIN))
    scout = ChainScout() if scouting else None
    run_scouted(guard, scout, chain_rate=0.9, predicted_rate=1.2, steps=200, batch=batch,
                chain_step=1.2, tree_rate=1.25, tree_step=2.0)
    assert guard.preferred(batch) is tree
    if scout is not None:
        scout.text_changed(joined=batch, batch=batch)  # the copy requests join
    copies, rate = run_scouted(guard, scout, chain_rate=3.0, predicted_rate=3.0, steps=64,
                               batch=batch, chain_step=1.2, tree_rate=2.0, tree_step=2.0)
    if not scouting:
        assert copies.count(chain) == 0 and rate < 2.1 * batch, (copies, rate / batch)
        return
    assert copies[:2].count(chain) >= 1 and copies.count(chain) >= 56, copies
    assert rate > 2.7 * batch, rate / batch


def test_a_chain_step_is_predicted_as_the_guard_will_credit_it():
    """Four of 32 requests copy (3 tokens each predicted), the others have no chain: the
    requests' sum predicts 40 tokens, 1.25 plain steps' worth, but the guard credits the
    median request's one token times the batch, 32, so the step cannot gain, and a
    scout judging by that credit does not fire. Where 20 of the 32 copy, it does."""
    from vllm_graft.core.budget import ChainScout, Choice, ThroughputGuard
    from vllm_graft.core.config import StepMode

    guard = ThroughputGuard(modes=(StepMode.CHAIN, StepMode.PLAIN))
    plain_rate = 32 / 0.1  # tokens per second: a plain step of 32 requests takes 100 ms

    def copying(requests: int) -> Choice:
        return Choice(keep=None, nodes_per_request=torch.full((requests,), 2),
                      expected_tokens=3.0 * requests, step_ms=110.0,
                      request_tokens=[3.0] * requests)

    few = copying(4)
    assert few.step_tokens(32) == pytest.approx(40.0)
    assert sorted(few.tokens_by_request(32)) == [1.0] * 28 + [3.0] * 4
    assert guard.credited_tokens(few.tokens_by_request(32)) == pytest.approx(32.0)
    assert ChainScout().promising(few.step_tokens(32), few.step_ms, plain_rate)  # the sum
    assert not ChainScout().promising(guard.credited_tokens(few.tokens_by_request(32)),
                                      few.step_ms, plain_rate)
    many = copying(20)
    assert ChainScout().promising(guard.credited_tokens(many.tokens_by_request(32)),
                                  many.step_ms, plain_rate)
    tree_choice = Choice(keep=None, nodes_per_request=torch.tensor([1]), expected_tokens=1.5,
                         step_ms=10.0)
    with pytest.raises(ValueError, match="no tokens per request"):
        tree_choice.tokens_by_request(1)


@pytest.mark.parametrize("scouting", [True, False])
def test_the_chain_scout_finds_text_that_copies_its_context_within_a_short_batch(scouting):
    """Batch 32, as the benchmark runs it: a warm-up on chat (chains at 0.84 of plain's
    rate; the sizer, too optimistic, predicts 1.2), then 64-token code edits, where chains
    run at 1.16x plain (predicted: 1.6x). Content-blind, the guard decodes the whole edit
    batch plainly (its next chain probe is due 60 steps after the warm-up's); the scout
    sees the copies and runs chains within a few steps, its correction (measured over
    predicted, from the warm-up's chain step) already applied."""
    from vllm_graft.core.budget import ChainScout, ThroughputGuard
    from vllm_graft.core.config import StepMode

    chain, batch = StepMode.CHAIN, 32
    guard = ThroughputGuard(modes=(chain, StepMode.PLAIN))
    scout = ChainScout() if scouting else None
    run_scouted(guard, scout, chain_rate=0.84, predicted_rate=1.2, steps=16)
    assert guard.preferred(batch) is StepMode.PLAIN
    if scout is not None:
        scout.text_changed(joined=batch, batch=batch)  # the edit requests join
    edits, rate = run_scouted(guard, scout, chain_rate=1.16, predicted_rate=1.6, steps=64)
    if not scouting:  # the guard alone misses most of the gain
        assert edits[:40].count(chain) == 0 and rate < 1.08 * batch, (edits, rate / batch)
        return
    assert edits[:8].count(chain) >= 1 and edits.count(chain) >= 45, edits.count(chain)
    assert rate > 1.1 * batch, rate / batch
    assert 0.6 < scout.correction() < 0.8  # predictions 1.4x too optimistic, corrected


def test_on_text_chains_do_not_pay_for_the_chain_scout_costs_under_one_percent():
    """2,000 steps of chat at batch 32 (chains 0.84 of plain's rate, predicted 1.2x):
    the first looks fire, their chain steps teach the scout its predictions' correction,
    and it stops firing; the guard's own probes go on as without it."""
    from vllm_graft.core.budget import ChainScout, ThroughputGuard
    from vllm_graft.core.config import StepMode

    chain, batch = StepMode.CHAIN, 32
    runs = {}
    for scout in (ChainScout(), None):
        guard = ThroughputGuard(modes=(chain, StepMode.PLAIN))
        runs[scout is not None] = run_scouted(guard, scout, chain_rate=0.84,
                                              predicted_rate=1.2, steps=2000)
    (scouted, scouted_rate), (alone, alone_rate) = runs[True], runs[False]
    assert scouted.count(chain) <= alone.count(chain) + 10, \
        (scouted.count(chain), alone.count(chain))
    assert scouted_rate > 0.99 * alone_rate and scouted_rate > 0.985 * batch


def test_the_chain_scout_never_replaces_a_plain_refresh():
    """Where chains are the guard's choice, it still decodes one step plainly every
    ``plain_refresh`` steps, to keep the rate chains are compared with current. The scout
    looked at every plain step once chains promised, replaced each refresh with a chain
    step, and so the refresh was asked for again at every step and never ran: plain
    decoding's rate stood from the first steps for the rest of the run (mtbench at batch
    1: 119 of the scout's 120 looks fired)."""
    from vllm_graft.core.budget import ChainScout, ThroughputGuard
    from vllm_graft.core.config import StepMode

    chain, plain, batch = StepMode.CHAIN, StepMode.PLAIN, 32
    guard, scout = ThroughputGuard(modes=(chain, plain)), ChainScout()
    modes, rate = run_scouted(guard, scout, chain_rate=1.3, predicted_rate=1.4, steps=400)
    assert guard.preferred(batch) is chain and rate > 1.25 * batch, rate / batch
    refreshes = [i for i, mode in enumerate(modes) if mode is plain]
    assert len(refreshes) >= 400 // (guard.plain_refresh + 2), refreshes
    assert max(b - a for a, b in zip(refreshes, refreshes[1:])) <= guard.plain_refresh + 2
    assert guard.steps - guard.stats[(batch, plain)].step <= guard.plain_refresh + 1


def test_copied_prefix_scores_chains_as_a_greedy_verification_would():
    """A chain scored against the tokens decoding emitted at its positions accepts the
    prefix a greedy walk accepts (:func:`vllm_graft.core.acceptance.greedy_chain_walk`'s
    rule): every node up to the first mismatch is a trial, the matched ones accepted."""
    from vllm_graft.core.budget import copied_prefix

    proposed = [[5, 6, 7, 8], [5, 9, 7], [1, 2]]
    emitted = [[5, 6, 7, 8], [5, 6, 7], [3, 2]]
    matched = [copied_prefix(p, e) for p, e in zip(proposed, emitted)]
    assert matched == [4, 1, 0]
    model = AcceptanceModel(prior_accepts=0.0, prior_trials=0.0)
    trials = model.observe_chains([([SOURCE_CONTEXT] * len(p), [0.9] * len(p), m, 0)
                                   for p, m in zip(proposed, matched)])
    assert trials == 4 + 2 + 1
    # depth 1: three trials, two accepted; depth 2: two trials, one accepted
    assert model.trials[3, :2, 3].tolist() == [3.0, 2.0]
    assert model.accepts[3, :2, 3].tolist() == [2.0, 1.0]
    # nodes a chain step verified taught the model then: they are skipped
    again = AcceptanceModel(prior_accepts=0.0, prior_trials=0.0)
    assert again.observe_chains([([SOURCE_CONTEXT] * 4, None, 4, 3)]) == 1
    assert again.trials.sum() == 1.0 and again.trials[3, 3].sum() == 1.0


def test_chain_scout_looks_every_few_plain_steps_and_at_each_while_chains_promise():
    """Every ``every`` plain steps at first; each look that does not promise doubles the
    steps to the next (up to ``max_every``), one that promises looks at every plain step
    and brings them back to ``every`` at most. A request joining the batch brings them
    back to ``every``; a batch at least half new looks at its next plain step and backs
    off from there (its first steps are where new requests copy the most)."""
    from vllm_graft.core.budget import ChainScout

    def looks(steps: int) -> list[int]:
        return [i + 1 for i in range(steps) if scout.due()]

    scout = ChainScout(every=4, margin=0.1, max_every=16)
    assert looks(8) == [4, 8]
    assert scout.correction() == 1.0  # nothing measured yet
    assert not scout.promising(30.0, 1000.0, rate=None)  # plain not measured yet
    assert not scout.promising(32.0, 1000.0, rate=30.0)  # 1.07x: within the margin
    assert looks(16) == [16]  # two looks found nothing: 16 steps to the next
    assert scout.promising(34.0, 1000.0, rate=30.0)
    assert looks(3) == [1, 2, 3]  # looks at every plain step
    scout.observe(34.0, 1000.0, tokens=17, seconds=2.0)  # half the tokens in twice the time
    # with two prior steps that fared as predicted: 85 / 102 tokens, 3 / 4 of the time
    assert scout.correction() == pytest.approx(0.625)
    assert not scout.promising(34.0, 1000.0, rate=30.0)
    assert looks(8) == [8]  # back to every 4, doubled by this look
    for _ in range(3):
        scout.promising(34.0, 1000.0, rate=30.0)
    assert looks(32) == [16, 32]  # never more than max_every apart
    scout.text_changed(joined=1, batch=4)
    assert looks(4) == [4]
    scout.promising(34.0, 1000.0, rate=30.0)
    scout.text_changed(joined=2, batch=4)  # half the batch is new
    assert looks(1) == [1]
    assert not scout.promising(34.0, 1000.0, rate=30.0)
    assert looks(2) == [2]
    assert scout.promising(60.0, 1000.0, rate=30.0)  # looks at every step...
    assert looks(2) == [1, 2]
    assert not scout.promising(34.0, 1000.0, rate=30.0)
    assert looks(4) == [4]  # ...and backs off from where it was, not from every
    assert scout.promising(60.0, 1000.0, rate=30.0)  # fires, 4 steps apart...
    scout.fired_step(gained=True)
    assert looks(1) == [1]  # ...its step gained: the next plain step is looked at
    assert scout.promising(60.0, 1000.0, rate=30.0)
    scout.fired_step(gained=False)  # a step that gained nothing: as a look that did
    assert looks(8) == [8]  # not promise, twice the 4 steps it fired at
    scout.fired_step(gained=False)  # nothing fired since: the looks stay as they are
    assert looks(8) == [8]
    with pytest.raises(ValueError, match="every"):
        ChainScout(every=0)
    with pytest.raises(ValueError, match="max_every"):
        ChainScout(every=8, max_every=4)
    with pytest.raises(ValueError, match="prior_steps"):
        ChainScout(prior_steps=-1.0)


def test_a_fired_chain_step_that_replaced_trees_gains_only_by_beating_their_rate():
    """A chain step fired in place of a tree step gained only where it beat the trees'
    measured rate: trees emit several tokens a request too, so two tokens a request
    at a tree step's time is a loss there, though it is a gain over a plain step."""
    guard = ThroughputGuard(modes=(StepMode.TREE, StepMode.CHAIN, StepMode.PLAIN))
    for _ in range(4):  # trees: 3 tokens a request in 0.1 s at batch 2 (charged a bit)
        guard.observe(StepMode.TREE, 2, 6.0, 0.1)
    assert 40.0 < guard.rate_of(2, StepMode.TREE) <= 60.0
    assert fired_step_gained(guard, StepMode.PLAIN, 2, 4.0, 0.1)
    assert not fired_step_gained(guard, StepMode.TREE, 2, 4.0, 0.1)  # 40 tokens/s
    assert fired_step_gained(guard, StepMode.TREE, 2, 4.0, 0.05)  # 80 tokens/s
    assert not fired_step_gained(guard, StepMode.PLAIN, 2, 2.0, 0.01)  # one a request
    # trees not measured at this batch: judged as against plain decoding
    assert fired_step_gained(guard, StepMode.TREE, 8, 16.0, 1.0)


def test_the_chain_scout_looks_at_a_new_batchs_first_steps():
    """A batch of new requests copies the most in its first steps: humaneval's eight
    requests at batch 8 repeat their function's signature from the prompt around their
    seventh token, where a look after the first token, whose matches are one token
    long, promises nothing. After a batch at least half new joins, the scout looks at
    plain steps 1, 3, 7, 15, ... until one promises: it reaches those copies, where
    looking every ``every`` steps from the first would look next at step 9 or 17."""
    from vllm_graft.core.budget import ChainScout

    scout = ChainScout(every=8, max_every=64)
    for _ in range(6):  # a batch of chat before: looks far apart
        scout.promising(10.0, 1000.0, rate=30.0)
    assert scout.interval == 64
    scout.text_changed(joined=8, batch=8)
    looked = []
    for step in range(1, 40):
        if scout.due():
            looked.append(step)
            copying = 6 <= step <= 8  # the signature's copies: 2x plain decoding's rate
            scout.promising(60.0 if copying else 10.0, 1000.0, rate=30.0)
    assert looked == [1, 3, 7, 8, 9, 17, 33], looked


def test_one_chain_step_does_not_silence_the_chain_scout():
    """A fresh engine's only chain step was the guard's warm-up probe on chat: 8
    tokens credited of 13.5 predicted, in 47.8 ms of 34 predicted (a new query length's
    set-up). Taken alone that makes a correction of 0.42, and humaneval's first copies
    (53 tokens predicted in 76 ms, 2.5x plain decoding's rate) no longer beat plain
    decoding by the margin: the scout never fired, and no chain step ever revised it. With
    the prior steps it fires; chain steps that keep faring badly still take over."""
    from vllm_graft.core.budget import ChainScout

    warm_up_probe = dict(expected_tokens=13.5, step_ms=34.0, tokens=8.0, seconds=0.0478)
    copies = dict(expected_tokens=53.1, step_ms=76.1, rate=282.8)
    alone = ChainScout(prior_steps=0.0)
    alone.observe(**warm_up_probe)
    assert alone.correction() == pytest.approx(0.42, abs=0.005)
    assert not alone.promising(**copies)
    scout = ChainScout()
    scout.observe(**warm_up_probe)
    assert scout.weight == 1.0
    assert scout.correction() > 0.7
    assert scout.promising(**copies)
    for _ in range(20):  # the copies' chain steps: a third of what was predicted
        scout.observe(expected_tokens=53.1, step_ms=76.1, tokens=17.7, seconds=0.0761)
    # the record's weight fades as its sums do, so the prior's share grows back with it
    assert scout.weight == pytest.approx(sum(scout.keep ** i for i in range(21)))
    assert scout.correction() < 0.45
    assert not scout.promising(**copies)


def test_on_chat_the_chain_scout_looks_ever_more_rarely():
    """A look builds the batch's chains (about 1 ms at batch 8 on a 2-core CPU, 4 % of
    a plain step). On 2,000 steps of chat at batch 32, where chains never pay, the
    scout looks about once in ``max_every`` plain steps once its looks stop promising,
    not once in ``every``."""
    from vllm_graft.core.budget import ChainScout, ThroughputGuard
    from vllm_graft.core.config import StepMode

    guard, scout = ThroughputGuard(modes=(StepMode.CHAIN, StepMode.PLAIN)), ChainScout()
    counted = []
    original = scout.promising

    def promising(*args):
        counted.append(1)
        return original(*args)

    scout.promising = promising
    run_scouted(guard, scout, chain_rate=0.84, predicted_rate=1.2, steps=2000)
    assert len(counted) < 2000 / scout.max_every + 20, len(counted)
    assert len(counted) < 2000 / scout.every / 4, len(counted)


def test_a_new_batch_size_probes_a_mode_at_once_only_where_it_did_not_lose_nearby():
    """A batch draining to its end passes through smaller batch sizes a few steps each.
    At a batch size first seen, a mode that lost at the nearest measured batch size
    (trees at 32 requests: 0.21 of chains' rate in 3.2 times their step time, so a probe
    loses 2.5 chain steps) has its first probe wait, as a re-probe would, until the
    steps spent at the new size pay for it (507 with ``probe_share`` 0.5 %); the mode
    that was fastest there, plain decoding, and a mode no other batch size measured are
    probed at once."""
    from vllm_graft.core.budget import ThroughputGuard
    from vllm_graft.core.config import StepMode

    tree, chain, plain = StepMode.TREE, StepMode.CHAIN, StepMode.PLAIN
    steps = {tree: (32, 0.8), chain: (48, 0.25), plain: (32, 0.2)}  # tokens, seconds
    guard = ThroughputGuard(modes=(tree, chain, plain))
    for _ in range(10):
        for mode, (tokens, seconds) in steps.items():
            guard.observe(mode, 32, tokens, seconds)
    assert guard.preferred(32) is chain
    choices = []
    for _ in range(600):
        mode = guard.choose(16)
        choices.append(mode)
        tokens, seconds = steps[mode]
        guard.observe(mode, 16, tokens // 2, seconds / 2)
    assert choices[:2] == [chain, plain], choices[:2]
    assert 500 <= choices.index(tree) <= 515, choices.index(tree)
    assert choices.count(tree) == 1
    fresh = ThroughputGuard(modes=(tree, plain))
    assert fresh.choose(4) is tree  # no batch size measured trees: probed at once


def test_throughput_guard_follows_a_change_and_measures_each_batch_bucket():
    from vllm_graft.core.budget import ThroughputGuard
    from vllm_graft.core.config import StepMode

    tree, plain = StepMode.TREE, StepMode.PLAIN
    guard = ThroughputGuard(modes=(tree, plain))
    rates = {tree: 150.0, plain: 100.0}
    modes, _, _ = run_guard(rates, steps=400, batch=8, guard=guard)
    assert guard.preferred(8) is tree
    rates = {tree: 60.0, plain: 100.0}  # e.g. the text stops being predictable
    modes, _, _ = run_guard(rates, steps=400, batch=8, guard=guard)
    assert guard.preferred(8) is plain and modes[-200:].count(plain) > 190
    assert guard.preferred(1) is None  # batch 1 was never measured
    # so it is measured, plain decoding first: trees lost at batch 8
    assert guard.choose(1) is plain
    rates = {tree: 300.0, plain: 100.0}  # and a mode that became faster wins back
    modes, _, _ = run_guard(rates, steps=400, batch=8, guard=guard)
    assert guard.preferred(8) is tree and modes[-200:].count(tree) > 180  # plain: fresh
    with pytest.raises(ValueError, match="window"):
        ThroughputGuard(window=1.0)
    with pytest.raises(ValueError, match="distinct modes"):
        ThroughputGuard(modes=(tree, tree))
    with pytest.raises(ValueError, match="probe_share"):
        ThroughputGuard(probe_share=0.0)


@pytest.mark.parametrize("gap", [7_000, 75_000, 10_000_000])
def test_a_batch_size_served_again_long_after_is_measured_afresh(gap):
    """A batch size whose records faded while the engine served others (``gap`` guard
    steps: 75,000 is where keep ** gap underflows to zero, about an hour of a busy
    server) is measured again, every mode, and runs the faster one. Before,
    a plain record at zero had no rate and never refreshed: trees ran every step."""
    from vllm_graft.core.budget import ThroughputGuard
    from vllm_graft.core.config import StepMode

    tree, plain = StepMode.TREE, StepMode.PLAIN
    guard = ThroughputGuard(modes=(tree, plain))
    rates = {tree: 16.0, plain: 50.0}
    run_guard(rates, steps=300, batch=1, guard=guard)
    guard.steps += gap  # the guard's steps at other batch sizes
    modes, _, _ = run_guard(rates, steps=2000, batch=1, guard=guard)
    assert set(modes[:2]) == {tree, plain}
    assert modes.count(tree) < 0.02 * len(modes), modes.count(tree)
    assert guard.preferred(1) is plain


def test_cost_curve_is_non_decreasing_and_learns_its_shape_where_steps_run():
    """A start-up point measured while something else ran (here 4 tokens at 100 ms,
    above 8 tokens') is pooled into a non-decreasing curve, and real steps at a few
    query tokens correct the points around them, not only the curve's level."""
    from vllm_graft.core.budget import non_decreasing

    assert non_decreasing([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert non_decreasing([5.0, 4.0, 3.0]) == [4.0, 4.0, 4.0]
    cost = CostModel(curves={1: ([1.0, 2.0, 4.0, 8.0, 16.0],
                                 [57.0, 61.0, 100.0, 93.0, 150.0])})
    ms = cost.curves[1][1]
    assert all(b >= a for a, b in zip(ms, ms[1:])) and ms[2] == ms[3] == 96.5
    for _ in range(200):  # this device really verifies 1, 3 and 4 tokens at 57, 63, 64 ms
        cost.observe(1, 1, 57.0)
        cost.observe(1, 3, 63.0)
        cost.observe(1, 4, 64.0)
    got = [float(cost.verify_ms(1, torch.tensor(float(n)))) for n in (1, 3, 4)]
    assert got == pytest.approx([57.0, 63.0, 64.0], rel=0.05)
    ms = cost.curves[1][1]
    assert all(b >= a for a, b in zip(ms, ms[1:]))


def test_chains_observed_as_lists_teach_what_their_tensors_teach():
    """The chain step's host-list lesson (:meth:`TreeSizer.observe_chains`) adds the same
    counts, cell for cell, as :meth:`TreeSizer.observe` on the same chains as a batch
    tree: random chain lengths, sources, scores (some unknown) and accepted prefixes."""
    from vllm_graft.core.acceptance import AcceptanceResult

    generator = torch.Generator().manual_seed(0)
    tags = torch.tensor([SOURCE_RETRIEVED, SOURCE_CONTEXT, SOURCE_DRAFT, SOURCE_BOTH,
                         SOURCE_CONTEXT | SOURCE_RETRIEVED])
    for trial in range(200):
        batch = int(torch.randint(1, 6, (1,), generator=generator))
        rows = int(torch.randint(1, 13, (1,), generator=generator))
        lengths = torch.randint(0, rows, (batch,), generator=generator)  # nodes after root
        index = torch.arange(rows)
        valid = index <= lengths.unsqueeze(1)
        source = tags[torch.randint(0, len(tags), (batch, rows), generator=generator)]
        source = torch.where(valid & (index > 0), source, 0).to(torch.uint8)
        scored = trial % 3 != 0
        score = torch.rand(batch, rows, generator=generator) * 1.2 - 0.1 if scored else None
        accepted = (torch.rand(batch, generator=generator) * (lengths + 1)).long()
        steps = torch.arange(max(rows - 1, 0))
        result = AcceptanceResult(
            accepted_rows=torch.where(steps < accepted.unsqueeze(1), steps + 1, -1),
            output_tokens=torch.zeros(batch, rows, dtype=torch.long), num_accepted=accepted)
        tree = HybridTree(tokens=torch.where(valid, 7, -1), parents=torch.where(valid, index - 1, -1),
                          depths=torch.where(valid, index, 0), valid=valid, source=source,
                          num_nodes=valid.sum(1), score=score)
        by_tensors, by_lists = (TreeSizer(CostModel({1: ([1.0, 64.0], [1.0, 2.0])}))
                                for _ in range(2))
        seeded = torch.rand(by_lists.chain_acceptance.trials.shape, generator=generator,
                            dtype=torch.float64) * 3  # fractional, as a calibration seeds
        for sizer in (by_tensors, by_lists):
            sizer.chain_acceptance.trials += seeded + 1.0
            sizer.chain_acceptance.accepts += seeded / 2
        by_tensors.observe(tree, result, mode=StepMode.CHAIN)
        by_lists.observe_chains(
            [(source[b, 1:lengths[b] + 1].tolist(),
              None if score is None else score[b, 1:lengths[b] + 1].tolist(),
              int(accepted[b]), 0) for b in range(batch)], mode=StepMode.CHAIN)
        for name in ("trials", "accepts"):
            assert torch.equal(getattr(by_tensors.chain_acceptance, name),
                               getattr(by_lists.chain_acceptance, name)), (trial, name)


def test_the_budget_systems_are_built_from_the_config():
    """build_budget_systems gives the sizer always, the guard with auto_guard (tuned by
    graft.guard, choosing among guard_modes) and the scout where the guard chooses
    between copy chains and plain decoding; a calibration's tallies seed both
    acceptance models."""
    from vllm_graft.core.budget import ChainScout, ThroughputGuard, build_budget_systems
    from vllm_graft.core.config import GraftConfig

    cost = CostModel(curves={1: ([1.0, 64.0], [10.0, 12.0])})
    systems = build_budget_systems(GraftConfig.from_dict({"guard": {"window": 40}}), cost)
    assert systems.sizer.cost is cost and not systems.sizer.acceptance.seeded
    assert isinstance(systems.guard, ThroughputGuard) and systems.guard.window == 40.0
    assert systems.guard.modes == (StepMode.TREE, StepMode.CHAIN, StepMode.PLAIN)
    assert isinstance(systems.scout, ChainScout) and systems.scout.every == 8
    assert build_budget_systems(GraftConfig.from_dict({"guard_modes": ["tree", "plain"]}),
                                cost).scout is None
    assert build_budget_systems(GraftConfig.from_dict({"chain_scout_every": 0}),
                                cost).scout is None
    sizer, guard, scout = build_budget_systems(GraftConfig.from_dict({"auto_guard": False}),
                                               cost)
    assert guard is None and scout is None

    class Calibration:  # the two tallies a calibration file holds
        acceptance = chain_acceptance = _tally(context=([[4] * 4], [[2] * 4]))

    sizer = build_budget_systems(GraftConfig(), cost, Calibration()).sizer
    assert sizer.acceptance.seeded and sizer.chain_acceptance.seeded
