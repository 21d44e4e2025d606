"""Copy chains: Graft's cheapest speculative step.

A copy chain is prompt lookup continued by retrieval: the continuation of the request's
best suffix match in its own context, and from where that ends (or from the root when
the context has no match) the successor matrix's top-1 walk, up to ``length`` tokens.
No drafter forward and no tree: the backend verifies a chain with its own causal
attention, so a chain step costs what a prompt-lookup step costs, and it still proposes
something on text that copies nothing. The throughput guard
(:class:`vllm_graft.core.budget.ThroughputGuard`) runs chain steps while they are
measured faster than both full Graft trees and plain decoding. A chain step builds its
chains on the host (:func:`walk_chains`, :class:`HostChains`); Graft-TAIL grows its
drafted prefixes into chains as tensors (:func:`build_chains`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_graft.core.hybrid import SOURCE_CONTEXT, SOURCE_RETRIEVED, UNKNOWN_SCORE, HybridTree
from vllm_graft.core.successor import BatchView, SuccessorMatrix


def build_chains(roots: torch.Tensor, copied: torch.Tensor,
                 matrix: SuccessorMatrix | BatchView, length: int,
                 max_walk: int | None = None, *,
                 prefix_source: int = SOURCE_CONTEXT) -> HybridTree:
    """One chain of up to ``length`` nodes under each root.

    roots: ``[B]`` token ids; copied: ``[B, C]`` copied continuations, -1 padded (each a
    prefix: no token after a -1). Node ``j`` is the copied token when there is one,
    otherwise the top successor of node ``j - 1``, for at most ``max_walk`` nodes after
    the copied ones (None: up to ``length``); a miss ends the chain. Sources:
    ``prefix_source`` for the given prefix (``SOURCE_CONTEXT`` for copied context,
    ``SOURCE_DRAFT`` for Graft-TAIL's drafted prefix), ``SOURCE_RETRIEVED`` for walked
    ones. Batched: one matrix gather per walked position for the whole batch (at most
    ``max_walk``), no host read.
    """
    if length < 0 or (max_walk is not None and max_walk < 0):
        raise ValueError(f"chain length and max_walk must be >= 0, got {length}, {max_walk}")
    if roots.dim() != 1 or copied.dim() != 2 or copied.shape[0] != roots.shape[0]:
        raise ValueError(f"build_chains needs roots [B] and copied [B, C], got "
                         f"{tuple(roots.shape)} and {tuple(copied.shape)}")
    batch, device = roots.shape[0], roots.device
    # one scratch column past the chain takes the walk's writes beyond ``length``
    tokens = torch.full((batch, length + 2), -1, dtype=torch.int64, device=device)
    tokens[:, 0] = roots
    width = min(length, copied.shape[1])
    prefix = copied[:, :width].to(device)
    tokens[:, 1:width + 1] = prefix
    num_copied = (prefix >= 0).sum(1, keepdim=True)
    walks = length if max_walk is None else min(max_walk, length)
    # the walk's columns: right after each chain's copied tokens
    columns = (num_copied + 1 + torch.arange(walks, device=device)).clamp(max=length + 1)
    last = tokens.gather(1, num_copied).squeeze(1)  # the root, or the last copied token
    ranks = torch.zeros(batch, dtype=torch.int64, device=device)
    for step in range(walks):  # a miss walks on from -1, which gathers -1
        last = matrix.gather(last, ranks).to(torch.int64)
        tokens.scatter_(1, columns[:, step:step + 1], last.unsqueeze(1))
    tokens = tokens[:, :length + 1].contiguous()
    rows = torch.arange(length + 1, device=device)
    walked = (rows > num_copied) & (tokens >= 0)
    source = torch.where(walked, SOURCE_RETRIEVED,
                         torch.where((rows > 0) & (tokens >= 0), prefix_source, 0)
                         ).to(torch.uint8)
    valid = tokens >= 0
    parents = torch.where(valid, rows - 1, -1).expand(batch, -1).contiguous()
    depths = torch.where(valid, rows, 0).expand(batch, -1).contiguous()
    return HybridTree(tokens=tokens, parents=parents, depths=depths, valid=valid,
                      source=source, num_nodes=valid.sum(1))


@dataclass
class HostChains:
    """A batch's copy chains as host lists, what :func:`build_chains` builds as tensors:
    per request its tokens (root first), the source tag of each (root: 0) and its score
    for the acceptance model (root: :data:`UNKNOWN_SCORE`). A copy-chain step builds,
    sizes and schedules a few dozen such numbers; as lists that costs a fraction of the
    tensor operations it would take, each a dispatch on caches the forward has just
    flushed. Row ``j`` of a chain is the child of row ``j - 1``."""

    tokens: list[list[int]]
    source: list[list[int]]
    score: list[list[float]]

    def cut(self, nodes: list[int]) -> HostChains:
        """Each chain cut to its root and first ``nodes[b]`` nodes."""
        return HostChains(*([row[:n + 1] for row, n in zip(field, nodes)]
                            for field in (self.tokens, self.source, self.score)))

    def to_tree(self, device: torch.device | str = "cpu") -> HybridTree:
        """The chains as a batch :class:`HybridTree` (padded to the longest), one tensor
        per field."""
        rows = max((len(tokens) for tokens in self.tokens), default=1)
        lengths = [len(tokens) for tokens in self.tokens]

        def tensor(field, fill, dtype):
            return torch.tensor([row + [fill] * (rows - len(row)) for row in field],
                                dtype=dtype, device=device).view(-1, rows)

        # every field from lists: one tensor each, no tensor arithmetic
        return HybridTree(
            tokens=tensor(self.tokens, -1, torch.int64),
            parents=tensor([list(range(-1, n - 1)) for n in lengths], -1, torch.int64),
            depths=tensor([list(range(n)) for n in lengths], 0, torch.int64),
            valid=tensor([[True] * n for n in lengths], False, torch.bool),
            source=tensor(self.source, 0, torch.uint8),
            num_nodes=torch.tensor(lengths, dtype=torch.int64, device=device),
            score=tensor(self.score, 0.0, torch.float32))


def walk_chains(roots: list[int], copied: list[list[int]], matrix: SuccessorMatrix | BatchView,
                length: int, max_walk: int | None = None,
                copied_scores: list[float] | None = None) -> HostChains:
    """:func:`build_chains` (``prefix_source`` :data:`SOURCE_CONTEXT`) on host lists: each
    request's copied continuation cut to ``length``, then the successor matrix's top-1
    walk from its last token for at most ``max_walk`` more nodes, ending at a miss.
    One matrix gather per walked position for the whole batch. ``copied_scores``: each
    request's score of its copied nodes (:func:`vllm_graft.core.context.match_score`;
    None: unknown); walked nodes score :data:`UNKNOWN_SCORE`. Scores are float32 values,
    as the tensor path keeps them."""
    if length < 0 or (max_walk is not None and max_walk < 0):
        raise ValueError(f"chain length and max_walk must be >= 0, got {length}, {max_walk}")
    if len(copied) != len(roots) or (copied_scores is not None
                                     and len(copied_scores) != len(roots)):
        raise ValueError(f"walk_chains needs one copied continuation and score per root, "
                         f"got {len(copied)} and "
                         f"{'none' if copied_scores is None else len(copied_scores)} "
                         f"for {len(roots)}")
    tokens = [[root] + list(prefix[:length]) for root, prefix in zip(roots, copied)]
    num_copied = [len(row) - 1 for row in tokens]
    walks = length if max_walk is None else min(max_walk, length)
    # each chain walks until it is full, its walk is spent or the matrix misses
    left = [min(walks, length - n) for n in num_copied]
    for _ in range(walks):
        if not any(left):
            break
        last = torch.tensor([row[-1] if more else -1 for row, more in zip(tokens, left)],
                            dtype=torch.int64, device=matrix.device)
        found = matrix.gather(last, torch.zeros_like(last)).tolist()
        for b, token in enumerate(found):
            if left[b]:
                if token < 0:
                    left[b] = 0
                else:
                    tokens[b].append(int(token))
                    left[b] -= 1
    if copied_scores is None:
        copied_scores = [UNKNOWN_SCORE] * len(roots)
    source, score = [], []
    for row, n, copied_score in zip(tokens, num_copied, copied_scores):
        walked = len(row) - 1 - n
        source.append([0] + [SOURCE_CONTEXT] * n + [SOURCE_RETRIEVED] * walked)
        score.append([UNKNOWN_SCORE] + [float(np.float32(copied_score))] * n
                     + [UNKNOWN_SCORE] * walked)
    return HostChains(tokens, source, score)
