"""Tree attention for vLLM's CPU attention backend.

vLLM's CPU kernel knows only causal attention over a request's KV in linear slot order.
For rows that belong to a token tree we let the native kernel run (the other requests
of the batch need it) and then recompute the tree rows ourselves: the request's context
``[0, prefix_len)`` is read from the paged KV cache, extra context rows (earlier draft
steps) and the current rows come from K/V kept in a :class:`TreeKVStore`, and
``scaled_dot_product_attention`` applies the ancestor mask. A forward whose rows are all
tree rows (the drafter's tree steps) skips the native kernel.

Which rows are tree rows is said by a :class:`TreeAttentionPlan`, made active for one
model forward with :func:`active_plan`; forwards without a plan run untouched.

The paged layout is read with :func:`read_paged_kv`, whose assumption about the CPU
kernel's layout is checked against the kernel itself (:func:`check_kv_layout`) before
its first use for each (ISA, dtype, shape): a kernel that stores KV differently makes
Graft fail loudly at start-up instead of attending to garbage.
"""

from __future__ import annotations

import contextlib
import contextvars
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


@contextlib.contextmanager
def active_plan(plan: TreeAttentionPlan | None):
    token = _ACTIVE_PLAN.set(plan)
    try:
        yield
    finally:
        _ACTIVE_PLAN.reset(token)


def current_plan() -> TreeAttentionPlan | None:
    return _ACTIVE_PLAN.get()


# ---- the paged KV layout of vLLM's CPU backend ----------------------------------------
def read_paged_kv(kv_cache: torch.Tensor, block_table: torch.Tensor,
                  length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions [0, length) of one request: two [num_kv_heads, length, head]
    tensors.

    Layout of vLLM 0.32's CPU cache: ``[num_blocks, num_kv_heads, block_size,
    2 * head_size]``; inside one (block, head) the first ``block_size * head_size``
    values are K transposed (``[head_size, block_size]``), the rest V
    (``[block_size, head_size]``). Checked by :func:`check_kv_layout`.
    """
    _, heads, block_size, two_head = kv_cache.shape
    head = two_head // 2
    if length == 0:
        empty = kv_cache.new_empty((heads, 0, head))
        return empty, empty
    blocks = (length + block_size - 1) // block_size
    chunk = kv_cache[block_table[:blocks].long()].reshape(blocks, heads, 2, block_size * head)
    k = chunk[:, :, 0].reshape(blocks, heads, head, block_size).permute(1, 0, 3, 2)
    v = chunk[:, :, 1].reshape(blocks, heads, block_size, head).permute(1, 0, 2, 3)
    k = k.reshape(heads, blocks * block_size, head)[:, :length]
    v = v.reshape(heads, blocks * block_size, head)[:, :length]
    return k, v


_CHECKED_LAYOUTS: set[tuple] = set()


def check_kv_layout(impl, layer, kv_cache: torch.Tensor) -> None:
    """Write known K/V with the backend's own cache-update op into a scratch cache of
    the same shape and dtype and read it back with :func:`read_paged_kv`."""
    _, heads, block_size, two_head = kv_cache.shape
    key = (getattr(layer, "isa", None), kv_cache.dtype, heads, block_size, two_head)
    if key in _CHECKED_LAYOUTS:
        return
    head = two_head // 2
    scratch = torch.zeros((3, heads, block_size, two_head), dtype=kv_cache.dtype,
                          device=kv_cache.device)
    length = block_size + 5  # crosses a block boundary
    gen = torch.Generator(device="cpu").manual_seed(0)
    k = torch.randn(length, heads, head, generator=gen).to(kv_cache.dtype)
    v = torch.randn(length, heads, head, generator=gen).to(kv_cache.dtype)
    block_table = torch.tensor([2, 1, 0], dtype=torch.int32)
    positions = torch.arange(length)
    slots = (block_table[positions // block_size].long() * block_size
             + positions % block_size).to(kv_cache.device)
    impl.do_kv_cache_update(layer, k.to(kv_cache.device), v.to(kv_cache.device), scratch, slots)
    got_k, got_v = read_paged_kv(scratch, block_table, length)
    if not (torch.equal(got_k.cpu(), k.transpose(0, 1)) and torch.equal(got_v.cpu(), v.transpose(0, 1))):
        raise TreeAttentionError(
            f"the paged KV layout of attention ISA {key[0]!r} (dtype {kv_cache.dtype}) is not "
            "the one Graft's tree attention reads; this vLLM build or CPU is not supported")
    _CHECKED_LAYOUTS.add(key)


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
    check_impl_supported(impl)
    check_kv_layout(impl, layer, kv_cache)
    rows_key, rows_value = key, value  # [tokens, kv_heads, head]
    if plan.store is not None:
        index = plan.store_rows
        plan.store.append(layer, rows_key[index], rows_value[index])
    out_view = output.view(output.shape[0], query.shape[1], -1)
    for req in plan.requests:
        rows = slice(req.query_start, req.query_start + req.num_rows)
        k_prefix, v_prefix = read_paged_kv(kv_cache, req.block_table, req.prefix_len)
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
    return output
