"""Tree attention over vLLM's paged K/V in one or two Triton launches per layer.

Same inputs and result as :func:`~vllm_graft.kernels.paged_tree_attention_reference`
(whose module documents the batch layout), for a whole mixed batch at once: prefill
chunks, decodes and tree rows of any shape, each request with its own tree mask.

Work split: one program per (query tile, KV head, KV split). A tile holds ``BLOCK_M`` rows
made of ``BLOCK_M // G`` query positions times the ``G`` query heads that share the KV
head (GQA), so each K/V tile is read once for the whole group. Tiles never straddle two
requests; a program finds its request by binary search over ``query_start_loc``, so the
grid depends only on tensor shapes (no host synchronisation, capturable in CUDA graphs).
K/V positions are visited in tiles of ``BLOCK_N``; each position's block id comes from
the block table, so any block size and any strided cache view work. Softmax is online
in fp32. The positions every row of a tile sees (before the tree and before the tile's
first row) are visited without computing the mask; the rest with it.

Split-K (flash-decoding), for grids too small to fill the GPU (small batch, long
context): with ``num_splits = S > 1`` the K/V range ``[0, kv_end)`` of each tile is cut
into ``S`` runs of whole ``BLOCK_N`` tiles (``ceil(tiles / S)`` each, the last ones
possibly empty), one program each. A program writes its rows' partial max ``m``, sum
``l`` and unnormalised output ``acc`` (fp32, ``[S, T, Hq(, D)]``) instead of the output;
a second launch merges the ``S`` partials of each row: ``M = max m_s``,
``out = sum exp(m_s - M) acc_s / sum exp(m_s - M) l_s``. ``S`` is chosen from shapes
only (:func:`auto_num_splits`). ``S = 1`` is the single launch, without workspace.

Under Triton's interpreter (``TRITON_INTERPRET=1``, the CPU tests) the dot operands are
upcast to fp32 after rounding to the input dtype: the interpreter of Triton 3.6 to 3.9
multiplies bf16 operands wrongly (results near 1e10 for unit-scale inputs).
"""

from __future__ import annotations

import functools
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
def _attend(m_i, l_i, acc, q, bits, row_pos, first_tree_pos, kv_lo, kv_hi, scale,
            key_cache, value_cache, table, kv_head, dims, dim_valid,
            stride_kb, stride_ks, stride_kh, stride_kd,
            stride_vb, stride_vs, stride_vh, stride_vd,
            BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
            DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    # Online softmax over positions [kv_lo, kv_hi), kv_lo a multiple of BLOCK_N. Unless
    # MASKED, kv_hi is one too and every row sees every position of the range.
    for kv_begin in range(kv_lo, kv_hi, BLOCK_N):
        positions = kv_begin + tl.arange(0, BLOCK_N)
        if MASKED:
            pos_valid = positions < kv_hi
            block_ids = tl.load(table + positions // BLOCK_SIZE, mask=pos_valid, other=0)
            k_mask = pos_valid[None, :] & dim_valid[:, None]
            v_mask = pos_valid[:, None] & dim_valid[None, :]
        else:
            block_ids = tl.load(table + positions // BLOCK_SIZE)
            k_mask = dim_valid[:, None]
            v_mask = dim_valid[None, :]
        slots = block_ids.to(tl.int64) * stride_kb + (positions % BLOCK_SIZE) * stride_ks
        k = tl.load(key_cache + slots[None, :] + kv_head * stride_kh
                    + dims[:, None] * stride_kd, mask=k_mask, other=0.0)
        scores = _dot(q, k, DOT_PRECISION, UPCAST_DOT) * scale

        if MASKED:
            offset = positions - first_tree_pos
            in_tree = (offset >= 0) & (offset < 64)
            shift = tl.minimum(tl.maximum(offset, 0), 63).to(tl.int64)
            tree_ok = ((bits[:, None] >> shift[None, :]) & 1) != 0
            visible = (positions[None, :] <= row_pos[:, None]) & pos_valid[None, :]
            before_tree = offset < 0
            visible = visible & (tree_ok | before_tree[None, :]) & (in_tree | before_tree)[None, :]
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = m_new
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_slots = block_ids.to(tl.int64) * stride_vb + (positions % BLOCK_SIZE) * stride_vs
        v = tl.load(value_cache + v_slots[:, None] + kv_head * stride_vh
                    + dims[None, :] * stride_vd, mask=v_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["num_tokens", "num_splits"])
def _paged_tree_attention_kernel(
    out, query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
    tree_start, tree_bits, scale, num_requests,
    part_max, part_sum, part_acc, num_tokens, num_heads, num_splits,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
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

    first_pos = seq_len - q_len + local_tile * BLOCK_Q  # the tile's first row
    kv_end = first_pos + tl.minimum(q_len - local_tile * BLOCK_Q, BLOCK_Q)  # nothing past
    # every row of the tile sees [0, seen_by_all): before the tree and its first row
    seen_by_all = tl.minimum(tl.minimum(first_tree_pos, first_pos + 1), kv_end)
    seen_by_all = tl.maximum(seen_by_all, 0) // BLOCK_N * BLOCK_N
    kv_lo = 0
    kv_hi = kv_end
    if SPLIT:
        per_split = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), num_splits) * BLOCK_N
        kv_lo = tl.minimum(tl.program_id(2) * per_split, kv_end)
        kv_hi = tl.minimum(kv_lo + per_split, kv_end)
    table = block_table + request * stride_bt
    m_i, l_i, acc = _attend(
        m_i, l_i, acc, q, bits, row_pos, first_tree_pos, kv_lo,
        tl.minimum(kv_hi, seen_by_all), scale, key_cache, value_cache, table, kv_head,
        dims, dim_valid, stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd, BLOCK_SIZE, BLOCK_N, False,
        DOT_PRECISION, UPCAST_DOT)
    m_i, l_i, acc = _attend(
        m_i, l_i, acc, q, bits, row_pos, first_tree_pos, tl.maximum(kv_lo, seen_by_all),
        kv_hi, scale, key_cache, value_cache, table, kv_head,
        dims, dim_valid, stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd, BLOCK_SIZE, BLOCK_N, True,
        DOT_PRECISION, UPCAST_DOT)

    if SPLIT:
        # partials of (split, token, head), row-major, written even for an empty range
        part = (tl.program_id(2) * num_tokens + tokens.to(tl.int64)) * num_heads + heads
        tl.store(part_max + part, m_i, mask=row_valid)
        tl.store(part_sum + part, l_i, mask=row_valid)
        tl.store(part_acc + part[:, None] * HEAD_DIM + dims[None, :], acc,
                 mask=row_valid[:, None] & dim_valid[None, :])
    else:
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out + tokens[:, None] * stride_ot + heads[:, None] * stride_oh
                 + dims[None, :] * stride_od,
                 acc.to(out.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


@triton.jit(do_not_specialize=["num_tokens", "num_splits"])
def _merge_splits_kernel(
    out, part_max, part_sum, part_acc, query_start_loc, num_requests, num_tokens,
    num_heads, num_splits, stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr,
):
    # One program per (token, block of heads): the log-sum-exp merge of the partials.
    token = tl.program_id(0)
    if token >= tl.load(query_start_loc + num_requests):
        return  # a row of no request: left as it is, as the single launch does
    heads = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    dims = tl.arange(0, HEAD_PAD)
    head_valid = heads < num_heads
    mask = head_valid[:, None] & (dims < HEAD_DIM)[None, :]
    m_all = tl.full([HEADS_PER_PROGRAM], float("-inf"), dtype=tl.float32)
    l_all = tl.zeros([HEADS_PER_PROGRAM], dtype=tl.float32)
    acc = tl.zeros([HEADS_PER_PROGRAM, HEAD_PAD], dtype=tl.float32)
    for split in range(0, num_splits):
        part = (split * num_tokens + token.to(tl.int64)) * num_heads + heads
        m_s = tl.load(part_max + part, mask=head_valid, other=float("-inf"))
        l_s = tl.load(part_sum + part, mask=head_valid, other=0.0)
        acc_s = tl.load(part_acc + part[:, None] * HEAD_DIM + dims[None, :], mask=mask,
                        other=0.0)
        m_new = tl.maximum(m_all, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_all - m_safe)
        beta = tl.exp(m_s - m_safe)
        l_all = l_all * alpha + l_s * beta
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        m_all = m_new
    acc = acc / tl.where(l_all == 0.0, 1.0, l_all)[:, None]
    tl.store(out + token * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od,
             acc.to(out.dtype.element_ty), mask=mask)


def default_tiles(group: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) used when the caller does not pick: 64 rows, 64 positions."""
    block_m = max(64, triton.next_power_of_2(group))
    return block_m, 64 if head_dim <= 128 else 32


def choose_num_splits(programs: int, kv_tiles: int, slots: int, max_splits: int = 64) -> int:
    """Splits of each tile's K/V range for a grid of ``programs`` (query tiles x KV heads)
    over at most ``kv_tiles`` K/V tiles, on a device that runs ``slots`` programs at once.

    FlashAttention-2's rule: none when the grid already fills 80 % of the slots; else the
    fewest splits whose wave efficiency (``waves / ceil(waves)``, ``waves = programs *
    splits / slots``) is within 85 % of the best, among split counts that change the
    number of K/V tiles per split.
    """
    if programs <= 0 or kv_tiles <= 1 or slots <= 0 or programs >= 0.8 * slots:
        return 1
    limit = min(max_splits, slots, kv_tiles)
    efficiency = {}
    for splits in range(1, limit + 1):
        if splits > 1 and -(-kv_tiles // splits) == -(-kv_tiles // (splits - 1)):
            continue  # the same tiles per split as one split fewer: only empty programs
        waves = programs * splits / slots
        efficiency[splits] = waves / -(-waves // 1)
    best = max(efficiency.values())
    return min(s for s, e in efficiency.items() if e >= 0.85 * best)


@functools.lru_cache(maxsize=None)
def _program_slots(device: torch.device) -> int:
    # two programs of the default tiles fit one SM (shared memory, registers)
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def auto_num_splits(query: torch.Tensor, key_cache: torch.Tensor, block_table: torch.Tensor,
                    max_seq_len: int | None = None, block_m: int | None = None,
                    block_n: int | None = None) -> int:
    """The ``num_splits`` that ``paged_tree_attention`` uses when not told: from shapes
    only (capturable): the grid's programs, the K/V length (``max_seq_len``, else the
    block table's capacity) and the device's SMs (:func:`choose_num_splits`). 1 off CUDA."""
    if query.device.type != "cuda":
        return 1
    tokens, heads, head_dim = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = heads // kv_heads
    default_m, default_n = default_tiles(group, head_dim)
    block_q = max(1, (block_m or default_m) // group)
    block_n = block_n or default_n
    kv_len = max_seq_len if max_seq_len is not None else block_table.shape[1] * block_size
    programs = (tokens // block_q + block_table.shape[0]) * kv_heads
    return choose_num_splits(programs, -(-kv_len // block_n), _program_slots(query.device))


def _workspace(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32, device=device)


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
    num_splits: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Tree attention of every query row (layout: ``tree_attention_reference``'s doc).

    ``num_splits``: K/V splits per tile (module doc); ``None`` picks them from shapes
    (:func:`auto_num_splits`, which ``max_seq_len``, a bound on ``seq_lens`` known to the
    caller, sharpens), 1 is the single launch. Shapes and dtypes are checked here (no
    values: that would synchronise the device).

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
    if num_splits is None:
        num_splits = auto_num_splits(query, key_cache, block_table, max_seq_len, block_m,
                                     block_n)
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    block_q = block_m // group
    grid = (tokens // block_q + requests, kv_heads, num_splits)
    if tokens == 0 or requests == 0:
        return out
    split = num_splits > 1
    head_pad = max(16, triton.next_power_of_2(head_dim))
    if split:
        part_max = _workspace((num_splits, tokens, heads), query.device)
        part_sum = _workspace((num_splits, tokens, heads), query.device)
        part_acc = _workspace((num_splits, tokens, heads, head_dim), query.device)
    else:
        part_max = part_sum = part_acc = out  # not read
    _paged_tree_attention_kernel[grid](
        out, query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
        tree_start, tree_bits, scale, requests,
        part_max, part_sum, part_acc, tokens, heads, num_splits,
        *query.stride(), *out.stride(), *key_cache.stride(), *value_cache.stride(),
        block_table.stride(0),
        HEAD_DIM=head_dim, HEAD_PAD=head_pad, GROUP=group,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        SPLIT=split, DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        UPCAST_DOT=os.environ.get("TRITON_INTERPRET", "0") == "1",
        num_warps=num_warps, num_stages=num_stages,
    )
    if split:
        per_program = min(triton.next_power_of_2(heads), max(1, 1024 // head_pad))
        _merge_splits_kernel[(tokens, triton.cdiv(heads, per_program))](
            out, part_max, part_sum, part_acc, query_start_loc, requests, tokens, heads,
            num_splits, *out.stride(),
            HEAD_DIM=head_dim, HEAD_PAD=head_pad, HEADS_PER_PROGRAM=per_program,
            num_warps=4,
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
