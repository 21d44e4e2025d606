"""Pure-torch reference implementations of the successor-matrix ops.

They define the semantics the compiled ops of :mod:`vllm_graft.ops` must match
(tests compare them element by element) and give benchmarks a baseline. They
take the same tensors as the compiled ops but never validate ids: an
out-of-range id makes torch raise its own indexing error, or is silently used.
"""

from __future__ import annotations

import torch

EMPTY = -1


def reference_successor_gather(
    successors: torch.Tensor, parent_tokens: torch.Tensor, ranks: torch.Tensor
) -> torch.Tensor:
    """``successors[parent_tokens[i], ranks[i]]``, or -1 where ``parent_tokens[i] == -1``.

    successors: [V, k] int32; parent_tokens, ranks: [N] int32 or int64.
    Returns [N] int32.
    """
    has_parent = parent_tokens >= 0
    # Parentless nodes read row 0 and are masked out below; this avoids a
    # boolean-mask gather, which would synchronise with the device.
    rows = parent_tokens.clamp(min=0).long()
    values = successors[rows, ranks.long()]
    return torch.where(has_parent, values, EMPTY)


def reference_successor_update_(
    successors: torch.Tensor, tokens: torch.Tensor, next_tokens: torch.Tensor
) -> None:
    """``successors[tokens[i], :] = next_tokens[i, :]`` for every ``tokens[i] != -1``, in place.

    successors: [V, k] int32; tokens: [N] int32/int64; next_tokens: [N, k]
    int32/int64. When several nodes carry the same token the node with the
    highest index wins, as if rows were written one by one in index order.
    """
    vocab_size = successors.shape[0]
    node_index = torch.arange(tokens.shape[0], device=tokens.device)
    valid = tokens >= 0
    # Padding nodes are parked on an extra row V so they never win a real row.
    rows = torch.where(valid, tokens.long(), vocab_size)
    last_writer = torch.full(
        (vocab_size + 1,), -1, dtype=torch.long, device=tokens.device
    ).scatter_reduce_(0, rows, node_index, reduce="amax")
    wins = valid & (last_writer[rows] == node_index)
    # Winning rows are distinct, so this indexed write has no ordering ambiguity.
    successors[rows[wins]] = next_tokens[wins].to(torch.int32)


def reference_logits_topk(logits: torch.Tensor, k: int,
                          rows: torch.Tensor | None = None) -> torch.Tensor:
    """The ``k`` best token ids of ``logits[rows]`` in :func:`vllm_graft.ops.logits_topk`'s
    order (larger first, equal logits by lower id, NaN above every number); ``rows[i] ==
    -1`` gives a row of -1. Returns [N, k] int64.

    ``torch.topk`` finds the right set unless the k-th value is tied outside it (then
    it may keep a higher id) and leaves ties unordered: its k winners are re-ordered by
    (value, id), and rows with a tie across the boundary or a NaN are sorted whole with
    a stable sort, which keeps equal values in id order and puts NaN first."""
    if rows is None:
        rows = torch.arange(logits.shape[0], device=logits.device)
    picked = logits[rows.clamp(min=0).long()]
    picked = picked.double() if picked.dtype == torch.float64 else picked.float()
    values, order = picked.topk(k, dim=-1)
    by_id = order.sort(dim=-1).indices  # ids ascending, then a stable sort by value
    order = order.gather(1, by_id)
    order = order.gather(1, picked.gather(1, order).sort(dim=-1, descending=True,
                                                         stable=True).indices)
    kth = values[:, -1:]
    boundary_tie = (picked == kth).sum(1) > (values == kth).sum(1)
    slow = boundary_tie | picked.isnan().any(1)
    if bool(slow.any()):
        whole = picked[slow].sort(dim=-1, descending=True, stable=True).indices[:, :k]
        order[slow] = whole
    return torch.where((rows >= 0).unsqueeze(1), order, EMPTY)
