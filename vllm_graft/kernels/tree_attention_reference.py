"""Tree attention over paged K/V in plain torch: the specification the Triton kernel is
tested against, and the fallback where it cannot run.

The batch layout is vLLM's (a flattened batch of query rows, the K/V of those rows
already written to the paged cache):

* ``query`` ``[T, Hq, D]``: every query row of the forward, request after request.
* ``key_cache`` / ``value_cache`` ``[num_blocks, block_size, Hkv, D]``, any strides: views
  of vLLM's cache (FlashAttention's ``kv_cache[0]`` / ``kv_cache[1]``, or the other
  layouts' equivalents), so the same kernel serves every layout that has such a view.
* ``block_table`` ``[R, max_blocks]`` int32: the kernel-block ids of each request.
* ``query_start_loc`` ``[R + 1]`` int32: request ``r`` owns query rows
  ``[query_start_loc[r], query_start_loc[r + 1])``.
* ``seq_lens`` ``[R]`` int32: K/V positions of request ``r`` are ``[0, seq_lens[r])``, and its
  query rows are the last ones, at positions ``seq_lens[r] - q_len + i``.
* ``tree_start`` ``[R]`` int32: the first K/V position of the request's token tree
  (``>= seq_lens[r]`` for a request without one).
* ``tree_bits`` ``[T]`` int64: for each query row, bit ``j`` = may see tree position
  ``tree_start + j`` (see :mod:`vllm_graft.kernels.tree_mask`).

A row sees position ``p`` when ``p`` is not after the row's own position (causal) and,
for ``p`` inside the tree, the row's bit for ``p`` is set. Rows of requests without a
tree are therefore plain causal rows (prefill chunks and decodes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def visible_positions(seq_len: int, q_len: int, tree_start: int,
                      tree_bits: torch.Tensor) -> torch.Tensor:
    """``[q_len, seq_len]`` bool: which K/V positions each query row of a request sees."""
    device = tree_bits.device
    positions = torch.arange(seq_len, device=device)
    row_positions = seq_len - q_len + torch.arange(q_len, device=device)
    visible = positions[None, :] <= row_positions[:, None]
    offset = positions - tree_start
    in_tree = (offset >= 0) & (offset < 64)
    bit = (tree_bits[:, None] >> offset.clamp(0, 63)[None, :]) & 1
    tree_visible = torch.where(in_tree[None, :], bit.bool(), offset[None, :] < 0)
    return visible & tree_visible


def gather_paged(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Positions ``[0, length)`` of one request from a ``[blocks, block_size, H, D]`` cache,
    as ``[length, H, D]``."""
    block_size = cache.shape[1]
    positions = torch.arange(length, device=cache.device)
    blocks = block_table.to(cache.device).long()[positions // block_size]
    return cache[blocks, positions % block_size]


def paged_tree_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    tree_start: torch.Tensor,
    tree_bits: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Per-request SDPA in ``compute_dtype``; output in ``query``'s dtype (module doc)."""
    out = torch.empty_like(query) if out is None else out
    starts = query_start_loc.tolist()
    lengths = seq_lens.tolist()
    tree_starts = tree_start.tolist()
    heads = query.shape[1]
    for r, seq_len in enumerate(lengths):
        q_rows = slice(starts[r], starts[r + 1])
        q_len = starts[r + 1] - starts[r]
        if q_len == 0:
            continue
        k = gather_paged(key_cache, block_table[r], seq_len).to(compute_dtype)
        v = gather_paged(value_cache, block_table[r], seq_len).to(compute_dtype)
        groups = heads // k.shape[1]
        k = k.transpose(0, 1).repeat_interleave(groups, dim=0)  # [Hq, S, D]
        v = v.transpose(0, 1).repeat_interleave(groups, dim=0)
        q = query[q_rows].transpose(0, 1).to(compute_dtype)  # [Hq, q_len, D]
        mask = visible_positions(seq_len, q_len, tree_starts[r],
                                 tree_bits[q_rows].to(query.device))
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[q_rows] = attended.transpose(0, 1).to(out.dtype)
    return out
