"""The sizer: each step's trees or chains cut to the nodes worth verifying, and the
acceptance models taught from what the target accepted (:class:`TreeSizer`)."""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import numpy as np
import torch

from vllm_graft.core.acceptance import AcceptanceResult
from vllm_graft.core.budget.acceptance_model import AcceptanceModel, host_array
from vllm_graft.core.budget.choice import Choice, _best_count, _choose_nodes, _path_probability
from vllm_graft.core.budget.cost import CostModel
from vllm_graft.core.budget.guard import ThroughputGuard
from vllm_graft.core.budget.scout import ChainScout
from vllm_graft.core.chain import HostChains
from vllm_graft.core.config import GraftConfig, StepMode
from vllm_graft.core.hybrid import UNKNOWN_SCORE, HybridTree, trim_tree


class TreeSizer:
    """Cuts each step's hybrid trees to the nodes worth verifying, and learns from what
    the target accepted. The builder's ``budget`` becomes the cap; whatever is cut,
    acceptance on the remaining tree is as lossless as on any tree."""

    def __init__(self, cost: CostModel, acceptance: AcceptanceModel | None = None,
                 chain_acceptance: AcceptanceModel | None = None):
        """``acceptance``: the model of tree steps' nodes; ``chain_acceptance``: of copy
        chains' (default: a fresh model with ``acceptance``'s settings), a population of
        its own (why: docs/design-log.md#sizer)."""
        self.cost = cost
        self.acceptance = acceptance or AcceptanceModel()
        self.chain_acceptance = chain_acceptance or replace(self.acceptance)

    def acceptance_for(self, mode: StepMode) -> AcceptanceModel:
        """The acceptance model of ``mode``'s nodes."""
        return self.chain_acceptance if mode is StepMode.CHAIN else self.acceptance

    def _score(self, tree: HybridTree, score: torch.Tensor | None) -> np.ndarray:
        """``score``, else the tree's own (:attr:`HybridTree.score`), else unknown; on
        the host."""
        if score is None:
            score = tree.score
        if score is None:
            return np.full(tuple(tree.tokens.shape), UNKNOWN_SCORE)
        return host_array(score)

    def choose(self, tree: HybridTree, score: torch.Tensor | None = None,
               mode: StepMode = StepMode.TREE) -> Choice:
        """``mode``: the kind of step the tree is verified in (its costs apply). A copy-chain
        step cuts its host chains with :meth:`trim_chains`, which makes the same choice."""
        valid = host_array(tree.valid)
        model = self.acceptance_for(mode)
        conditional = model._optimistic_at(model._bucket(tree.source, tree.depths,
                                                         self._score(tree, score)))
        prob = _path_probability(host_array(tree.parents), host_array(tree.depths), valid,
                                 conditional)
        return _choose_nodes(prob, valid, self.cost, None, mode, tree.tokens.device)

    def trim_chains(self, chains: HostChains, mode: StepMode = StepMode.CHAIN
                    ) -> tuple[HostChains, Choice]:
        """:meth:`trim` of host chains (:class:`vllm_graft.core.chain.HostChains`): the
        same choice, its arithmetic over Python lists. Path probabilities fall along a
        chain, so the best nodes of the batch are a prefix of each chain; among equal
        probabilities the earlier request and the parent come first, as in
        :func:`choose_nodes`. The choice's ``keep`` is None: each chain keeps its first
        ``nodes_per_request`` nodes."""
        model = self.acceptance_for(mode)
        optimistic = model.optimistic_lookup()
        odds: dict[tuple, float] = {}  # a batch's chains share a few classes of nodes
        candidates = []  # (path probability, request), request-major, parents first
        for request, (tags, scores) in enumerate(zip(chains.source, chains.score)):
            prob = 1.0
            for depth in range(1, len(tags)):
                node = (tags[depth], depth, scores[depth])
                factor = odds.get(node)
                if factor is None:
                    factor = odds[node] = optimistic(model.class_of(*node))
                prob *= factor
                candidates.append((prob, request))
        candidates.sort(key=lambda candidate: -candidate[0])  # stable
        batch = len(chains.tokens)
        best, expected, step_ms = _best_count([prob for prob, _ in candidates], batch,
                                              self.cost, mode)
        nodes, tokens = [0] * batch, [1.0] * batch
        for prob, request in candidates[:best]:
            nodes[request] += 1
            tokens[request] += prob
        return chains.cut(nodes), Choice(keep=None, nodes_per_request=torch.tensor(nodes),
                                         expected_tokens=expected, step_ms=step_ms,
                                         request_tokens=tokens)

    def trim(self, tree: HybridTree, score: torch.Tensor | None = None,
             mode: StepMode = StepMode.TREE) -> tuple[HybridTree, Choice]:
        """The tree cut to :meth:`choose`'s nodes (a chain to its first ones; a chain
        step's own chains are cut by :meth:`trim_chains`)."""
        choice = self.choose(tree, score, mode)
        return trim_tree(tree, choice.keep), choice

    def observe_chains(self, chains, mode: StepMode = StepMode.CHAIN) -> None:
        """:meth:`observe` for verified chains as host lists
        (:meth:`AcceptanceModel.observe_chains`); ``mode``: the kind of step that
        verified them."""
        self.acceptance_for(mode).observe_chains(chains)

    def observe(self, tree: HybridTree, result: AcceptanceResult,
                score: torch.Tensor | None = None, mode: StepMode = StepMode.TREE) -> None:
        """Every verified node whose parent lay on the accepted path was a trial;
        ``mode``: the kind of step that verified the tree."""
        batch, rows = tree.tokens.shape
        on_path = np.zeros((batch, rows + 1), dtype=bool)
        on_path[:, 0] = True
        accepted_rows = host_array(result.accepted_rows)
        # fancy indexing, not numpy's *_along_axis helpers: their Python wrappers cost
        # more than the indexing on trees this small
        request = np.arange(batch)[:, None]
        on_path[request, np.where(accepted_rows >= 0, accepted_rows, rows)] = True
        on_path = on_path[:, :rows]
        parents = host_array(tree.parents)
        parent_on_path = on_path[request, np.maximum(parents, 0)]
        trial = host_array(tree.valid) & parent_on_path & (parents >= 0)
        self.acceptance_for(mode).observe(tree.source, tree.depths, self._score(tree, score),
                                          trial, on_path)


class BudgetSystems(NamedTuple):
    """What budget auto runs with: the sizer always, the guard with ``auto_guard``, the
    scout where the guard chooses between copy chains and plain decoding."""

    sizer: TreeSizer
    guard: ThroughputGuard | None
    scout: ChainScout | None


def build_budget_systems(config: GraftConfig, cost: CostModel,
                         calibration=None) -> BudgetSystems:
    """The sizer, guard and scout ``config`` asks for, over the step costs ``cost``;
    the acceptance models start from ``calibration``'s tallies where it has them
    (:class:`vllm_graft.core.calibration.Calibration`, or None)."""
    acceptance, chain_acceptance = AcceptanceModel(), AcceptanceModel()
    if calibration is not None and calibration.acceptance is not None:
        acceptance.seed(calibration.acceptance)
    if calibration is not None and calibration.chain_acceptance is not None:
        chain_acceptance.seed(calibration.chain_acceptance)
    sizer = TreeSizer(cost, acceptance, chain_acceptance)
    if not config.auto_guard:
        return BudgetSystems(sizer, None, None)
    guard = ThroughputGuard(modes=config.guard_modes, **config.guard.model_dump())
    scouts = {StepMode.CHAIN, StepMode.PLAIN} <= set(config.guard_modes)
    scout = ChainScout(every=config.chain_scout_every) \
        if scouts and config.chain_scout_every else None
    return BudgetSystems(sizer, guard, scout)
