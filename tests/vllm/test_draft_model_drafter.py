"""Graft trees from an ordinary draft model (``"drafter": "draft_model"``). With the
target as its own draft model the drafter is always right: a chain-shaped tree (top_k 1)
must be accepted to its full depth at nearly every step, and the default tree must
stay lossless. (The random target's distributions are flat, so a wide tree spends its
budget on breadth rather than depth.)"""

from __future__ import annotations

from tests.vllm.conftest import graft_spec, mean_accepted, running_llm, spec_metrics
from tests.vllm.test_greedy_lossless import PROMPTS


def test_draft_model_trees_are_lossless_and_accepted(tiny_models, plain_outputs):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    chain = graft_spec(tiny_models.target, drafter="draft_model", variant="dense_tree",
                       top_k=1, budget=8)
    with running_llm(tiny_models.target, chain) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        metrics = spec_metrics(llm)
    assert [list(o.outputs[0].token_ids) for o in outputs] == plain_outputs
    assert mean_accepted(metrics) > 6.0, metrics  # a perfect drafter, depth 7

    tree = graft_spec(tiny_models.target, drafter="draft_model", budget=60)
    with running_llm(tiny_models.target, tree) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        metrics = spec_metrics(llm)
    assert [list(o.outputs[0].token_ids) for o in outputs] == plain_outputs
    assert metrics["graft_accepted_draft"] + metrics["graft_accepted_both"] > 0


class AlternatingGuard:
    """A throughput-guard stand-in: three plain steps, then two tree steps."""

    #: every choice is deliberate: the chain scout must not replace its plain steps
    measuring = True

    def __init__(self):
        self.steps = 0

    def choose(self, batch: int, unavailable=()):
        from vllm_graft.core.config import StepMode

        self.steps += 1
        return StepMode.TREE if self.steps % 5 >= 3 else StepMode.PLAIN

    def within_reach(self, batch: int, mode) -> bool:
        return True  # the drafter follows every request

    def requests_joined(self, joined: int, batch: int, scouted: bool = False) -> None:
        pass

    def counted_seconds(self, mode, batch: int, seconds: float) -> float:
        return seconds

    def credited_tokens(self, row_tokens: list[int], req_ids=None) -> float:
        return float(sum(row_tokens))

    def advance(self, req_ids, row_tokens) -> None:
        pass

    def observe(self, *args) -> None:
        pass

    def charge(self, mode, batch: int, seconds: float) -> None:
        pass


def install_alternating_guard(worker) -> None:
    worker.model_runner.drafter.guard = AlternatingGuard()


def perfect_drafter_under(tiny_models, install, read=None):
    """Greedy outputs and counters of chain-shaped trees (budget 8, depth 7) from the
    target as its own draft model, under the guard stand-in ``install`` puts in place;
    and what the worker function ``read`` returns afterwards (None without one)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    spec = graft_spec(tiny_models.target, drafter="draft_model", variant="dense_tree",
                      top_k=1, budget=8)
    with running_llm(tiny_models.target, spec) as llm:
        llm.collective_rpc(install)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        metrics = spec_metrics(llm)
        seen = None if read is None else llm.collective_rpc(read)[0]
    return [list(o.outputs[0].token_ids) for o in outputs], metrics, seen


def test_deferred_drafter_inputs_keep_a_perfect_drafter_perfect(tiny_models, plain_outputs):
    """While the guard decodes plainly the drafter is not run; the positions it missed
    are fed before the next speculative step's. Were any of them lost, the drafter's
    cache would have holes and this perfect drafter would stop being accepted to full
    depth; output stays identical either way."""
    outputs, metrics, _ = perfect_drafter_under(tiny_models, install_alternating_guard)
    assert outputs == plain_outputs
    assert metrics["graft_guard_plain_steps"] > metrics["graft_guard_tree_steps"] > 0
    assert mean_accepted(metrics) > 6.0, metrics  # every tree still accepted to depth 7


def test_deferred_rows_stay_contiguous_and_bounded():
    import torch

    from vllm_graft.vllm.proposer import DeferredRows

    rows = DeferredRows([], [])
    rows.append([10, 11], [5, 6], torch.tensor([[5.0], [6.0]]), limit=4)
    rows.append([12], [7], torch.tensor([[7.0]]), limit=4)
    assert rows.positions == [5, 6, 7] and rows.tokens == [10, 11, 12]
    rows.append([21, 22], [7, 8], torch.tensor([[7.5], [8.0]]), limit=4)  # 7 fed again
    assert rows.positions == [5, 6, 7, 8] and rows.tokens == [10, 11, 21, 22]
    assert rows.hidden.flatten().tolist() == [5.0, 6.0, 7.5, 8.0]
    rows.append([23], [9], torch.tensor([[9.0]]), limit=4)  # the oldest makes room
    assert rows.positions == [6, 7, 8, 9] and rows.hidden.flatten().tolist()[0] == 6.0
    rows.append([30], [12], torch.tensor([[12.0]]), limit=4)  # a gap: start again
    assert rows.positions == [12] and rows.tokens == [30] and rows.hidden.numel() == 1
    untokened = DeferredRows([], [])  # a draft model has no hidden input
    untokened.append([1, 2], [0, 1], None, limit=8)
    assert untokened.hidden is None and untokened.positions == [0, 1]


def test_deferred_rows_match_a_plain_list_of_rows():
    """Random appends (steps of one or more rows, re-fed positions, gaps, overflow):
    the chunked rows always equal a row-by-row reference of the same rules."""
    import random

    import torch

    from vllm_graft.vllm.proposer import DeferredRows

    rng = random.Random(0)
    rows, reference, next_position = DeferredRows([], []), {}, 0
    for _ in range(300):
        start = max(next_position + rng.choice([0, 0, 0, -1, -2, 3]), 0)
        count = rng.choice([1, 1, 1, 2, 5])
        positions = list(range(start, start + count))
        rows.append([p + 100 for p in positions], positions,
                    torch.tensor([[float(p), p + 0.5] for p in positions]), limit=16)
        if start - 1 not in reference:
            reference = {}
        reference = {p: v for p, v in reference.items() if p < start}
        reference.update({p: [float(p), p + 0.5] for p in positions})
        reference = dict(sorted(reference.items())[-16:])
        next_position = start + count
        assert rows.positions == list(reference)
        assert rows.tokens == [p + 100 for p in reference]
        assert rows.hidden.tolist() == list(reference.values())
        assert len(rows.chunks) <= 16


def test_a_perfect_drafter_keeps_whole_tail_chains(tiny_models, plain_outputs):
    """Graft-TAIL with the target as its own draft model: unpruned chains are the
    target's own continuation, so each is accepted whole (the drafter's chain positions
    and cache are right), and output stays identical."""
    from vllm import SamplingParams

    spec = graft_spec(tiny_models.target, drafter="draft_model", variant="tail", budget=6,
                      thresholds=[0.0, 0.0, 0.0])
    with running_llm(tiny_models.target, spec) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=48,
                                                       ignore_eos=True), use_tqdm=False)
        metrics = spec_metrics(llm)
    assert [list(o.outputs[0].token_ids) for o in outputs] == plain_outputs
    assert mean_accepted(metrics) > 6.0, metrics  # 6 drafts + the bonus token, nearly always
    assert metrics["graft_retrieved_nodes"] == 0


class ChainThenTreeGuard(AlternatingGuard):
    """Three copy-chain steps, then two tree steps."""

    def choose(self, batch: int, unavailable=()):
        from vllm_graft.core.config import StepMode

        self.steps += 1
        return StepMode.TREE if self.steps % 5 >= 3 else StepMode.CHAIN


def install_chain_then_tree_guard(worker) -> None:
    """The guard above, and a record of each drafter catch-up forward: the step's mode
    and whether any request it fed brought a decoding step's rows."""
    drafter = worker.model_runner.drafter
    drafter.guard = ChainThenTreeGuard()
    drafter.feeds_seen = []
    feed = drafter._feed

    def recording_feed(runner, settled, inputs):
        mode = worker.model_runner._graft_proposal.mode  # the round's, being proposed
        drafter.feeds_seen.append((mode.value, any(s.decoding for s in settled)))
        return feed(runner, settled, inputs)

    drafter._feed = recording_feed


def feeds_seen(worker) -> list:
    return worker.model_runner.drafter.feeds_seen


def test_chain_steps_defer_their_accepted_rows_to_the_next_tree(tiny_models, plain_outputs):
    """A copy chain step runs no drafter forward, however many of its nodes were
    accepted: their rows wait with the plain steps' and are fed before the next tree's.
    The perfect drafter is still accepted to full depth on the tree steps, so none of
    the deferred positions was lost; output stays identical."""
    outputs, metrics, feeds = perfect_drafter_under(tiny_models, install_chain_then_tree_guard,
                                                    feeds_seen)
    assert outputs == plain_outputs
    assert metrics["graft_chain_nodes"] > 0 and metrics["graft_guard_tree_steps"] > 0
    accepted_on_chains = metrics["graft_accepted_retrieved"] + metrics.get(
        "graft_accepted_context", 0)
    assert accepted_on_chains > 0, metrics  # chain steps that settled several rows
    assert feeds and all(mode == "tree" for mode, decoding in feeds if decoding), feeds
    tree_accepted = metrics["graft_accepted_draft"] + metrics.get("graft_accepted_both", 0)
    # depth 7 a tree, but for the last trees of each request, cut by its max_tokens
    assert tree_accepted / metrics["graft_trees_built"] > 5.5, metrics
