"""Tree attention over vLLM's paged K/V in one Triton launch per layer.

Same inputs and result as :func:`~vllm_graft.kernels.paged_tree_attention_reference`
(whose module documents the batch layout), for a whole mixed batch at once: prefill
chunks, decodes and tree rows of any shape, each request with its own tree mask.

Work split: one program per (query tile, KV head). A tile holds ``BLOCK_M`` rows made of
``BLOCK_M // G`` query positions times the ``G`` query heads that share the KV head
(GQA), so each K/V tile is read once for the whole group. Tiles never straddle two
requests; a program finds its request by binary search over ``query_start_loc``, so the
grid depends only on tensor shapes (no host synchronisation, capturable in CUDA graphs).
K/V positions are visited in tiles of ``BLOCK_N``; each position's block id comes from
the block table, so any block size and any strided cache view work. Softmax is online
in fp32.

Under Triton's interpreter (``TRITON_INTERPRET=1``, the CPU tests) the dot operands are
upcast to fp32 after rounding to the input dtype: the interpreter of Triton 3.6 to 3.9
multiplies bf16 operands wrongly (results near 1e10 for unit-scale inputs).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _find_request(query_start_loc, num_requests, tile, BLOCK_Q: tl.constexpr):
    # Request r owns tiles [query_start_loc[r] // BLOCK_Q + r, query_start_loc[r+1] // BLOCK_Q + r + 1).
    low = 0
    high = num_requests
    while low < high:
        mid = (low + high) // 2
        first_tile = tl.load(query_start_loc + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            low = mid + 1
        else:
            high = mid
    return low - 1


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _paged_tree_attention_kernel(
    out, query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
    tree_start, tree_bits, scale, num_requests,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    request = _find_request(query_start_loc, num_requests, tile, BLOCK_Q)
    q_begin = tl.load(query_start_loc + request)
    q_len = tl.load(query_start_loc + request + 1) - q_begin
    local_tile = tile - (q_begin // BLOCK_Q + request)
    if local_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens + request)
    first_tree_pos = tl.load(tree_start + request)

    rows = tl.arange(0, BLOCK_M)
    q_index = local_tile * BLOCK_Q + rows // GROUP  # position among the request's rows
    heads = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_index < q_len)
    tokens = q_begin + q_index
    row_pos = seq_len - q_len + q_index  # K/V position of each row
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < HEAD_DIM

    q = tl.load(query + tokens[:, None] * stride_qt + heads[:, None] * stride_qh
                + dims[None, :] * stride_qd,
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    bits = tl.load(tree_bits + tokens, mask=row_valid, other=0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

    last_q = tl.minimum(q_len, (local_tile + 1) * BLOCK_Q) - 1
    kv_end = seq_len - q_len + last_q + 1  # nothing in the tile sees past this
    table = block_table + request * stride_bt
    for kv_begin in range(0, kv_end, BLOCK_N):
        positions = kv_begin + tl.arange(0, BLOCK_N)
        pos_valid = positions < kv_end
        block_ids = tl.load(table + positions // BLOCK_SIZE, mask=pos_valid, other=0)
        slots = block_ids.to(tl.int64) * stride_kb + (positions % BLOCK_SIZE) * stride_ks
        k = tl.load(key_cache + slots[None, :] + kv_head * stride_kh
                    + dims[:, None] * stride_kd,
                    mask=pos_valid[None, :] & dim_valid[:, None], other=0.0)
        scores = _dot(q, k, DOT_PRECISION, UPCAST_DOT) * scale

        offset = positions - first_tree_pos
        in_tree = (offset >= 0) & (offset < 64)
        shift = tl.minimum(tl.maximum(offset, 0), 63).to(tl.int64)
        tree_ok = ((bits[:, None] >> shift[None, :]) & 1) != 0
        visible = (positions[None, :] <= row_pos[:, None]) & pos_valid[None, :]
        visible = visible & (tree_ok | (offset < 0)[None, :]) & (in_tree | (offset < 0))[None, :]
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_slots = block_ids.to(tl.int64) * stride_vb + (positions % BLOCK_SIZE) * stride_vs
        v = tl.load(value_cache + v_slots[:, None] + kv_head * stride_vh
                    + dims[None, :] * stride_vd,
                    mask=pos_valid[:, None] & dim_valid[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
        m_i = m_new

    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out + tokens[:, None] * stride_ot + heads[:, None] * stride_oh
             + dims[None, :] * stride_od,
             acc.to(out.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


def default_tiles(group: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) used when the caller does not pick: 64 rows, 64 positions."""
    block_m = max(64, triton.next_power_of_2(group))
    return block_m, 64 if head_dim <= 128 else 32


def paged_tree_attention(
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
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Tree attention of every query row (layout: ``tree_attention_reference``'s doc).

    Shapes and dtypes are checked here (no values: that would synchronise the device).

    Raises:
        ValueError: a shape, dtype or device that the kernel cannot serve, naming it.
    """
    _check_inputs(query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
                  tree_start, tree_bits)
    out = torch.empty_like(query) if out is None else out
    if out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(f"out must be {tuple(query.shape)} {query.dtype}, "
                         f"got {tuple(out.shape)} {out.dtype}")
    tokens, heads, head_dim = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = heads // kv_heads
    requests = seq_lens.shape[0]
    default_m, default_n = default_tiles(group, head_dim)
    block_m = block_m or default_m
    block_n = block_n or default_n
    if block_m < group:
        raise ValueError(f"block_m={block_m} is smaller than the GQA group ({group} query "
                         "heads per KV head)")
    block_q = block_m // group
    grid = (tokens // block_q + requests, kv_heads)
    if tokens == 0 or requests == 0:
        return out
    _paged_tree_attention_kernel[grid](
        out, query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
        tree_start, tree_bits, scale, requests,
        *query.stride(), *out.stride(), *key_cache.stride(), *value_cache.stride(),
        block_table.stride(0),
        HEAD_DIM=head_dim, HEAD_PAD=max(16, triton.next_power_of_2(head_dim)), GROUP=group,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        UPCAST_DOT=os.environ.get("TRITON_INTERPRET", "0") == "1",
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def _check_inputs(query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
                  tree_start, tree_bits) -> None:
    def fail(message: str):
        raise ValueError(f"paged_tree_attention: {message}")

    if query.dim() != 3:
        fail(f"query must be [tokens, heads, head_dim], got {tuple(query.shape)}")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        fail(f"query dtype {query.dtype} is not float16, bfloat16 or float32")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dim() != 4:
            fail(f"{name} must be [blocks, block_size, kv_heads, head_dim], "
                 f"got {tuple(cache.shape)}")
        if cache.dtype != query.dtype:
            fail(f"{name} dtype {cache.dtype} differs from query dtype {query.dtype}")
        if cache.shape[3] != query.shape[2]:
            fail(f"{name} head_dim {cache.shape[3]} differs from query's {query.shape[2]}")
        if cache.device != query.device:
            fail(f"{name} is on {cache.device}, query on {query.device}")
    if key_cache.shape != value_cache.shape:
        fail(f"key_cache {tuple(key_cache.shape)} and value_cache "
             f"{tuple(value_cache.shape)} differ")
    if query.shape[1] % key_cache.shape[2]:
        fail(f"{query.shape[1]} query heads are not a multiple of "
             f"{key_cache.shape[2]} KV heads")
    requests = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    expected = {"block_table": (block_table, torch.int32, 2),
                "query_start_loc": (query_start_loc, torch.int32, 1),
                "seq_lens": (seq_lens, torch.int32, 1),
                "tree_start": (tree_start, torch.int32, 1),
                "tree_bits": (tree_bits, torch.int64, 1)}
    for name, (tensor, dtype, dims) in expected.items():
        if tensor.dtype != dtype or tensor.dim() != dims:
            fail(f"{name} must be {dims}-D {dtype}, got {tensor.dim()}-D {tensor.dtype}")
        if tensor.device != query.device:
            fail(f"{name} is on {tensor.device}, query on {query.device}")
    if block_table.shape[0] != requests or tree_start.shape[0] != requests:
        fail(f"block_table and tree_start need one row per request ({requests})")
    if query_start_loc.shape[0] != requests + 1:
        fail(f"query_start_loc must have {requests + 1} entries, "
             f"got {query_start_loc.shape[0]}")
    if tree_bits.shape[0] != query.shape[0]:
        fail(f"tree_bits must have one entry per query row ({query.shape[0]}), "
             f"got {tree_bits.shape[0]}")
    if block_table.stride(1) != 1:
        fail("block_table rows must be contiguous")
