"""Retrieval templates: which successor ranks to follow from the root, as data.

A template is a small tree over *ranks*: node ``j`` says "take the ``ranks[j]``-th
successor of the token at template node ``parents[j]``" (``-1`` = the root, the last
accepted token). Expanding it for a batch is one ``successor_gather`` per level.

The default template is the best-first expansion of the rank tree under a per-rank
acceptance prior (``GraftConfig.rank_prior``): a node's value is the product of the
priors along its path, so rank-0 chains run deep and wide while low ranks stay
shallow, the stage-adaptive, asymmetric shape the paper describes. Because nodes come
out in decreasing value, the template for a smaller budget is a *prefix* of the one for
a larger budget. Graft relies on that: requests pruned at different stages in one
batch share one expansion and differ only in how many template nodes they keep.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

from vllm_graft.core.successor import SuccessorMatrix


@dataclass(frozen=True)
class RetrievalTemplate:
    """A rank tree in parents-first order.

    parents[j]: template index of node j's parent, -1 for the root.
    ranks[j]:   which successor (0 = most likely) of the parent's token node j takes.
    """

    parents: tuple[int, ...]
    ranks: tuple[int, ...]
    depths: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if len(self.parents) != len(self.ranks):
            raise ValueError("template parents and ranks differ in length")
        depths: list[int] = []
        seen: set[tuple[int, int]] = set()
        for j, (p, r) in enumerate(zip(self.parents, self.ranks)):
            if not -1 <= p < j:
                raise ValueError(f"template node {j}: parent {p} must precede it (parents-first)")
            if r < 0:
                raise ValueError(f"template node {j}: negative rank {r}")
            if (p, r) in seen:
                raise ValueError(f"template node {j}: rank {r} appears twice under parent {p}")
            seen.add((p, r))
            depths.append(1 if p < 0 else depths[p] + 1)
        object.__setattr__(self, "depths", tuple(depths))

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def width(self) -> int:
        """Most children of any one node (the root included)."""
        counts: dict[int, int] = {}
        for p in self.parents:
            counts[p] = counts.get(p, 0) + 1
        return max(counts.values(), default=0)

    def level_widths(self) -> list[int]:
        widths = [0] * self.depth
        for d in self.depths:
            widths[d - 1] += 1
        return widths

    def prefix(self, n: int) -> RetrievalTemplate:
        return RetrievalTemplate(self.parents[:n], self.ranks[:n])

    @classmethod
    def best_first(cls, size: int, rank_prior: tuple[float, ...], *, max_depth: int,
                   max_width: int) -> RetrievalTemplate:
        """The ``size`` most valuable nodes of the rank tree (see the module docstring).

        Ties are broken by insertion order, so the template is deterministic.
        """
        if not 1 <= max_width <= len(rank_prior):
            raise ValueError(f"max_width {max_width} must be in [1, len(rank_prior)]")
        parents: list[int] = []
        ranks: list[int] = []
        counter = 0
        heap: list[tuple[float, int, int, int, int]] = []  # (-value, order, parent, rank, depth)
        for r in range(max_width):
            heapq.heappush(heap, (-rank_prior[r], counter, -1, r, 1))
            counter += 1
        while heap and len(parents) < size:
            neg_value, _, parent, rank, depth = heapq.heappop(heap)
            parents.append(parent)
            ranks.append(rank)
            me = len(parents) - 1
            if depth < max_depth:
                for r in range(max_width):
                    heapq.heappush(heap, (neg_value * rank_prior[r], counter, me, r, depth + 1))
                    counter += 1
        return cls(tuple(parents), tuple(ranks))


@dataclass
class RetrievedTrees:
    """A template expanded for a batch. Node ``j`` of request ``b`` is valid iff its token
    is not -1 (the matrix had that successor) and ``j < keep[b]``.

    tokens:  [B, n] int64, -1 where invalid
    parents: [B, n] int64 template parent index (-1 = root); same for every request
    depths:  [B, n] int64 (root = 0)
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor


class TemplateExpander:
    """Expands one template for a whole batch, one gather per level.

    The level structure (which template nodes sit at each depth, their parents and
    ranks) is turned into index tensors once, at construction, so a step does no
    Python work per node, and three tensor ops per level: on a GPU the expansion is
    bound by how many kernels it launches, not by their work.
    """

    def __init__(self, template: RetrievalTemplate, device: torch.device | str = "cpu"):
        self.template = template
        self.size = len(template)
        self.device = torch.device(device)
        parents = torch.tensor(template.parents, dtype=torch.long)
        ranks = torch.tensor(template.ranks, dtype=torch.int32)
        depths = torch.tensor(template.depths, dtype=torch.long)
        self.parents = parents.to(self.device)
        self.depths = depths.to(self.device)
        self.node_index = torch.arange(self.size, device=self.device)
        # per level: the token-table columns of its nodes and of their parents (column 0
        # holds the root, template node j is column j + 1), and the nodes' ranks
        self.levels: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for d in range(1, template.depth + 1):
            nodes = torch.nonzero(depths == d).flatten()
            self.levels.append(((nodes + 1).to(self.device), (parents[nodes] + 1).to(self.device),
                                ranks[nodes].to(self.device)))
        self._batch_ranks: list[torch.Tensor] = []  # each level's ranks, repeated
        self._ranks_batch = 0  # ... for batches up to this size

    def _ranks(self, batch: int) -> list[torch.Tensor]:
        """Each level's ranks for ``batch`` requests (request-major), as prefixes of a
        repetition kept for the largest batch so far: views, no op per step."""
        if batch > self._ranks_batch:
            self._ranks_batch = max(batch, 2 * self._ranks_batch)
            self._batch_ranks = [ranks.repeat(self._ranks_batch) for _, _, ranks in self.levels]
        return [ranks[:batch * len(level[2])]
                for ranks, level in zip(self._batch_ranks, self.levels)]

    def expand(self, matrix: SuccessorMatrix, root_tokens: torch.Tensor,
               keep: torch.Tensor | None = None) -> RetrievedTrees:
        """root_tokens: [B]; keep: [B] number of template nodes each request uses.

        Nodes beyond ``keep[b]`` are marked invalid once all levels are gathered: the
        template is parents-first, so the descendants of such a node lie beyond
        ``keep[b]`` too.
        """
        batch = root_tokens.shape[0]
        # int32, the matrix's own type: no conversion per level
        tokens = torch.full((batch, self.size + 1), -1, dtype=torch.int32, device=self.device)
        tokens[:, 0] = root_tokens
        for (columns, parent_columns, _), ranks in zip(self.levels, self._ranks(batch)):
            children = matrix.gather(tokens[:, parent_columns].reshape(-1), ranks)
            tokens[:, columns] = children.view(batch, -1)
        retrieved = tokens[:, 1:].long()
        if keep is not None:
            retrieved = retrieved.masked_fill(self.node_index[None, :] >= keep[:, None], -1)
        return RetrievedTrees(
            tokens=retrieved,
            parents=self.parents.expand(batch, -1),
            depths=self.depths.expand(batch, -1),
        )
