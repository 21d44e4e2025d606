"""Tree attention for vLLM's attention backends (checked on the CPU backend).

vLLM's CPU kernel knows only causal attention over a request's KV in linear slot order.
For rows that belong to a token tree we let the native kernel run (the other requests
of the batch need it) and then recompute the tree rows ourselves: the request's context
``[0, prefix_len)`` is read from the paged KV cache, extra context rows (earlier draft
steps) and the current rows come from K/V kept in a :class:`TreeKVStore`, and
``scaled_dot_product_attention`` applies the ancestor mask. A forward whose rows are all
tree rows (the drafter's tree steps) skips the native kernel.

Which rows are tree rows is said by a :class:`TreeAttentionPlan`, made active for one
model forward with :func:`active_plan`; forwards without a plan run untouched.

The paged cache is read by the reader that :func:`kv_reader` finds to reproduce what the
backend's own cache-update op wrote (checked once per backend, dtype and shape, at
start-up): a backend that stores KV some other way makes Graft fail loudly instead of
attending to garbage.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

_ACTIVE_PLAN: contextvars.ContextVar[TreeAttentionPlan | None] = contextvars.ContextVar(
    "vllm_graft_tree_plan", default=None)


class TreeAttentionError(RuntimeError):
    """The attention backend cannot serve tree attention (unsupported feature/layout)."""


@dataclass
class TreeRequestPlan:
    """Tree rows of one request in one forward.

    query_start / num_rows: the request's rows in the forward's flattened batch
    prefix_len:  context positions [0, prefix_len) read from the paged cache
    block_table: [max_blocks] int32 block ids of the request
    context_rows: [C] int64 rows of the store (earlier forwards) this request may see
    mask: [num_rows, C + num_rows] bool, True = may attend (over context rows, then the
          current rows); the prefix is always fully visible
    """

    query_start: int
    num_rows: int
    prefix_len: int
    block_table: torch.Tensor
    mask: torch.Tensor
    context_rows: torch.Tensor | None = None


@dataclass
class TreeKVStore:
    """Fresh K/V of tree rows, per attention layer, appended forward by forward.

    Row ``i`` of the store is the ``i``-th tree row ever appended (the same numbering
    in every layer). The target's store feeds the KV move after acceptance; the
    drafter's store is the context of later draft steps.
    """

    keys: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    values: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    layers: dict[str, object] = field(default_factory=dict)
    num_rows: int = 0

    def append(self, layer, key: torch.Tensor, value: torch.Tensor) -> None:
        name = layer.layer_name
        self.keys.setdefault(name, []).append(key)
        self.values.setdefault(name, []).append(value)
        self.layers[name] = layer

    def rows(self, layer_name: str, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self.keys[layer_name]
        values = self.values[layer_name]
        if len(keys) > 1:  # consolidate, so later lookups index one tensor
            keys[:] = [torch.cat(keys)]
            values[:] = [torch.cat(values)]
        return keys[0][index], values[0][index]


@dataclass
class TreeAttentionPlan:
    requests: list[TreeRequestPlan]
    store: TreeKVStore | None = None
    replace_all: bool = False  # every row is a tree row: skip the native kernel
    # the K/V rows this forward appends to the store, in store order
    store_rows: torch.Tensor | None = None
    seconds: float = 0.0  # time spent recomputing tree rows (for the overhead metrics)


@contextlib.contextmanager
def active_plan(plan: TreeAttentionPlan | None):
    token = _ACTIVE_PLAN.set(plan)
    try:
        yield
    finally:
        _ACTIVE_PLAN.reset(token)


def current_plan() -> TreeAttentionPlan | None:
    return _ACTIVE_PLAN.get()


# ---- reading a request's K/V from the paged cache --------------------------------------
# Each reader returns K and V of positions [0, length) as two [kv_heads, length, head]
# tensors. Which one fits a backend is decided by :func:`kv_reader`, which writes known
# K/V with the backend's own cache-update op and keeps the reader that reads them back:
# a backend that stores KV some other way is refused at start-up, never misread.
def _read_cpu(kv_cache, block_table, length):
    """vLLM's CPU backend: ``[blocks, kv_heads, block_size, 2 * head]``; inside one
    (block, head) the first ``block_size * head`` values are K transposed
    (``[head, block_size]``), the rest V (``[block_size, head]``)."""
    _, heads, block_size, two_head = kv_cache.shape
    head = two_head // 2
    blocks = (length + block_size - 1) // block_size
    chunk = kv_cache[block_table[:blocks].long()].reshape(blocks, heads, 2, block_size * head)
    k = chunk[:, :, 0].reshape(blocks, heads, head, block_size).permute(1, 0, 3, 2)
    v = chunk[:, :, 1].reshape(blocks, heads, block_size, head).permute(1, 0, 2, 3)
    return (k.reshape(heads, blocks * block_size, head)[:, :length],
            v.reshape(heads, blocks * block_size, head)[:, :length])


def _read_heads_kv_last(kv_cache, block_table, length):
    """``[blocks, kv_heads, block_size, 2 * head]`` with K and V side by side in the last
    dimension (FlashAttention's layout in vLLM 0.32)."""
    _, heads, block_size, two_head = kv_cache.shape
    head = two_head // 2
    blocks = (length + block_size - 1) // block_size
    chunk = kv_cache[block_table[:blocks].long()]  # [blocks, heads, block, 2 * head]
    chunk = chunk.permute(1, 0, 2, 3).reshape(heads, blocks * block_size, two_head)[:, :length]
    return chunk[..., :head], chunk[..., head:]


def _read_kv_first(kv_cache, block_table, length):
    """``[2, blocks, block_size, kv_heads, head]`` (K and V planes first)."""
    _, _, block_size, heads, head = kv_cache.shape
    blocks = (length + block_size - 1) // block_size
    planes = kv_cache[:, block_table[:blocks].long()]  # [2, blocks, block, heads, head]
    planes = planes.reshape(2, blocks * block_size, heads, head)[:, :length]
    return planes[0].transpose(0, 1), planes[1].transpose(0, 1)


def _read_kv_second(kv_cache, block_table, length):
    """``[blocks, 2, block_size, kv_heads, head]``."""
    _, _, block_size, heads, head = kv_cache.shape
    blocks = (length + block_size - 1) // block_size
    chunk = kv_cache[block_table[:blocks].long()].transpose(0, 1)
    chunk = chunk.reshape(2, blocks * block_size, heads, head)[:, :length]
    return chunk[0].transpose(0, 1), chunk[1].transpose(0, 1)


_READERS = {4: (_read_cpu, _read_heads_kv_last), 5: (_read_kv_first, _read_kv_second)}
_DETECTED: dict[tuple, object] = {}


def kv_reader(impl, layer, kv_cache: torch.Tensor):
    """The reader that reproduces what ``impl.do_kv_cache_update`` wrote (cached)."""
    key = (type(impl), getattr(layer, "isa", None), kv_cache.dtype, tuple(kv_cache.shape[1:]))
    if key in _DETECTED:
        return _DETECTED[key]
    blocks_first = kv_cache.shape[0] != 2
    scratch_shape = (3, *kv_cache.shape[1:]) if blocks_first else (2, 3, *kv_cache.shape[2:])
    scratch = torch.zeros(scratch_shape, dtype=kv_cache.dtype, device=kv_cache.device)
    heads, head = layer.num_kv_heads, layer.head_size
    block_size = kv_cache.shape[2]  # the block-size dimension in every layout above
    length = block_size + 5  # crosses a block boundary
    gen = torch.Generator(device="cpu").manual_seed(0)
    k = torch.randn(length, heads, head, generator=gen).to(kv_cache.dtype)
    v = torch.randn(length, heads, head, generator=gen).to(kv_cache.dtype)
    block_table = torch.tensor([2, 1, 0], dtype=torch.int32, device=kv_cache.device)
    positions = torch.arange(length, device=kv_cache.device)
    slots = block_table[positions // block_size].long() * block_size + positions % block_size
    impl.do_kv_cache_update(layer, k.to(kv_cache.device), v.to(kv_cache.device), scratch, slots)
    for reader in _READERS.get(kv_cache.dim(), ()):
        try:
            got_k, got_v = reader(scratch, block_table, length)
        except RuntimeError:
            continue
        if (got_k.shape == (heads, length, head) and torch.equal(got_k.cpu(), k.transpose(0, 1))
                and torch.equal(got_v.cpu(), v.transpose(0, 1))):
            _DETECTED[key] = reader
            return reader
    raise TreeAttentionError(
        f"Graft's tree attention cannot read the paged KV cache of {type(impl).__name__} "
        f"(shape {tuple(kv_cache.shape)}, dtype {kv_cache.dtype}); this attention backend "
        "is not supported")


def check_impl_supported(impl) -> None:
    """Tree attention reimplements plain softmax attention: refuse what it lacks."""
    unsupported = {
        "alibi_slopes": getattr(impl, "alibi_slopes", None) is not None,
        "sliding_window": getattr(impl, "sliding_window", None) not in (None, -1, (-1, -1)),
        "logits_soft_cap": (getattr(impl, "logits_soft_cap", None) or 0) != 0,
        "attention sinks": getattr(impl, "sinks", None) is not None,
        "kv_cache_dtype": getattr(impl, "kv_cache_dtype", "auto") != "auto",
    }
    used = [name for name, on in unsupported.items() if on]
    if used:
        raise TreeAttentionError(
            f"Graft's tree attention does not support {', '.join(used)} "
            f"(attention implementation {type(impl).__name__})")


def tree_attention_forward(original, impl, layer, query, key, value, kv_cache,
                           attn_metadata, output, *args, **kwargs):
    """Replacement body of ``CPUAttentionBackendImpl.forward``."""
    plan = current_plan()
    if plan is None:
        return original(impl, layer, query, key, value, kv_cache, attn_metadata, output,
                        *args, **kwargs)
    if not plan.replace_all:
        original(impl, layer, query, key, value, kv_cache, attn_metadata, output,
                 *args, **kwargs)
    start = time.perf_counter()
    check_impl_supported(impl)
    read_paged_kv = kv_reader(impl, layer, kv_cache)
    rows_key, rows_value = key, value  # [tokens, kv_heads, head]
    if plan.store is not None:
        index = plan.store_rows
        plan.store.append(layer, rows_key[index], rows_value[index])
    out_view = output.view(output.shape[0], query.shape[1], -1)
    for req in plan.requests:
        rows = slice(req.query_start, req.query_start + req.num_rows)
        if req.prefix_len:
            k_prefix, v_prefix = read_paged_kv(kv_cache, req.block_table, req.prefix_len)
        else:
            k_prefix = v_prefix = key.new_empty((key.shape[1], 0, key.shape[2]))
        parts_k = [k_prefix.transpose(0, 1)]
        parts_v = [v_prefix.transpose(0, 1)]
        if req.context_rows is not None and req.context_rows.numel():
            k_ctx, v_ctx = plan.store.rows(layer.layer_name, req.context_rows)
            parts_k.append(k_ctx)
            parts_v.append(v_ctx)
        parts_k.append(rows_key[rows])
        parts_v.append(rows_value[rows])
        k_all = torch.cat(parts_k).transpose(0, 1).float()  # [kv_heads, S, head]
        v_all = torch.cat(parts_v).transpose(0, 1).float()
        q = query[rows].transpose(0, 1).float()  # [heads, n, head]
        groups = q.shape[0] // k_all.shape[0]
        if groups > 1:
            k_all = k_all.repeat_interleave(groups, dim=0)
            v_all = v_all.repeat_interleave(groups, dim=0)
        visible = torch.cat([
            torch.ones((req.num_rows, req.prefix_len), dtype=torch.bool, device=q.device),
            req.mask.to(q.device)], dim=1)
        out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=visible,
                                             scale=impl.scale)
        out_view[rows] = out.transpose(0, 1).to(output.dtype)
    plan.seconds += time.perf_counter() - start
    return output
