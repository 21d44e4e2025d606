"""Copy chains: Graft's cheapest speculative step.

A copy chain is prompt lookup continued by retrieval: the continuation of the request's
best suffix match in its own context, and from where that ends (or from the root when
the context has no match) the successor matrix's top-1 walk, up to ``length`` tokens.
No drafter forward and no tree: the backend verifies a chain with its own causal
attention, so a chain step costs what a prompt-lookup step costs, and it still proposes
something on text that copies nothing. The throughput guard
(:class:`vllm_graft.core.budget.ThroughputGuard`) runs chain steps while they are
measured faster than both full Graft trees and plain decoding.
"""

from __future__ import annotations

import torch

from vllm_graft.core.hybrid import SOURCE_CONTEXT, SOURCE_RETRIEVED, HybridTree
from vllm_graft.core.successor import BatchView, SuccessorMatrix


def copied_to_tensor(copied: list[list[int]], length: int,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """``[B, length]`` int64: each request's copied continuation cut to ``length``,
    padded with -1. Built on the host and moved once."""
    rows = [tokens[:length] + [-1] * (length - min(len(tokens), length)) for tokens in copied]
    return torch.tensor(rows, dtype=torch.int64).reshape(len(copied), length).to(device)


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
