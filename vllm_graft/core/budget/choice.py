"""Which nodes to verify: the set that maximises expected emitted tokens per ms for the
whole batch (:func:`choose_nodes`), from path probabilities (:func:`path_probability`).

Expected emitted tokens of a step are ``batch + sum of the chosen nodes' path
probabilities`` (every request emits its bonus token), so ranking all candidates by
path probability and taking the best prefix is exact for a cost that depends on the
token count only; ties keep parents before children, so the choice is always a set of
subtrees under the roots. Choosing no node means plain decoding for that request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_graft.core.budget.acceptance_model import host_array
from vllm_graft.core.budget.cost import CostModel
from vllm_graft.core.config import StepMode



# The sizer's arithmetic runs on the host in numpy: its arrays are a batch of trees of a
# few dozen nodes, where each tensor op's dispatch costs more than its arithmetic, and it
# runs in every speculative step. The tensor functions below convert at their edges.
def path_probability(parents: torch.Tensor, depths: torch.Tensor, valid: torch.Tensor,
                     conditional: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` probability that each node lies on the accepted path: the product of
    the conditional acceptance probabilities along its ancestors (root, row 0: 1;
    invalid rows: 0). Nodes come parents first."""
    return torch.from_numpy(_path_probability(
        host_array(parents), host_array(depths), host_array(valid),
        host_array(conditional))).to(conditional.device)


def _path_probability(parents: np.ndarray, depths: np.ndarray, valid: np.ndarray,
                      conditional: np.ndarray) -> np.ndarray:
    prob = np.zeros(conditional.shape, dtype=np.float64)
    prob[:, 0] = 1.0
    top = int(depths.max()) if depths.size else 0
    parent_index = np.maximum(parents, 0)
    request = np.arange(prob.shape[0])[:, None]
    for depth in range(1, top + 1):
        level = valid & (depths == depth)
        parent_prob = prob[request, parent_index]
        prob = np.where(level, parent_prob * conditional, prob)
    return np.where(valid, prob, 0.0)


@dataclass
class Choice:
    #: [B, N] bool: nodes to verify (row 0, the root, always kept); None for host
    #: chains, which keep their first ``nodes_per_request`` nodes
    keep: torch.Tensor | None
    nodes_per_request: torch.Tensor  # [B], on the host
    expected_tokens: float  # emitted tokens per step predicted for the choice
    step_ms: float  # predicted step time
    #: each chosen request's predicted tokens (its root and its nodes' path
    #: probabilities), in ``nodes_per_request``'s order; kept by host chains' choices
    request_tokens: list[float] | None = None

    def step_tokens(self, batch: int) -> float:
        """Tokens the whole step of ``batch`` requests is predicted to emit: the chosen
        requests' expected tokens and one for each other request (decoded plainly)."""
        return self.expected_tokens + batch - self.nodes_per_request.numel()

    def tokens_by_request(self, batch: int) -> list[float]:
        """:meth:`step_tokens` split over the step's ``batch`` requests: the chosen
        requests' own and one for each other. What the throughput guard will credit
        the step with is its :meth:`ThroughputGuard.credited_tokens` of these."""
        if self.request_tokens is None:
            raise ValueError("this choice kept no tokens per request (a tree's)")
        return self.request_tokens + [1.0] * (batch - len(self.request_tokens))


def choose_nodes(path_prob: torch.Tensor, valid: torch.Tensor, cost: CostModel,
                 max_nodes: int | None = None, mode: StepMode = StepMode.TREE) -> Choice:
    """The nodes whose verification maximises expected emitted tokens per millisecond
    for the whole batch (module doc). ``path_prob``/``valid``: ``[B, N]``, row 0 the root;
    ``max_nodes`` caps the total; ``mode``: the kind of step, whose costs apply."""
    return _choose_nodes(host_array(path_prob), host_array(valid), cost, max_nodes, mode,
                         path_prob.device)


def _choose_nodes(path_prob: np.ndarray, valid: np.ndarray, cost: CostModel,
                  max_nodes: int | None, mode: StepMode, device) -> Choice:
    batch, rows = path_prob.shape
    candidate = valid.copy()
    candidate[:, 0] = False
    flat = np.where(candidate, path_prob, -1.0).reshape(-1)
    # stable descending sort: among equal probabilities, parents (earlier rows) first
    order = np.argsort(-flat, kind="stable")
    available = int(candidate.sum())
    if max_nodes is not None:
        available = min(available, max_nodes)
    best, expected, step_ms = _best_count(flat[order[:available]], batch, cost, mode)
    keep = np.zeros(batch * rows, dtype=bool)
    keep[order[:best]] = True
    keep = keep.reshape(batch, rows)
    keep[:, 0] = True
    keep_tensor = torch.from_numpy(keep).to(device)
    return Choice(keep=keep_tensor, nodes_per_request=torch.from_numpy(keep[:, 1:].sum(1)),
                  expected_tokens=expected, step_ms=step_ms)


def _best_count(ordered_prob, batch: int, cost: CostModel, mode: StepMode
                ) -> tuple[int, float, float]:
    """How many of the candidate nodes, best first (``ordered_prob``: their path
    probabilities in that order), to verify for the most expected tokens per ms, with
    the expected tokens and step time of that choice."""
    expected = batch + np.concatenate(([0.0], np.cumsum(ordered_prob, dtype=np.float64)))
    time = cost._step_ms(batch, np.arange(len(ordered_prob) + 1, dtype=np.float64), mode)
    best = int(np.argmax(expected / time))
    return best, float(expected[best]), float(time[best])
