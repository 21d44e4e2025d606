import copy
import random

import pytest
import torch

from vllm_graft.core.context import (DEPTH_DECAY, SHARED_DISCOUNT, SPAN_LOOKBACK,
                                     ContextIndex, ContextProposal, proposals_to_tensors)
from vllm_graft.core.shared_outputs import PeerOutputs, RecentOutputsIndex


def _index(tokens, **kwargs) -> ContextIndex:
    index = ContextIndex(**kwargs)
    index.extend(tokens)
    return index


def _paths(proposal: ContextProposal) -> list[tuple[int, ...]]:
    """Each node as its token path from the root."""
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(proposal.tokens, proposal.parents):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return paths


def _check_tree(proposal: ContextProposal) -> None:
    n = len(proposal.tokens)
    assert len(proposal.parents) == len(proposal.depths) == len(proposal.weights) == n
    siblings = set()
    for i, (token, parent, depth, weight) in enumerate(
            zip(proposal.tokens, proposal.parents, proposal.depths, proposal.weights)):
        assert -1 <= parent < i  # parents first, hence prefix-closed
        assert depth == (1 if parent < 0 else proposal.depths[parent] + 1)
        assert 0.0 < weight <= 1.0
        if parent >= 0:
            assert weight <= proposal.weights[parent]
        assert (parent, token) not in siblings  # siblings are distinct tokens
        siblings.add((parent, token))
    assert (n == 0) == (proposal.match_length == 0)


def _reference_proposal(context, min_ngram, max_ngram, max_nodes, max_depth, max_matches,
                        depth_decay=DEPTH_DECAY, ends=None) -> ContextProposal:
    """Brute force: scan the whole context for the suffix (occurrences ending in
    ``ends`` only, when given), weigh every token path."""
    length = len(context)
    matches, taken = [], set()
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        found = []
        for end in range(length - 2, n - 2, -1):
            if ends is not None and end not in ends:
                continue
            if end not in taken and context[end - n + 1:end + 1] == context[length - n:]:
                taken.add(end)
                found.append(end)
        if n == max_ngram:  # the longest n-gram's occurrences: by how far back they match
            found.sort(key=lambda end: -_matched_back(context, end))
        matches += [(n, _copied(context, end, max_depth)) for end in found]
    matches = matches[:max_matches]
    if not matches or max_nodes == 0 or max_depth == 0:
        return ContextProposal.empty()
    total = sum(n for n, _ in matches)
    mass: dict[tuple[int, ...], float] = {}  # insertion-ordered: first appearance
    for n, continuation in matches:
        for d in range(1, len(continuation) + 1):
            mass[continuation[:d]] = mass.get(continuation[:d], 0) + n
    order = list(mass)
    weight = {p: mass[p] / total * depth_decay ** (len(p) - 1) for p in order}
    kept = sorted(order, key=lambda p: (-weight[p], len(p), order.index(p)))[:max_nodes]
    row = {p: i for i, p in enumerate(kept)}
    return ContextProposal(tokens=[p[-1] for p in kept],
                           parents=[row[p[:-1]] if len(p) > 1 else -1 for p in kept],
                           depths=[len(p) for p in kept],
                           weights=[weight[p] for p in kept],
                           match_length=max(n for n, _ in matches))


def _copied(context, end, max_depth) -> tuple[int, ...]:
    """Brute force: ``max_depth`` tokens of a copy from ``end + 1`` that goes on past
    the context's end reading what it copied, where the occurrence overlaps the suffix
    (matches back at least as far as its distance from the end); else what followed
    it in the context."""
    if _matched_back(context, end) < len(context) - 1 - end:
        return tuple(context[end + 1:end + 1 + max_depth])
    text = list(context)
    for k in range(max_depth):
        text.append(text[end + 1 + k])
    return tuple(text[end + 1:end + 1 + max_depth])


def _matched_back(context, end) -> int:
    """Brute force: how many tokens up to ``end`` equal the context's last ones, at most
    SPAN_LOOKBACK."""
    n = 0
    while (n < SPAN_LOOKBACK and end - n >= 0
           and context[end - n] == context[len(context) - 1 - n]):
        n += 1
    return n


def _random_context(rng: random.Random, length: int, vocab: int) -> list[int]:
    """Random tokens with copied spans, so that suffixes recur."""
    tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
    while len(tokens) < length:
        if rng.random() < 0.5 and len(tokens) > 2:
            start = rng.randrange(len(tokens) - 1)
            tokens.extend(tokens[start:start + rng.randint(2, 8)])
        else:
            tokens.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 3)))
    return tokens[:length]


# ---- exact proposals --------------------------------------------------------------------


def test_single_match_proposes_what_followed():
    proposal = _index([1, 2, 3, 4, 1, 2, 3]).propose(max_nodes=16, max_depth=16, max_matches=8)
    assert proposal.tokens == [4, 1, 2, 3]
    assert proposal.parents == [-1, 0, 1, 2]
    assert proposal.depths == [1, 2, 3, 4]
    assert proposal.weights == pytest.approx([1.0, DEPTH_DECAY, DEPTH_DECAY**2, DEPTH_DECAY**3])
    assert proposal.match_length == 3  # (1, 2, 3); (2, 3) at the same end is not recounted


def test_a_loop_is_proposed_repeating_past_the_context_end():
    """Text repeating a period: its most recent occurrence is a period back and has
    only the period's tokens after it; the proposal repeats them up to max_depth (a
    model stuck on a closing fence, on the copy benchmark's agent transcripts). An
    occurrence that does not overlap the suffix keeps its cut continuation."""
    fence = [7, 8]
    looped = _index([1, 2, 3, *fence * 4], max_ngram=4)
    assert looped.best_match(9) == (4, [7, 8, 7, 8, 7, 8, 7, 8, 7])
    assert _paths(looped.propose(max_nodes=6, max_depth=6, max_matches=1)) == [
        (7,), (7, 8), (7, 8, 7), (7, 8, 7, 8), (7, 8, 7, 8, 7), (7, 8, 7, 8, 7, 8)]
    line = [4, 5, 6, 9, 10, 11]  # a period longer than the n-grams: matched back
    assert _index([1, *line * 3], max_ngram=3).best_match(8) == (3, [*line, 4, 5])
    apart = _index([1, 2, 3, 4, 1, 2, 3], max_ngram=3)  # (1, 2, 3) twice, no overlap
    assert apart.best_match(16) == (3, [4, 1, 2, 3])


def test_continuation_is_cut_at_max_depth():
    proposal = _index([1, 2, 3, 4, 5, 6, 1, 2]).propose(max_nodes=16, max_depth=2,
                                                         max_matches=8)
    assert proposal.tokens == [3, 4] and proposal.parents == [-1, 0]


def test_repeated_pattern_merges_into_one_chain():
    # every occurrence of (1, 2) is followed by 3, 1, 2, ...: all matches agree
    proposal = _index([1, 2, 3] * 4 + [1, 2]).propose(max_nodes=16, max_depth=3,
                                                      max_matches=8)
    assert proposal.tokens == [3, 1, 2]
    assert proposal.parents == [-1, 0, 1]
    assert proposal.weights[0] == 1.0
    assert proposal.match_length == 8


def test_diverging_matches_branch_with_distinct_siblings():
    # (1, 2) was followed by 7 twice and by 9 once
    context = [5, 1, 2, 7, 1, 2, 7, 8, 1, 2, 9, 1, 2]
    proposal = _index(context).propose(max_nodes=16, max_depth=2, max_matches=8,
                                       depth_decay=1.0)
    _check_tree(proposal)
    paths = dict(zip(_paths(proposal), proposal.weights))
    assert paths == pytest.approx({(7,): 2 / 3, (9,): 1 / 3, (7, 8): 1 / 3, (7, 1): 1 / 3,
                                   (9, 1): 1 / 3})
    assert proposal.tokens[:2] == [7, 9]  # the more frequent continuation ranks first
    # the tie at weight 1/3: shallower first, then the more recent match
    assert _paths(proposal)[2:] == [(9, 1), (7, 8), (7, 1)]


def test_longer_match_weighs_more():
    # suffix (3, 1, 2): a 3-gram match followed by 4, a 2-gram-only match followed by 6
    context = [3, 1, 2, 4, 0, 1, 2, 6, 0, 3, 1, 2]
    proposal = _index(context).propose(max_nodes=16, max_depth=1, max_matches=8)
    assert proposal.tokens == [4, 6]
    assert proposal.weights == pytest.approx([3 / 5, 2 / 5])
    assert proposal.match_length == 3


def test_longer_match_beats_more_recent_when_matches_run_out():
    context = [3, 1, 2, 4, 0, 1, 2, 6, 0, 3, 1, 2]
    proposal = _index(context).propose(max_nodes=16, max_depth=1, max_matches=1)
    assert proposal.tokens == [4] and proposal.weights == [1.0]


def test_most_recent_match_first_within_a_length():
    context = [1, 2, 5, 1, 2, 6, 1, 2, 7, 1, 2]
    proposal = _index(context).propose(max_nodes=16, max_depth=1, max_matches=2)
    assert proposal.tokens == [7, 6]


def test_no_match_is_empty():
    for context in ([], [1], [1, 2], [1, 2, 3, 4, 5], [1, 2, 1, 3]):
        proposal = _index(context).propose(max_nodes=16, max_depth=16, max_matches=8)
        assert proposal == ContextProposal.empty()
        assert proposal.match_length == 0 and len(proposal) == 0


def test_min_ngram_one_matches_single_tokens():
    proposal = _index([4, 9, 1, 4], min_ngram=1).propose(max_nodes=4, max_depth=2,
                                                          max_matches=4)
    assert proposal.tokens == [9, 1] and proposal.match_length == 1


def test_zero_limits_give_empty():
    index = _index([1, 2, 3, 1, 2])
    assert index.propose(0, 16, 8) == ContextProposal.empty()
    assert index.propose(16, 0, 8) == ContextProposal.empty()
    assert index.propose(16, 16, 0) == ContextProposal.empty()


def test_max_nodes_keeps_the_heaviest_prefix_closed_nodes():
    context = [5, 1, 2, 7, 1, 2, 7, 8, 1, 2, 9, 1, 2]
    full = _index(context).propose(max_nodes=64, max_depth=4, max_matches=8)
    for max_nodes in range(len(full.tokens) + 1):
        cut = _index(context).propose(max_nodes=max_nodes, max_depth=4, max_matches=8)
        assert cut.tokens == full.tokens[:max_nodes]
        assert cut.parents == full.parents[:max_nodes]
        _check_tree(cut)


def test_a_copied_span_is_followed_past_a_more_recent_repeat_of_its_tail():
    """Copying a line whose last ``max_ngram`` tokens recur later in the prompt with
    another continuation (a repeated fragment of code or data), the copy goes on with
    the line being copied, as suffix decoding's pointer does: the occurrence that
    matches furthest back wins over the most recent one (issue 52, item 4)."""
    line = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    prompt = line + [100] + [1, 2, 3] + [0, 16, 17, 18, 19, 200] + [4, 5]
    index = _index(prompt + line, max_ngram=4)
    assert index.best_match(3) == (4, [100, 1, 2])
    assert index.propose(max_nodes=3, max_depth=3, max_matches=2, lead_nodes=3).tokens \
        == [100, 1, 2]
    # the answer copies on: still the line's continuation, never the repeat's
    index.extend([100, 1])
    assert index.best_match(2)[1] == [2, 3]


def test_the_span_rule_looks_back_a_bounded_way():
    """Two occurrences that both match further back than SPAN_LOOKBACK tie, and the
    most recent wins (a lookup's work stays bounded): the older one matches 3 tokens
    further back still, which a lookup without the bound would prefer."""
    span = [7 + (i % 5) * 3 + i // 5 for i in range(SPAN_LOOKBACK + 4)]
    lead = [1, 2, 3]
    context = lead + span + [100] + [4, 5, 6] + span + [200] + lead + span
    assert _index(context, max_ngram=4).best_match(1) == (4, [200])


# ---- properties on random contexts ------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_random_proposals_match_brute_force(seed):
    rng = random.Random(seed)
    min_ngram = rng.randint(1, 3)
    max_ngram = rng.randint(min_ngram, 6)
    context = _random_context(rng, rng.randint(2, 300), vocab=rng.choice([3, 8, 50]))
    index = _index(context, min_ngram=min_ngram, max_ngram=max_ngram, max_positions=10_000)
    for _ in range(5):
        max_nodes, max_depth = rng.randint(0, 24), rng.randint(0, 10)
        max_matches = rng.randint(0, 10)
        proposal = index.propose(max_nodes, max_depth, max_matches)
        _check_tree(proposal)
        assert len(proposal.tokens) <= max_nodes
        assert max(proposal.depths, default=0) <= max_depth
        expected = _reference_proposal(context, min_ngram, max_ngram, max_nodes, max_depth,
                                       max_matches)
        assert proposal.tokens == expected.tokens
        assert proposal.parents == expected.parents
        assert proposal.depths == expected.depths
        assert proposal.weights == pytest.approx(expected.weights)
        assert proposal.match_length == expected.match_length


@pytest.mark.parametrize("seed", range(20))
def test_bounded_positions_keep_tree_invariants(seed):
    rng = random.Random(1000 + seed)
    context = _random_context(rng, 400, vocab=4)
    index = _index(context, max_positions=rng.randint(1, 4))
    proposal = index.propose(max_nodes=32, max_depth=8, max_matches=rng.randint(1, 12))
    _check_tree(proposal)
    for path in _paths(proposal):  # every path is a real continuation of the suffix
        assert any(context[end + 1:end + 1 + len(path)] == list(path)
                   and context[end - 1:end + 1] == context[-2:]
                   for end in range(1, len(context) - 1))


def test_propose_is_deterministic():
    rng = random.Random(7)
    context = _random_context(rng, 500, vocab=6)
    first = _index(context).propose(32, 8, 8)
    assert all(_index(context).propose(32, 8, 8) == first for _ in range(3))


# ---- incremental updates and memory -----------------------------------------------------


@pytest.mark.parametrize("seed", range(10))
def test_incremental_extend_equals_rebuild(seed):
    rng = random.Random(seed)
    context = _random_context(rng, 300, vocab=5)
    kwargs = dict(min_ngram=rng.randint(1, 3), max_ngram=rng.randint(3, 7),
                  max_positions=rng.randint(1, 8))
    rebuilt = _index(context, **kwargs)
    chunked = ContextIndex(**kwargs)
    start = 0
    while start < len(context):
        stop = start + rng.choice([0, 1, 1, 2, 5, 17])
        chunked.extend(context[start:stop])
        start = stop
    assert list(chunked.tokens) == list(rebuilt.tokens) == context
    assert len(chunked) == len(context)
    assert chunked.num_entries() == rebuilt.num_entries()
    assert chunked._table.positions == rebuilt._table.positions
    assert chunked.propose(16, 8, 8) == rebuilt.propose(16, 8, 8)


def test_extend_accepts_tensors_and_arrays():
    import numpy as np

    index = ContextIndex()
    index.extend(torch.tensor([1, 2, 3]))
    index.extend(np.array([4, 1, 2], dtype=np.int64))
    index.extend(iter([3]))
    assert list(index.tokens) == [1, 2, 3, 4, 1, 2, 3]
    assert all(type(t) is int for t in index.tokens)
    assert index.propose(4, 4, 4).tokens == [4, 1, 2, 3]


@pytest.mark.parametrize("min_ngram, max_ngram, max_positions", [(2, 8, 32), (1, 4, 3),
                                                                  (3, 3, 1)])
def test_memory_is_bounded(min_ngram, max_ngram, max_positions):
    rng = random.Random(3)
    context = _random_context(rng, 2000, vocab=3)  # a tiny vocabulary repeats every n-gram
    index = _index(context, min_ngram=min_ngram, max_ngram=max_ngram,
                   max_positions=max_positions)
    positions = {key: index._table.get(key) for key in index._table.positions}
    assert index.num_entries() == sum(len(v) for v in positions.values())
    assert index.num_entries() <= len(index) * (max_ngram - min_ngram + 1)
    assert max(len(v) for v in positions.values()) == max_positions
    for key, ends in positions.items():
        assert min_ngram <= len(key) <= max_ngram
        assert list(ends) == sorted(ends)  # the most recent ones, oldest first
        assert all(context[e - len(key) + 1:e + 1] == list(key) for e in ends)


# ---- indexing that lags the context (a long prompt over several steps) ------------------


def _assert_same_table(index: ContextIndex, whole: ContextIndex) -> None:
    assert list(index.tokens) == list(whole.tokens)
    assert index._table.positions == whole._table.positions
    assert index.num_entries() == whole.num_entries()


def _lagging_build(rng: random.Random, context: list[int], index: ContextIndex, check):
    """Feed ``context`` in random chunks, each followed by a catch-up with a random
    limit (a step's worth, none, or all); ``check(index, limit, done)`` after each."""
    start = 0
    while start < len(context):
        stop = start + rng.choice([0, 1, 1, 2, 7, 40, 150, len(context)])
        index.append(context[start:stop])
        start = stop
        limit = rng.choice([0, 1, 3, 10, 64, None])
        done = index.catch_up(limit)
        check(index, limit, done)


@pytest.mark.parametrize("seed", range(40))
def test_lagging_index_proposes_from_its_indexed_part(seed):
    """Until it has caught up, an index proposes exactly what a brute-force scan of its
    indexed end positions would; the indexed positions are one range that only grows."""
    rng = random.Random(5000 + seed)
    min_ngram = rng.randint(1, 3)
    max_ngram = rng.randint(min_ngram, 6)
    context = _random_context(rng, rng.randint(2, 400), vocab=rng.choice([3, 8, 50]))
    index = ContextIndex(min_ngram=min_ngram, max_ngram=max_ngram, max_positions=10_000)
    seen: list[range] = []

    def check(index, limit, done):
        assert done <= (limit if limit is not None else len(index))
        indexed = index.indexed
        assert indexed.start >= min_ngram - 1 and indexed.stop <= max(len(index),
                                                                      min_ngram - 1)
        if seen and len(seen[-1]):
            assert indexed.start <= seen[-1].start and indexed.stop >= seen[-1].stop
        assert len(indexed) - (len(seen[-1]) if seen else 0) == done
        assert index.pending == max(len(index) - min_ngram + 1, 0) - len(indexed)
        seen.append(indexed)
        max_nodes, max_depth, max_matches = rng.randint(1, 24), rng.randint(1, 10), \
            rng.randint(1, 10)
        proposal = index.propose(max_nodes, max_depth, max_matches)
        _check_tree(proposal)
        expected = _reference_proposal(list(index.tokens), min_ngram, max_ngram, max_nodes,
                                       max_depth, max_matches, ends=set(indexed))
        assert proposal.tokens == expected.tokens
        assert proposal.parents == expected.parents
        assert proposal.weights == pytest.approx(expected.weights)
        assert proposal.match_length == expected.match_length

    _lagging_build(rng, context, index, check)
    while index.pending:
        check(index, 5, index.catch_up(5))
    assert index.indexed == range(min_ngram - 1, max(len(context), min_ngram - 1))


@pytest.mark.parametrize("seed", range(40))
def test_caught_up_index_equals_the_whole_prompt_index(seed):
    """Any chunking and any per-step limits: once nothing is pending, the table (hence
    every proposal) is the one indexing the whole context at once builds, with bounded
    positions too (the newest-first part keeps only what the oldest-first build keeps)."""
    rng = random.Random(6000 + seed)
    kwargs = dict(min_ngram=rng.randint(1, 3), max_ngram=rng.randint(3, 7),
                  max_positions=rng.choice([1, 2, 3, 8, 32]))
    context = _random_context(rng, rng.randint(1, 600), vocab=rng.choice([3, 5, 50]))
    index = ContextIndex(**kwargs)
    _lagging_build(rng, context, index, lambda *_: None)
    while index.pending:
        index.catch_up(rng.randint(1, 50))
    whole = _index(context, **kwargs)
    _assert_same_table(index, whole)
    for _ in range(3):
        limits = rng.randint(1, 24), rng.randint(1, 12), rng.randint(1, 12)
        assert index.propose(*limits, lead_nodes=4) == whole.propose(*limits, lead_nodes=4)
        assert index.best_match(limits[1]) == whole.best_match(limits[1])


def test_catch_up_work_is_bounded_and_newest_first():
    """Each catch-up registers the n-grams of at most ``limit`` end positions, each
    position once over the whole build, the newest first: a long prompt costs a step a
    bounded amount of work however long it is."""
    rng = random.Random(11)
    context = _random_context(rng, 5000, vocab=20)
    index = ContextIndex()
    registered: list[int] = []
    table = index._table
    for name in ("register", "register_older"):
        original = getattr(table, name)
        setattr(table, name, lambda tokens, end, position, original=original:
                (registered.append(end), original(tokens, end, position)))
    index.append(context[:4000])
    per_step = []
    while index.pending:
        before = len(registered)
        index.append(context[len(index):len(index) + 3])  # a decoding step's tokens
        assert index.catch_up(256) == len(registered) - before
        per_step.append(len(registered) - before)
        if len(per_step) == 1:  # the newest first
            assert index.indexed == range(len(index) - 256, len(index))
    assert max(per_step) == 256 and len(per_step) == -(-(len(index) - 1) // 256)
    assert sorted(registered) == list(range(1, len(index)))  # each position once
    # decoding tokens arriving while the prompt waits are indexed ahead of it
    assert registered.index(4001) < registered.index(3000)
    _assert_same_table(index, _index(index.tokens))


def test_extend_indexes_everything_pending():
    index = ContextIndex()
    index.append([1, 2, 3, 1, 2])
    assert index.pending == 4 and index.propose(4, 4, 4) == ContextProposal.empty()
    index.extend([3, 1, 2])
    assert index.pending == 0
    _assert_same_table(index, _index([1, 2, 3, 1, 2, 3, 1, 2]))
    assert index.propose(4, 4, 4).tokens[:2] == [3, 1]


@pytest.mark.parametrize("seed", range(30))
def test_truncate_equals_indexing_what_is_kept(seed):
    """A rewound history: cutting the index back, lagging or not, then going on with
    other tokens builds the table indexing the new context would (positions unbounded;
    bounded, see the next test); cutting and adding the same tokens back changes
    nothing at all."""
    rng = random.Random(7000 + seed)
    kwargs = dict(min_ngram=rng.randint(1, 3), max_ngram=rng.randint(3, 6))
    context = _random_context(rng, rng.randint(1, 300), vocab=rng.choice([3, 8]))
    index = ContextIndex(max_positions=10_000, **kwargs)
    _lagging_build(rng, context, index, lambda *_: None)
    keep = rng.randint(0, len(context))
    index.truncate(keep)
    assert list(index.tokens) == context[:keep]
    assert set(index.indexed) <= set(range(keep))
    tail = _random_context(rng, rng.randint(1, 100), vocab=3)
    index.append(tail)
    index.catch_up(rng.choice([0, 5, None]))
    while index.pending:
        index.catch_up(7)
    _assert_same_table(index, _index(context[:keep] + tail, max_positions=10_000, **kwargs))

    bounded = ContextIndex(max_positions=rng.randint(1, 4), **kwargs)
    bounded.extend(context)
    saved = copy.deepcopy(bounded._table.positions)
    bounded.truncate(keep)
    bounded.extend(context[keep:])
    assert bounded._table.positions == saved


@pytest.mark.parametrize("seed", range(10))
def test_truncate_with_bounded_positions_keeps_real_occurrences(seed):
    """With ``max_positions`` reached, positions dropped for newer ones that the cut
    removed are not recovered: each key holds a subset of what a rebuilt index holds
    (fewer matches, still real ones)."""
    rng = random.Random(8000 + seed)
    context = _random_context(rng, 400, vocab=3)
    index = _index(context, max_positions=3)
    keep = rng.randint(0, 400)
    index.truncate(keep)
    rebuilt = _index(context[:keep], max_positions=3)
    entries = 0
    for key in index._table.positions:
        held = index._table.get(key)
        assert list(held) == sorted(held)
        assert set(held) <= set(rebuilt._table.get(key))
        entries += len(held)
    assert entries == index.num_entries() <= rebuilt.num_entries()


# ---- the shared index -------------------------------------------------------------------


def test_shared_index_fills_missing_matches():
    shared = RecentOutputsIndex(max_tokens=100)
    shared.add([8, 1, 2, 5, 6])
    index = _index([3, 1, 2, 4, 0, 1, 2])
    alone = index.propose(max_nodes=8, max_depth=2, max_matches=1, shared=shared)
    assert alone.tokens == [4, 0]  # enough own matches: shared is not consulted
    both = index.propose(max_nodes=8, max_depth=2, max_matches=2, shared=shared,
                         depth_decay=1.0)
    _check_tree(both)
    own, other = 2.0, 2.0 * SHARED_DISCOUNT
    assert dict(zip(_paths(both), both.weights)) == pytest.approx(
        {(4,): own / (own + other), (4, 0): own / (own + other),
         (5,): other / (own + other), (5, 6): other / (own + other)})
    assert both.tokens[0] == 4  # own matches outrank equally long shared ones


def test_shared_index_alone_and_its_match_length():
    shared = RecentOutputsIndex(max_tokens=100)
    shared.add([9, 7, 1, 2, 5])
    index = _index([7, 1, 2])  # no earlier occurrence in its own context
    assert index.propose(8, 4, 4) == ContextProposal.empty()
    proposal = index.propose(8, 4, 4, shared=shared)
    assert proposal.tokens == [5] and proposal.weights == [1.0]
    assert proposal.match_length == 3  # the whole context occurs in the output


def test_shared_matches_stay_within_their_output():
    shared = RecentOutputsIndex(max_tokens=100)
    shared.add([1, 2, 3])
    shared.add([4, 5, 1, 2])  # (1, 2) ends this output: nothing follows it here
    assert shared.matches([1, 2], max_matches=4, max_depth=8) == [(2, [3])]
    assert shared.matches([0, 1, 2], max_matches=0, max_depth=8) == []


def test_shared_eviction_drops_oldest_outputs_and_their_entries():
    shared = RecentOutputsIndex(max_tokens=10, min_ngram=2, max_ngram=3)
    shared.add([1, 2, 3, 4])
    shared.add([5, 6, 7, 8])
    assert len(shared) == 8 and shared.num_outputs == 2
    entries_before = shared.num_entries()
    assert shared.matches([1, 2], 4, 4) == [(2, [3, 4])]
    shared.add([9, 5, 6, 0])  # 12 tokens > 10: the first output goes
    assert len(shared) == 8 and shared.num_outputs == 2
    assert shared.matches([1, 2], 4, 4) == []
    assert shared.matches([5, 6], 4, 4) == [(2, [0]), (2, [7, 8])]
    assert shared.num_entries() == entries_before  # two outputs of four tokens each
    table = shared._table
    assert all(output_id != 0 for key in table.positions for output_id, _ in table.get(key))
    shared.add([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # fills the budget alone
    assert len(shared) == 10 and shared.num_outputs == 1
    assert shared.num_entries() == 9 + 8
    assert shared.matches([5, 6], 4, 4) == [(2, [7, 8, 9, 10])]


@pytest.mark.parametrize("seed", range(5))
def test_shared_eviction_equals_indexing_the_survivors(seed):
    rng = random.Random(seed)
    shared = RecentOutputsIndex(max_tokens=200, max_ngram=4, max_positions=3)
    outputs = [_random_context(rng, rng.randint(3, 60), vocab=4) for _ in range(30)]
    for output in outputs:
        shared.add(output)
        assert len(shared) <= 200
        assert shared.num_entries() <= len(shared) * 3
    survivors = RecentOutputsIndex(max_tokens=10_000, max_ngram=4, max_positions=3)
    for output in outputs[len(outputs) - shared.num_outputs:]:
        survivors.add(output)
    assert len(survivors) == len(shared)
    assert shared.num_entries() == survivors.num_entries()
    for suffix in ([0, 1], [2, 2, 3], [1, 0, 3, 2]):
        assert shared.matches(suffix, 8, 5) == survivors.matches(suffix, 8, 5)


def test_shared_long_output_keeps_its_tail_and_short_ones_are_skipped():
    shared = RecentOutputsIndex(max_tokens=4)
    shared.add([1, 2, 3, 4, 5, 6])
    assert len(shared) == 4 and shared.matches([3, 4], 2, 2) == [(2, [5, 6])]
    shared.add([7, 8])  # too short to hold a match and a continuation
    assert len(shared) == 4 and shared.num_outputs == 1


# ---- tensors ----------------------------------------------------------------------------


def test_proposals_to_tensors_pads_and_cuts():
    a = _index([1, 2, 3, 4, 1, 2, 3]).propose(8, 8, 8)  # 4 nodes
    b = ContextProposal.empty()
    tokens, parents, depths, weights = proposals_to_tensors([a, b], width=3)
    assert tokens.dtype == parents.dtype == depths.dtype == torch.int64
    assert weights.dtype == torch.float32
    assert tokens.tolist() == [[4, 1, 2], [-1, -1, -1]]
    assert parents.tolist() == [[-1, 0, 1], [-1, -1, -1]]
    assert depths.tolist() == [[1, 2, 3], [0, 0, 0]]
    assert torch.allclose(weights, torch.tensor([[1.0, 0.9, 0.81], [0.0, 0.0, 0.0]]))
    tokens, parents, depths, weights = proposals_to_tensors([a], width=6)
    assert tokens.tolist() == [[4, 1, 2, 3, -1, -1]]
    assert parents.tolist() == [[-1, 0, 1, 2, -1, -1]]
    assert depths.tolist() == [[1, 2, 3, 4, 0, 0]]


def test_proposals_to_tensors_empty_shapes():
    for tensor in proposals_to_tensors([], width=5):
        assert tensor.shape == (0, 5)
    for tensor in proposals_to_tensors([ContextProposal.empty()] * 2, width=0):
        assert tensor.shape == (2, 0)


# ---- argument validation ----------------------------------------------------------------


@pytest.mark.parametrize("make, name", [
    (lambda: ContextIndex(min_ngram=0), "min_ngram"),
    (lambda: ContextIndex(min_ngram=3, max_ngram=2), "max_ngram"),
    (lambda: ContextIndex(max_positions=0), "max_positions"),
    (lambda: RecentOutputsIndex(max_tokens=0), "max_tokens"),
    (lambda: RecentOutputsIndex(min_ngram=0), "min_ngram"),
    (lambda: RecentOutputsIndex(max_positions=0), "max_positions"),
    (lambda: ContextIndex().propose(-1, 4, 4), "max_nodes"),
    (lambda: ContextIndex().propose(4, -1, 4), "max_depth"),
    (lambda: ContextIndex().propose(4, 4, -1), "max_matches"),
    (lambda: ContextIndex().propose(4, 4, 4, depth_decay=0.0), "depth_decay"),
    (lambda: ContextIndex().propose(4, 4, 4, shared_discount=1.5), "shared_discount"),
    (lambda: RecentOutputsIndex().matches([1, 2], -1, 4), "max_matches"),
    (lambda: proposals_to_tensors([], width=-1), "width"),
    (lambda: ContextIndex().catch_up(-1), "limit"),
    (lambda: ContextIndex().truncate(-1), "length"),
])
def test_invalid_arguments_name_the_argument(make, name):
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        make()


def test_lead_chain_is_kept_whole_before_other_branches():
    """Many diverging occurrences of the suffix: by weight alone the nodes spread over
    short branches; ``lead_nodes`` keeps the best match's chain (prompt lookup's own)."""
    from vllm_graft.core.context import ContextIndex

    index = ContextIndex(min_ngram=2, max_ngram=2)
    context = []
    for branch in range(8):  # "7 8" followed by eight different continuations
        context += [7, 8, 100 + branch, 200 + branch, 300 + branch, 400 + branch, 9]
    index.extend(context + [7, 8])
    spread = index.propose(max_nodes=8, max_depth=4, max_matches=8)
    assert max(spread.depths) == 1  # eight first tokens, no chain
    led = index.propose(max_nodes=8, max_depth=4, max_matches=8, lead_nodes=4)
    # the most recent occurrence's continuation, whole, then the best other branches
    assert led.tokens[:4] == [107, 207, 307, 407]
    assert led.parents[:4] == [-1, 0, 1, 2]
    assert sorted(led.depths[4:]) == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="lead_nodes"):
        index.propose(max_nodes=8, max_depth=4, max_matches=8, lead_nodes=-1)


# ---- running peers' outputs ---------------------------------------------------------------


def _peer(prompt: list[int], output: list[int]) -> tuple[ContextIndex, int]:
    return _index(prompt + output), len(prompt)


def test_peer_outputs_match_only_in_outputs_longest_first():
    peers = PeerOutputs([_peer([1, 2, 3, 9], [1, 2, 4, 5]), _peer([7], [0, 1, 2, 3, 6, 6])])
    # (1, 2) in the first peer's prompt is skipped; its output's comes after the second
    # peer's longer (0, 1, 2) match
    assert peers.matches([0, 1, 2], max_matches=4, max_depth=3) == [
        (3, [3, 6, 6]), (2, [4, 5])]
    assert peers.matches([0, 1, 2], 4, 3, longer_than=2) == [(3, [3, 6, 6])]
    assert peers.matches([0, 1, 2], 4, 3, longer_than=3) == []
    assert not PeerOutputs([]) and PeerOutputs([], RecentOutputsIndex(max_tokens=10))


def test_peer_outputs_then_finished_ones_of_the_same_length():
    finished = RecentOutputsIndex(max_tokens=100)
    finished.add([5, 1, 2, 8, 8])
    finished.add([0, 1, 2, 7])
    peers = PeerOutputs([_peer([4], [1, 2, 6])], finished)
    assert peers.matches([0, 1, 2], 4, 2) == [(3, [7]), (2, [6]), (2, [8, 8])]


def test_a_chain_follows_a_shared_match_only_when_it_is_longer():
    own = _index([3, 1, 2, 4, 4, 9, 1, 2])  # (1, 2) once before: 4, 4
    longer = PeerOutputs([_peer([0], [9, 1, 2, 5, 5])])  # (9, 1, 2): three tokens
    as_long = PeerOutputs([_peer([0], [8, 1, 2, 6, 6])])  # (1, 2) only
    assert own.best_match(2) == (2, [4, 4])
    assert own.best_match(2, longer) == (3, [5, 5])
    assert own.best_match(2, as_long) == (2, [4, 4])  # own text first at equal length
    alone = _index([6, 8, 1, 2])  # no own match: the shared one of any length
    assert alone.best_match(2, as_long) == (3, [6, 6])
