"""Copy chains: the copied continuation first, the successor matrix's top-1 walk after
it (bounded by ``max_walk``), a miss ends the chain; and prompt lookup's best
continuation from the context index."""

import random

import pytest
import torch

from tests.core.helpers import copied_to_tensor
from vllm_graft.core.chain import build_chains
from vllm_graft.core.config import StepMode
from vllm_graft.core.context import ContextIndex
from vllm_graft.core.shared_outputs import RecentOutputsIndex
from vllm_graft.core.hybrid import SOURCE_CONTEXT, SOURCE_RETRIEVED
from vllm_graft.core.successor import SuccessorMatrix

VOCAB = 50


def matrix_with(pairs: dict[int, int], backend: str = "compiled") -> SuccessorMatrix:
    """Each token's top successor as given (ranks below it: a different token)."""
    table = torch.full((VOCAB, 4), -1, dtype=torch.int32)
    for token, following in pairs.items():
        table[token, 0] = following
        table[token, 1] = (following + 1) % VOCAB
    return SuccessorMatrix(table, backend=backend)


def reference_chain(root: int, copied: list[int], pairs: dict[int, int], length: int,
                    max_walk: int | None) -> list[int]:
    chain = [root] + copied[:length]
    walked = 0
    while len(chain) < length + 1 and (max_walk is None or walked < max_walk):
        following = pairs.get(chain[-1])
        if following is None:
            break
        chain.append(following)
        walked += 1
    return chain


@pytest.mark.parametrize("backend", ["compiled", "reference"])
def test_chain_copies_then_walks_the_matrix(backend):
    matrix = matrix_with({5: 6, 6: 7, 7: 8, 8: 9, 3: 4}, backend)
    copied = copied_to_tensor([[3], [], [11, 12, 13, 14, 15, 16]], 4)
    chains = build_chains(torch.tensor([1, 5, 2]), copied, matrix, length=4)
    assert chains.tokens.tolist() == [[1, 3, 4, -1, -1],  # copied 3, walked 4, then a miss
                                      [5, 6, 7, 8, 9],  # no copy: the walk from the root
                                      [2, 11, 12, 13, 14]]  # copied to the full length
    c, r = SOURCE_CONTEXT, SOURCE_RETRIEVED
    assert chains.source.tolist() == [[0, c, r, 0, 0], [0, r, r, r, r], [0, c, c, c, c]]
    assert chains.num_nodes.tolist() == [3, 5, 5]
    assert chains.parents[0].tolist() == [-1, 0, 1, -1, -1]
    assert chains.depths[1].tolist() == [0, 1, 2, 3, 4]
    assert chains.ancestor[0, 2].tolist() == [True, True, True, False, False]
    assert not chains.ancestor[0, 3].any()  # padding sees nothing


def test_max_walk_bounds_the_matrix_tail():
    matrix = matrix_with({5: 6, 6: 7, 7: 8, 8: 9, 9: 10})
    copied = copied_to_tensor([[], [20, 5]], 6)
    chains = build_chains(torch.tensor([5, 1]), copied, matrix, length=6, max_walk=2)
    assert chains.tokens.tolist() == [[5, 6, 7, -1, -1, -1, -1],
                                      [1, 20, 5, 6, 7, -1, -1]]
    none = build_chains(torch.tensor([5]), copied_to_tensor([[]], 6), matrix, 6, max_walk=0)
    assert none.num_nodes.tolist() == [1]


def test_random_chains_match_a_reference():
    rng = random.Random(0)
    for _ in range(50):
        pairs = {rng.randrange(VOCAB): rng.randrange(VOCAB) for _ in range(30)}
        matrix = matrix_with(pairs)
        batch, length = rng.randint(1, 6), rng.randint(1, 10)
        max_walk = rng.choice([None, 0, 1, 3])
        roots = [rng.randrange(VOCAB) for _ in range(batch)]
        copied = [[rng.randrange(VOCAB) for _ in range(rng.randint(0, 12))]
                  for _ in range(batch)]
        chains = build_chains(torch.tensor(roots), copied_to_tensor(copied, length), matrix,
                              length, max_walk)
        for b in range(batch):
            want = reference_chain(roots[b], copied[b], pairs, length, max_walk)
            n = int(chains.num_nodes[b])
            assert chains.tokens[b, :n].tolist() == want
            assert (chains.tokens[b, n:] == -1).all()


def test_bad_shapes_are_refused():
    matrix = matrix_with({})
    with pytest.raises(ValueError, match="roots"):
        build_chains(torch.tensor([[1]]), torch.zeros(1, 2, dtype=torch.long), matrix, 2)
    with pytest.raises(ValueError, match="max_walk"):
        build_chains(torch.tensor([1]), torch.zeros(1, 2, dtype=torch.long), matrix, 2, -1)


def test_best_match_is_the_longest_then_most_recent_match():
    index = ContextIndex(min_ngram=2, max_ngram=4)
    #            0  1  2  3  4  5  6  7  8  9 10 11 12
    index.extend([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3])
    # suffix (1, 2, 3) occurs at 0..2 (followed by 4, 9, ...); (2, 3) also at 5..6
    assert index.best_match(3)[1] == [4, 9, 2]
    index.extend([7])
    assert index.best_match(4)[1] == []  # (3, 7) never occurred before
    assert index.best_match(0)[1] == []
    shared = RecentOutputsIndex(max_tokens=100, min_ngram=2, max_ngram=4)
    shared.add([3, 7, 8, 8])
    assert index.best_match(2, shared)[1] == [8, 8]


def test_the_sizer_cuts_chains_where_verifying_them_costs():
    """Chains go through the same sizer as trees, charged no tree overhead: on a flat
    cost curve every node is kept, on a steep one only the likely first ones."""
    from vllm_graft.core.budget import AcceptanceModel, CostModel, TreeSizer

    matrix = matrix_with({t: (t + 1) % VOCAB for t in range(VOCAB)})
    chains = build_chains(torch.arange(4), copied_to_tensor([[9, 9, 9]] * 4, 8), matrix, 8)
    acceptance = AcceptanceModel(prior_accepts=3.0, prior_trials=4.0, explore=0.0)  # 3/4
    flat = CostModel(curves={1: ([1.0, 64.0], [10.0, 10.0])}, overhead_ms=50.0)
    kept, _ = TreeSizer(flat, acceptance).trim(chains, mode=StepMode.CHAIN)
    assert kept.num_nodes.tolist() == [9] * 4
    # the tree overhead would make the same chains not worth verifying at all
    dropped, _ = TreeSizer(flat, acceptance).trim(chains)
    assert dropped.num_nodes.tolist() == [1] * 4
    steep = CostModel(curves={1: ([1.0, 64.0], [10.0, 100.0])})
    cut, _ = TreeSizer(steep, acceptance).trim(chains, mode=StepMode.CHAIN)
    assert 1 < int(cut.num_nodes[0]) < 9
    n = int(cut.num_nodes[0])
    assert cut.tokens[0, :n].tolist() == chains.tokens[0, :n].tolist()  # a prefix
    assert cut.parents[0, :n].tolist() == list(range(-1, n - 1))  # still a chain


def test_best_match_reports_the_match_length_and_its_score_bucket():
    from vllm_graft.core.budget import AcceptanceModel
    from vllm_graft.core.context import match_score

    index = ContextIndex(min_ngram=2, max_ngram=8)
    index.extend([1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 4, 5])
    assert index.best_match(3) == (5, [6, 9, 1])  # (1, 2, 3, 4, 5) occurred at 0..4
    index.extend([7])
    assert index.best_match(3) == (0, [])
    shared = RecentOutputsIndex(max_tokens=100, min_ngram=2, max_ngram=4)
    shared.add([5, 7, 8, 8])
    assert index.best_match(2, shared) == (2, [8, 8])
    scores = [match_score(n, 2) for n in (0, 2, 3, 4, 5, 8)]
    assert scores == sorted(scores) and scores[0] == 0.0 and scores[-1] == 1.0
    # each extra matched token up to three more gets its own bucket of the model
    model = AcceptanceModel()
    buckets = model._bucket(torch.full((4,), SOURCE_CONTEXT), torch.ones(4),
                            torch.tensor([match_score(n, 2) for n in (2, 3, 4, 5)]))
    assert (buckets % model.score_buckets).tolist() == [0, 1, 2, 3]


def test_the_sizer_keeps_long_chains_for_long_matches_and_cuts_short_ones():
    """Copies after a long match are accepted far more often than after a short one;
    with each chain scored by its match (carried through trimming to what is learned),
    the sizer learns both and verifies (nearly) the whole chain of a long match, while cutting
    the chain of a short one on a cost curve that charges every token."""
    from vllm_graft.core.acceptance import AcceptanceResult
    from vllm_graft.core.budget import CostModel, TreeSizer, context_scores
    from vllm_graft.core.context import match_score

    rng = random.Random(3)
    matrix = matrix_with({})
    cost = CostModel(curves={1: ([1.0, 64.0], [10.0, 73.0])})  # 1 ms a token
    sizer = TreeSizer(cost)
    odds = {2: 0.3, 6: 0.95}  # P(copied token accepted | parent accepted) by match length
    for _ in range(200):
        lengths = [rng.choice((2, 6)) for _ in range(4)]
        chains = build_chains(torch.arange(4), copied_to_tensor([[9] * 5] * 4, 5),
                              matrix, 5)
        chains = chains.with_score(context_scores(chains.source, torch.tensor(
            [match_score(n, 2) for n in lengths])))
        trimmed, _ = sizer.trim(chains, mode=StepMode.CHAIN)
        accepted = torch.full((4, 6), -1, dtype=torch.long)
        for b, n in enumerate(lengths):
            depth = 0
            while depth < int(trimmed.num_nodes[b]) - 1 and rng.random() < odds[n]:
                depth += 1
                accepted[b, depth - 1] = depth
        sizer.observe(trimmed, AcceptanceResult(accepted_rows=accepted,
                                                output_tokens=accepted,
                                                num_accepted=(accepted >= 0).sum(1)),
                      mode=StepMode.CHAIN)
    chains = build_chains(torch.arange(2), copied_to_tensor([[9] * 5] * 2, 5), matrix, 5)
    chains = chains.with_score(context_scores(chains.source, torch.tensor(
        [match_score(6, 2), match_score(2, 2)])))
    trimmed, _ = sizer.trim(chains, mode=StepMode.CHAIN)
    assert trimmed.score is not None
    assert trimmed.num_nodes.tolist()[0] >= 5  # (nearly) the whole chain of a long match
    assert trimmed.num_nodes.tolist()[1] <= 2  # at most one copy after a short one


def test_trees_do_not_teach_the_chain_sizer():
    """A copy chain's retrieved nodes (the matrix's top-1 walk) are accepted far more
    often than a tree's retrieved siblings: the sizer keeps one acceptance model per
    kind of step, so trees whose retrieved nodes all failed do not cut chains whose
    walks succeed. One model taught by both (400 failed first nodes of trees, 100
    chains accepted whole) would put a first walked node near 1 in 5 and cut the chains."""
    from vllm_graft.core.acceptance import AcceptanceResult
    from vllm_graft.core.budget import CostModel, TreeSizer

    matrix = matrix_with({t: (t + 1) % VOCAB for t in range(VOCAB)})
    chains = build_chains(torch.arange(4), copied_to_tensor([[]] * 4, 6), matrix, 6)
    assert (chains.source[:, 1:] == SOURCE_RETRIEVED).all()
    sizer = TreeSizer(CostModel(curves={1: ([1.0, 64.0], [10.0, 73.0])}))  # 1 ms a token
    none = torch.full((4, 6), -1, dtype=torch.long)
    rows = torch.arange(1, 7).expand(4, 6)
    whole = AcceptanceResult(accepted_rows=rows, output_tokens=rows,
                             num_accepted=torch.full((4,), 6))
    for _ in range(100):  # every tree's first retrieved node rejected
        sizer.observe(chains, AcceptanceResult(accepted_rows=none, output_tokens=none,
                                               num_accepted=torch.zeros(4, dtype=torch.long)))
    for _ in range(25):  # every chain accepted whole
        sizer.observe(chains, whole, mode=StepMode.CHAIN)
    kept, _ = sizer.trim(chains, mode=StepMode.CHAIN)
    assert kept.num_nodes.tolist() == [7] * 4
    dropped, _ = sizer.trim(chains)  # as a tree step's nodes: not worth one token
    assert dropped.num_nodes.tolist() == [1] * 4
    retrieved = torch.full((1,), SOURCE_RETRIEVED)
    depth, score = torch.ones(1), torch.full((1,), 0.5)
    assert float(sizer.acceptance.conditional(retrieved, depth, score)) < 0.01
    assert float(sizer.chain_acceptance.conditional(retrieved, depth, score)) > 0.95


def test_host_chains_walk_score_and_cut_as_the_tensor_path_does():
    """A copy-chain step builds and sizes its chains as host lists
    (:func:`walk_chains`, :meth:`TreeSizer.trim_chains`); on random contexts, matrices
    (shared or one partition per request), match scores, acceptance counts and cost
    curves that is exactly the tensor path's chains, choice and cut
    (:func:`build_chains`, :func:`context_scores`, :meth:`TreeSizer.trim`)."""
    from vllm_graft.core.budget import AcceptanceModel, CostModel, TreeSizer, context_scores
    from vllm_graft.core.chain import walk_chains
    from vllm_graft.core.context import match_score

    rng = random.Random(2)
    generator = torch.Generator().manual_seed(2)
    cut_somewhere = kept_some = 0
    for case in range(80):
        pairs = {rng.randrange(VOCAB): rng.randrange(VOCAB) for _ in range(40)}
        batch, length = rng.randint(1, 8), rng.randint(0, 10)
        max_walk = rng.choice([None, 0, 1, 3])
        roots = [rng.randrange(VOCAB) for _ in range(batch)]
        copied = [[rng.randrange(VOCAB) for _ in range(rng.randint(0, 6))]
                  for _ in range(batch)]
        matrix = matrix_with(pairs)
        if case % 4 == 0:  # isolated requests: each reads its own partition
            matrix.resize_partitions_(3)
            matrix.table[VOCAB:] = torch.randint(-1, VOCAB, (2 * VOCAB, 4), generator=generator,
                                                 dtype=torch.int32)
            matrix = matrix.for_batch(torch.randint(0, 3, (batch,), generator=generator))
        scores = [match_score(rng.randint(0, 9), 2) for _ in range(batch)]

        want = build_chains(torch.tensor(roots), copied_to_tensor(copied, length), matrix,
                            length, max_walk)
        want = want.with_score(context_scores(want.source, torch.tensor(scores)))
        got = walk_chains(roots, copied, matrix, length, max_walk, copied_scores=scores)
        for b in range(batch):
            n = int(want.num_nodes[b])
            assert got.tokens[b] == want.tokens[b, :n].tolist(), case
            assert got.source[b] == want.source[b, :n].tolist(), case
            assert got.score[b][1:] == want.score[b, 1:n].tolist(), case

        acceptance = AcceptanceModel(explore=rng.choice([0.0, 1.0]))
        acceptance.accepts += torch.rand(acceptance.accepts.shape, generator=generator) * 20
        acceptance.trials += acceptance.accepts + torch.rand(acceptance.trials.shape,
                                                             generator=generator) * 20
        slope = rng.uniform(0.0, 3.0)
        cost = CostModel(curves={1: ([1.0, 8.0, 64.0], [10.0, 10.0 + slope, 10.0 + 9 * slope])})
        sizer = TreeSizer(cost, chain_acceptance=acceptance)
        want_cut, want_choice = sizer.trim(want, mode=StepMode.CHAIN)
        got_cut, got_choice = sizer.trim_chains(got)
        assert got_choice.nodes_per_request.tolist() == want_choice.nodes_per_request.tolist()
        assert (got_choice.expected_tokens, got_choice.step_ms) == \
            (want_choice.expected_tokens, want_choice.step_ms), case
        # the same prediction split by request (for the guard's median credit)
        assert len(got_choice.request_tokens) == batch
        assert sum(got_choice.request_tokens) == pytest.approx(got_choice.expected_tokens)
        assert all(tokens >= 1.0 for tokens in got_choice.request_tokens)
        tree = got_cut.to_tree()
        rows = min(tree.tokens.shape[1], want_cut.tokens.shape[1])
        for name in ("tokens", "parents", "depths", "valid", "source"):
            assert torch.equal(getattr(tree, name)[:, :rows],
                               getattr(want_cut, name)[:, :rows]), (case, name)
        assert torch.equal(tree.num_nodes, want_cut.num_nodes)
        assert not want_cut.valid[:, rows:].any()
        cut_somewhere += bool((want_cut.num_nodes < want.num_nodes).any())
        kept_some += bool((want_cut.num_nodes > 1).any())
    assert 10 < cut_somewhere < 80 and kept_some > 10  # the cases cut, and not always


def test_a_default_copy_chain_covers_more_than_prompt_lookup_verifies():
    """A request copying a long span: the chain mode's default chain copies 16 tokens of
    it, past the 10 that prompt lookup for copies verifies (the copy benchmark's
    ``ngram_long``). At 8 (the former default), Graft's chains proposed fewer tokens
    than prompt lookup on long copies: on the copy benchmark (batch 1) chains alone
    emitted 5.29 tokens a step on type hints and 6.51 on reformatting where
    ``ngram_long`` emitted 4.98 and 7.06; at 16, 6.68 and 9.07 (issue 52, item 3)."""
    from vllm_graft.core.chain import walk_chains
    from vllm_graft.core.config import GraftConfig

    config = GraftConfig.from_dict({"budget": "auto"})
    span = list(range(100, 140))
    context = config.context_settings
    index = ContextIndex(min_ngram=context.min_ngram, max_ngram=context.max_ngram)
    index.extend([1, 2] + span + [3, 4] + span[:5])
    _, copied = index.best_match(config.chain_tokens)
    chains = walk_chains([span[4]], [copied], matrix_with({}), config.chain_tokens,
                         config.chain_walk)
    assert chains.tokens[0][1:] == span[5:5 + config.chain_tokens]
    assert len(chains.tokens[0]) - 1 >= 16 > 10
