"""Bit-packed tree masks: one int64 per tree row, bit ``j`` set when the row may attend
to tree position ``j`` (its ancestors and itself). A tree of up to 64 nodes fits one word,
which the attention kernel reads once per row instead of a ``[N, N]`` boolean matrix."""

from __future__ import annotations

import torch

MAX_TREE_NODES = 64


def pack_ancestor_bits(visible: torch.Tensor) -> torch.Tensor:
    """Pack a boolean ``[..., N, N]`` mask (row may see column) into ``[..., N]`` int64.

    Raises:
        ValueError: the mask is not square in its last two dimensions, or N > 64.
    """
    if visible.dim() < 2 or visible.shape[-1] != visible.shape[-2]:
        raise ValueError(f"tree mask must be [..., N, N], got shape {tuple(visible.shape)}")
    return pack_row_bits(visible)


def pack_row_bits(visible: torch.Tensor) -> torch.Tensor:
    """Pack ``[..., M]`` booleans (what a row may see among ``M <= 64`` tree positions)
    into ``[...]`` int64: bit ``j`` for position ``j``. The rows need not be all of the
    tree (a drafter step's rows see earlier steps' rows too).

    Raises:
        ValueError: M > 64.
    """
    nodes = visible.shape[-1]
    if nodes > MAX_TREE_NODES:
        raise ValueError(f"tree mask has {nodes} nodes; at most {MAX_TREE_NODES} fit one word")
    weights = torch.ones((), dtype=torch.int64, device=visible.device) << torch.arange(
        nodes, dtype=torch.int64, device=visible.device)
    # distinct bits never carry, so the sum is exact even where bit 63 wraps the sign
    return (visible.to(torch.int64) * weights).sum(-1)


def unpack_ancestor_bits(bits: torch.Tensor, nodes: int) -> torch.Tensor:
    """Inverse of :func:`pack_ancestor_bits`: ``[...]`` int64 to ``[..., nodes]`` bool."""
    shifts = torch.arange(nodes, dtype=torch.int64, device=bits.device)
    return ((bits.unsqueeze(-1) >> shifts) & 1).bool()
