"""Graft-TAIL chains: the confident drafted prefix is kept, the unsure tail retrieved."""

import math

import pytest
import torch

from tests.core.helpers import TableDrafter
from vllm_graft.core.acceptance import SamplingBatch, accept_tree
from vllm_graft.core.config import GraftConfig, GraftConfigError
from vllm_graft.core.graft import GraftTreeBuilder
from vllm_graft.core.hybrid import SOURCE_DRAFT, SOURCE_PAD, SOURCE_RETRIEVED
from vllm_graft.core.successor import SuccessorMatrix
from vllm_graft.core.tail import TailChainDrafter, pad_chain, step_thresholds
from vllm_graft.core.chain import build_chains

VOCAB = 64


def _matrix(rows=VOCAB):
    """Token t's top successor is t + 7 (mod VOCAB), for the first ``rows`` tokens."""
    m = SuccessorMatrix.empty(VOCAB, 4)
    tokens = torch.arange(rows)
    m.update_(tokens, torch.stack([(tokens + 7 + r) % VOCAB for r in range(4)], 1))
    return m


def test_step_thresholds_hold_the_latest_checkpoint():
    assert step_thresholds((0, 1, 5), (0.4, 0.3, 0.1), 7) == (0.4, 0.3, 0.3, 0.3, 0.3, 0.1,
                                                               0.1)
    assert step_thresholds((2,), (0.5,), 4) == (0.0, 0.0, 0.5, 0.5)
    with pytest.raises(ValueError, match="one threshold per checkpoint"):
        step_thresholds((0, 1), (0.5,), 3)


def test_drafting_stops_at_the_first_unsure_step_and_drops_that_token():
    # after token 1 the drafter's top-1 has p = 0.05: a chain reaching 1 stops there
    drafter = TableDrafter(VOCAB, 1, confidence={t: 0.9 for t in range(VOCAB)} | {1: 0.05})
    tail = TailChainDrafter(4, (0.5, 0.5, 0.5, 0.5))
    roots = torch.tensor([1, 10, 62])  # 62 -> 63 -> 0 -> 1: the 4th step follows token 1
    draft = tail.draft(roots, drafter)
    assert draft.tokens.tolist() == [[-1] * 4, [11, 12, 13, 14], [63, 0, 1, -1]]
    assert draft.steps.tolist() == [1, 4, 4]
    assert draft.stop_step.tolist() == [0, 4, 3]
    assert math.isclose(float(draft.confidence[1, 3]), 0.9 ** 4, rel_tol=1e-5)
    assert torch.isnan(draft.confidence[0, 1:]).all()
    # each drafter call sees only the requests still drafting, one node each
    assert [c.active.tolist() for c in drafter.calls] == [[0, 1, 2], [1, 2], [1, 2], [1, 2]]
    assert all(c.node_ids.shape == (c.active.numel(), 1) for c in drafter.calls)


def test_without_pruning_the_whole_chain_is_drafted():
    drafter = TableDrafter(VOCAB, 3, sharpness=0.1)
    draft = TailChainDrafter(5, (1.0,) * 5).draft(torch.tensor([3, 4]), drafter, prune=False)
    assert (draft.tokens >= 0).all() and draft.steps.tolist() == [5, 5]
    expected = drafter.logprobs[3].argmax()
    assert int(draft.tokens[0, 0]) == int(expected)  # the top-1 of the drafter's k


@pytest.mark.parametrize("length", [1, 3, 8])
def test_tail_variant_keeps_the_confident_prefix_and_walks_the_matrix(length):
    config = GraftConfig(variant="tail", budget=length, thresholds=(0.5, 0.5, 0.5))
    builder = GraftTreeBuilder(config, _matrix())
    drafter = TableDrafter(VOCAB, config.top_k,
                           confidence={t: 0.99 for t in range(VOCAB)} | {12: 0.05})
    roots = torch.tensor([10, 12, 30])
    chain, stats = builder.build(roots, drafter)
    assert chain.tokens.shape == (3, length + 1)
    assert (chain.num_nodes == length + 1).all()  # a full matrix never misses
    # request 0: 10 -> 11 -> 12 drafted, then 12 is unsure: 12 + 7 = 19, 26, ...
    drafted = min(length, 2)
    expect = [10, *range(11, 11 + drafted)]
    while len(expect) < length + 1:
        expect.append((expect[-1] + 7) % VOCAB)
    assert chain.tokens[0].tolist() == expect
    assert chain.source[0, 1:drafted + 1].eq(SOURCE_DRAFT).all()
    assert chain.source[0, drafted + 1:].eq(SOURCE_RETRIEVED).all()
    # request 1 is unsure at once: all retrieved
    assert chain.tokens[1, 1].item() == 19 and stats.draft_nodes[1] == 0
    assert chain.parents[2].tolist() == list(range(-1, length))
    assert stats.draft_steps.tolist() == [min(length, 3), 1, length]
    assert stats.stage.tolist() == [1 if length >= 3 else 3, 0, 3]
    assert (stats.draft_nodes + stats.retrieved_nodes == length).all()


def test_tail_stage_names_the_checkpoint_that_stopped_it():
    config = GraftConfig(variant="tail", budget=8, thresholds=(0.5, 0.5, 0.5))
    builder = GraftTreeBuilder(config, _matrix())
    drafter = TableDrafter(VOCAB, 1, confidence={t: 0.99 for t in range(VOCAB)}
                           | {12: 0.05})
    # stops at step 0 (root 12), step 2 (10 -> 11 -> 12), step 6 (6 -> ... -> 12), never
    _, stats = builder.build(torch.tensor([12, 10, 6, 40]), drafter)
    assert stats.stage.tolist() == [0, 1, 2, 3]


def test_a_matrix_miss_ends_the_chain_and_a_cold_matrix_leaves_the_draft():
    config = GraftConfig(variant="tail", budget=6, thresholds=(0.5, 0.5, 0.5))
    builder = GraftTreeBuilder(config, SuccessorMatrix.empty(VOCAB, 4))
    drafter = TableDrafter(VOCAB, 1, confidence={t: 0.9 for t in range(VOCAB)} | {3: 0.05})
    chain, stats = builder.build(torch.tensor([1, 3]), drafter)
    assert chain.tokens[0].tolist() == [1, 2, 3, -1, -1, -1, -1]
    assert chain.num_nodes.tolist() == [3, 1]
    assert stats.retrieval_hits.tolist() == [0, 0]
    assert stats.retrieval_lookups.tolist() == [1, 1]


def test_fixed_shape_pads_every_chain_to_its_length():
    config = GraftConfig(variant="tail", budget=6, thresholds=(0.5, 0.5, 0.5),
                         tree_shape="fixed")
    builder = GraftTreeBuilder(config, SuccessorMatrix.empty(VOCAB, 4))
    drafter = TableDrafter(VOCAB, 1, confidence={t: 0.9 for t in range(VOCAB)} | {3: 0.05})
    chain, stats = builder.build(torch.tensor([1, 3, 63]), drafter)
    assert chain.num_nodes.tolist() == [7, 7, 7] and chain.valid.all()
    assert chain.tokens[0].tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert chain.source[0].tolist() == [0, 1, 1] + [SOURCE_PAD] * 4
    assert chain.tokens[1].tolist() == [3, 4, 5, 6, 7, 8, 9]
    assert chain.tokens[2, 1].item() == 0  # 63 + 1 wraps around the vocabulary
    assert chain.parents.tolist() == [list(range(-1, 6))] * 3
    assert stats.padded_nodes.tolist() == [4, 6, 6 - stats.draft_nodes[2].item()]


def test_pad_chain_keeps_a_full_chain():
    chain = build_chains(torch.tensor([5]), torch.tensor([[6, 7]]), _matrix(), 2)
    assert torch.equal(pad_chain(chain, VOCAB).tokens, chain.tokens)


@pytest.mark.parametrize("data, key", [
    ({"variant": "tail", "context": True}, "context"),
    ({"variant": "tail", "budget": 40}, "at most 32"),
])
def test_tail_config_refuses_what_it_cannot_do(data, key):
    with pytest.raises(GraftConfigError, match=key):
        GraftConfig.from_dict(data)


def test_tail_defaults():
    config = GraftConfig.from_dict({"variant": "tail"})
    assert config.budget == 5 and config.auto_size  # "auto": 5 tokens as a cap
    assert config.draft_top_k == 1 and not config.uses_context
    assert GraftConfig.from_dict({"variant": "tail", "context": False}).budget == 5
    assert GraftConfig().draft_top_k == 10


def test_tail_chains_are_accepted_losslessly_like_any_tree():
    """Greedy acceptance of a tail chain: the accepted rows are the longest prefix the
    target's argmax agrees with, whichever source proposed them."""
    config = GraftConfig(variant="tail", budget=4, thresholds=(0.5, 0.5, 0.5))
    builder = GraftTreeBuilder(config, _matrix())
    drafter = TableDrafter(VOCAB, 1, confidence={t: 0.9 for t in range(VOCAB)} | {11: 0.05})
    chain, _ = builder.build(torch.tensor([10]), drafter)
    assert chain.tokens[0].tolist() == [10, 11, 18, 25, 32]
    # the target agrees with 11 and 18, then prefers 40 over 25
    logits = torch.full((1, 5, VOCAB), -10.0)
    for row, token in enumerate([11, 18, 40, 0, 0]):
        logits[0, row, token] = 10.0
    result = accept_tree(chain, logits, SamplingBatch.greedy(1))
    assert result.accepted_rows[0].tolist()[:2] == [1, 2]
    assert int(result.num_accepted[0]) == 2
    assert result.output_tokens[0, :3].tolist() == [11, 18, 40]


def test_a_block_keeps_its_confident_prefix_and_is_padded_to_its_length():
    """Graft-TAIL on a block drafter: the block's cumulative confidence cuts it where it
    first falls below the threshold in force; retrieval continues, padding fills."""
    config = GraftConfig(variant="tail", drafter="dflash", budget=4,
                         thresholds=(0.5, 0.5, 0.5))
    builder = GraftTreeBuilder(config, _matrix(rows=40))
    block = torch.tensor([[11, 12, 13, 14], [21, 22, 23, 24], [60, 61, 62, 63]])
    p = torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.9, 0.4, 0.9, 0.9], [0.3, 0.9, 0.9, 0.9]])
    chain, stats = builder.build_from_block(torch.tensor([10, 20, 49]), block, p.log())
    # 0.9 ** 4 = 0.66 >= 0.5: the whole block; 0.9 * 0.4 < 0.5 at step 1: 21, then the
    # matrix walk 28, 35, 42; 0.3 < 0.5 at step 0, and root 49 has no matrix row (only
    # tokens < 40 have successors): padding, tokens 50, 51, ... after the root
    assert chain.tokens[0].tolist() == [10, 11, 12, 13, 14]
    assert chain.tokens[1].tolist() == [20, 21, 28, 35, 42]
    assert chain.source[1].tolist() == [0, SOURCE_DRAFT, SOURCE_RETRIEVED, SOURCE_RETRIEVED,
                                        SOURCE_RETRIEVED]
    assert chain.tokens[2].tolist() == [49, 50, 51, 52, 53]
    assert chain.source[2, 1:].eq(SOURCE_PAD).all()
    assert chain.valid.all() and stats.draft_steps.tolist() == [1, 1, 1]
    assert stats.stage.tolist() == [3, 1, 0]
    with pytest.raises(ValueError, match="blocks of 4 tokens"):
        builder.build_from_block(torch.tensor([1]), block[:1, :3], p[:1, :3])


@pytest.mark.parametrize("data, message", [
    ({"drafter": "dflash", "variant": "tail"}, "blocks of a fixed size"),
    ({"drafter": "dflash", "budget": 8}, "needs variant 'tail'"),
    ({"drafter": "dflash", "budget": 8, "variant": "tail", "auto_size": True},
     "auto_size is not available"),
])
def test_dflash_config_is_refused_where_it_cannot_work(data, message):
    with pytest.raises(GraftConfigError, match=message):
        GraftConfig.from_dict(data)
