"""Tree attention for vLLM's attention backends (checked on the CPU backend).

vLLM's CPU kernel knows only causal attention over a request's KV in linear slot order.
For rows that belong to a token tree we let the native kernel run (the other requests
of the batch need it) and then recompute the tree rows ourselves: the request's context
``[0, prefix_len)`` is read from the paged KV cache, and
``scaled_dot_product_attention`` applies the ancestor mask. A forward whose rows are all
tree rows (the drafter's tree steps) skips the native kernel. The drafter's tree rows
of earlier draft steps are in its paged cache after the prefix, written there by the
plan (``write_slots``, *cache mode*), or, where the request's allocated slots cannot
hold them, kept in a :class:`TreeKVStore` (*store mode*).

Which rows are tree rows is said by a :class:`TreeAttentionPlan`, made active for one
model forward with :func:`active_plan`; forwards without a plan run untouched.

The paged cache is read by the reader that :func:`kv_reader` finds to reproduce what the
backend's own cache-update op wrote (checked once per backend, dtype and shape, at
start-up): a backend that stores KV some other way makes Graft fail loudly instead of
attending to garbage.

On GPUs, when the layout is one the Triton kernel reads (FlashAttention's and the other
5-D layouts, and the heads-first 4-D one), the tree rows of all requests are computed by
:func:`~vllm_graft.kernels.tree_attention_triton.paged_tree_attention` in one launch per
layer, straight from the paged cache; the SDPA path is the fallback and the reference
(``VLLM_GRAFT_TREE_KERNEL=0`` forces it). The kernel is checked against it at start-up on
the backend's own layout.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

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
    cached_tree_rows: C earlier tree rows of this request in the paged cache, at
          positions [prefix_len, prefix_len + C) (the drafter's earlier draft steps,
          written there by :attr:`TreeAttentionPlan.write_slots`); the current rows
          follow them. Not used together with ``context_rows``.
    mask: [num_rows, C + num_rows] bool, True = may attend (over context rows, then the
          current rows); the prefix is always fully visible
    """

    query_start: int
    num_rows: int
    prefix_len: int
    block_table: torch.Tensor
    mask: torch.Tensor
    context_rows: torch.Tensor | None = None
    cached_tree_rows: int = 0
    _visible: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def visible(self, device: torch.device) -> torch.Tensor:
        """[num_rows, prefix_len + C + num_rows] bool: what each row may attend to,
        built once per forward (every layer uses the same)."""
        if self._visible is None or self._visible.device != device:
            self._visible = torch.cat([
                torch.ones((self.num_rows, self.prefix_len), dtype=torch.bool, device=device),
                self.mask.to(device)], dim=1)
        return self._visible


@dataclass
class TreeKVStore:
    """Fresh K/V of tree rows, per attention layer, appended forward by forward.

    Row ``i`` of the store is the ``i``-th tree row ever appended (the same numbering
    in every layer). Only the drafter keeps one: its tree rows are never written to the
    paged cache, and later draft steps attend to them. (The target's tree rows are in
    the paged cache, which the KV move reads.)
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
    replace_all: bool = False  # every row of the forward is a tree row: skip the native kernel
    # the K/V rows this forward appends to the store, in store order
    store_rows: torch.Tensor | None = None
    # [T] cache slots where this forward's rows' K/V are written before attention (the
    # drafter's rows in cache mode, whose forward passes vLLM no slot mapping)
    write_slots: torch.Tensor | None = None
    seconds: float = 0.0  # time spent recomputing tree rows (for the overhead metrics)
    sdpa_layers: int = 0  # layers whose tree rows took the SDPA path, not the kernel
    kernel_batch: KernelBatch | None = None  # the kernel's inputs, built at first use
    layers: dict[str, object] = field(default_factory=dict)  # attention layers it ran in


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


# Slot readers: K and V at given cache slots, as two [N, kv_heads, head] tensors (used to
# move accepted tree rows, whose K/V vLLM wrote at their own slots, to the chain's).
def _slots_cpu(kv_cache, slots):
    blocks, heads, block_size, two_head = kv_cache.shape
    head = two_head // 2
    n, block, offset = slots.numel(), slots // block_size, slots % block_size
    chunk = kv_cache[block].reshape(n, heads, 2, block_size * head)
    index = torch.arange(n, device=slots.device)
    k = chunk[:, :, 0].reshape(n, heads, head, block_size)[index, :, :, offset]
    v = chunk[:, :, 1].reshape(n, heads, block_size, head)[index, :, offset]
    return k, v


def _slots_heads_kv_last(kv_cache, slots):
    block_size, head = kv_cache.shape[2], kv_cache.shape[3] // 2
    rows = kv_cache[slots // block_size, :, slots % block_size]  # [N, heads, 2 * head]
    return rows[..., :head], rows[..., head:]


def _slots_kv_first(kv_cache, slots):
    block_size = kv_cache.shape[2]
    planes = kv_cache[:, slots // block_size, slots % block_size]  # [2, N, heads, head]
    return planes[0], planes[1]


def _slots_kv_second(kv_cache, slots):
    block_size = kv_cache.shape[2]
    rows = kv_cache[slots // block_size, :, slots % block_size]  # [N, 2, heads, head]
    return rows[:, 0], rows[:, 1]


SLOT_READERS = {_read_cpu: _slots_cpu, _read_heads_kv_last: _slots_heads_kv_last,
                _read_kv_first: _slots_kv_first, _read_kv_second: _slots_kv_second}


class ProbedLayout:
    """A blocks-first cache whose layout inside a block is none of the above (vLLM's CPU
    backend with its AMX kernels, for one, packs K for its matrix units), read through
    where the backend's own cache update puts each element: ``index[kind, head,
    offset, dim]`` is the flat position, inside a block, of K (kind 0) or V (kind 1) of
    ``head`` at ``offset`` in the block, dimension ``dim`` (:func:`probe_layout`)."""

    def __init__(self, index: torch.Tensor):
        self.index = index  # [2, kv_heads, block_size, head] int64
        self.block_size = index.shape[2]

    def __call__(self, kv_cache, block_table, length):
        _, heads, block_size, head = self.index.shape
        blocks = (length + block_size - 1) // block_size
        flat = kv_cache[block_table[:blocks].long()].reshape(blocks, -1)
        kv = flat[:, self.index.to(flat.device).reshape(-1)].reshape(
            blocks, 2, heads, block_size, head)
        kv = kv.permute(1, 2, 0, 3, 4).reshape(2, heads, blocks * block_size, head)
        return kv[0, :, :length], kv[1, :, :length]

    def slots(self, kv_cache, slots):
        block, offset = slots // self.block_size, slots % self.block_size
        flat = kv_cache[block].reshape(slots.numel(), -1)  # [N, block elements]
        index = self.index.to(flat.device)[:, :, offset].permute(2, 0, 1, 3)  # [N, 2, H, D]
        n = slots.numel()
        kv = flat.gather(1, index.reshape(n, -1)).reshape(index.shape)
        return kv[:, 0], kv[:, 1]


def probe_layout(impl, layer, kv_cache: torch.Tensor) -> ProbedLayout | None:
    """Learn a blocks-first layout by writing K and V whose values name their own
    coordinates (kind, head, position, dimension; small integers, exact in any float
    dtype) with the backend's own cache update, one coordinate per probe, and reading
    where each landed. None when the cache is not blocks-first, a block holds anything
    but one copy of each element, or the coordinates do not fit the dtype exactly."""
    if kv_cache.dim() < 3 or kv_cache.shape[0] == 2:
        return None
    heads, head = layer.num_kv_heads, layer.head_size
    block_size = kv_cache.shape[2]
    if max(block_size, head, heads, 2) + 1 > 256:  # bf16 holds integers up to 256 exactly
        return None
    scratch = torch.zeros((1, *kv_cache.shape[1:]), dtype=kv_cache.dtype,
                          device=kv_cache.device)
    elements = scratch[0].numel()
    if elements != 2 * heads * block_size * head:
        return None
    slots = torch.arange(block_size, device=kv_cache.device)
    grid = torch.meshgrid(torch.arange(block_size), torch.arange(heads), torch.arange(head),
                          indexing="ij")  # [position, head, dim] each
    coordinates = []
    for probe in range(4):  # kind, head, position, dimension (+ 1: 0 marks unwritten)
        if probe == 0:
            k_values, v_values = torch.ones(grid[0].shape), torch.full(grid[0].shape, 2.0)
        else:
            values = {1: grid[1], 2: grid[0], 3: grid[2]}[probe].float() + 1
            k_values, v_values = values, values
        scratch.zero_()
        impl.do_kv_cache_update(layer, k_values.to(kv_cache.dtype).to(kv_cache.device),
                                v_values.to(kv_cache.dtype).to(kv_cache.device), scratch,
                                slots)
        coordinates.append(scratch[0].reshape(-1).float().cpu().round().long() - 1)
    kind, head_of, position, dim = coordinates
    if bool((kind < 0).any()) or bool((kind > 1).any()):
        return None
    index = torch.full((2, heads, block_size, head), -1, dtype=torch.long)
    index[kind, head_of, position, dim] = torch.arange(elements)
    if bool((index < 0).any()):
        return None
    return ProbedLayout(index)


def read_slots(reader, kv_cache: torch.Tensor, slots: torch.Tensor):
    """K and V (``[N, kv_heads, head]`` each) at ``slots`` of a cache that ``reader`` reads.
    Slot numbers are the same whether the cache is viewed in manager or kernel blocks."""
    if isinstance(reader, ProbedLayout):
        return reader.slots(kv_cache, slots.long())
    return SLOT_READERS[reader](kv_cache, slots.long())


_READERS = {4: (_read_cpu, _read_heads_kv_last), 5: (_read_kv_first, _read_kv_second)}
_DETECTED: dict[tuple, object] = {}
_KERNEL_REFUSED: set[tuple] = set()  # layouts whose start-up kernel check failed


def _layout_key(impl, layer, kv_cache: torch.Tensor) -> tuple:
    return (type(impl), getattr(layer, "isa", None), kv_cache.dtype, tuple(kv_cache.shape[1:]))


def kernel_allowed(impl, layer, kv_cache: torch.Tensor) -> bool:
    """The kernel may serve this layer: enabled, and its start-up check passed."""
    return kernel_enabled(kv_cache) and _layout_key(impl, layer, kv_cache) not in _KERNEL_REFUSED


def kv_reader(impl, layer, kv_cache: torch.Tensor):
    """The reader that reproduces what ``impl.do_kv_cache_update`` wrote (cached)."""
    key = _layout_key(impl, layer, kv_cache)
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
    readers = list(_READERS.get(kv_cache.dim(), ()))
    probed = probe_layout(impl, layer, kv_cache)
    if probed is not None:  # tried last: the known layouts have their own fast paths
        readers.append(probed)
    for reader in readers:
        try:
            got_k, got_v = reader(scratch, block_table, length)
        except RuntimeError:
            continue
        picked = torch.tensor([length - 1, 0, block_size], device=kv_cache.device)
        slot_k, slot_v = read_slots(reader, scratch, slots[picked])
        if (got_k.shape == (heads, length, head) and torch.equal(got_k.cpu(), k.transpose(0, 1))
                and torch.equal(got_v.cpu(), v.transpose(0, 1))
                and torch.equal(slot_k.cpu(), k[picked.cpu()])
                and torch.equal(slot_v.cpu(), v[picked.cpu()])):
            _DETECTED[key] = reader
            if kernel_enabled(kv_cache) and not check_kernel_on_layout(
                    reader, scratch, block_table, length, layer.num_heads, impl.scale):
                _KERNEL_REFUSED.add(key)
                logger.warning("Graft: the Triton tree-attention kernel disagrees with the "
                               "SDPA path on %s's KV layout; using SDPA",
                               type(impl).__name__)
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
    """Replacement body of the attention implementation's ``forward``."""
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
    plan.layers[layer.layer_name] = layer
    if plan.store is not None:
        index = plan.store_rows
        plan.store.append(layer, key[index], value[index])
    if plan.write_slots is not None:
        impl.do_kv_cache_update(layer, key, value, kv_cache, plan.write_slots)
    out_view = output.view(output.shape[0], query.shape[1], -1)
    views = kernel_cache_views(read_paged_kv, kv_cache) \
        if kernel_allowed(impl, layer, kv_cache) and kernel_serves(plan) else None
    if views is not None:
        kernel_tree_rows(plan, query, views, impl.scale, out_view)
    else:
        plan.sdpa_layers += 1
        sdpa_tree_rows(plan, layer.layer_name, query, key, value, kv_cache, read_paged_kv,
                       impl.scale, out_view)
    if not query.is_cuda:  # on a GPU this is part of the forward (timing it per layer
        plan.seconds += time.perf_counter() - start  # would synchronise every layer)
    return output


def kernel_serves(plan: TreeAttentionPlan) -> bool:
    """Whether the Triton kernel can compute every tree row of ``plan``. It reads the
    forward's own rows and earlier tree rows from the paged cache, which a drafter's
    forward in store mode (``plan.store``: its rows kept aside, none written to the
    cache) leaves stale, and it packs a tree's mask into one word (at most
    ``MAX_TREE_NODES`` tree rows, earlier and current: budget 64 and more would stop the
    engine there). Anything else takes the SDPA path."""
    from vllm_graft.kernels.tree_mask import MAX_TREE_NODES

    return plan.store is None and all(
        r.cached_tree_rows + r.num_rows <= MAX_TREE_NODES
        and (r.context_rows is None or not r.context_rows.numel()) for r in plan.requests)


def sdpa_tree_rows(plan: TreeAttentionPlan, layer_name: str, query, key, value, kv_cache,
                   read_paged_kv, scale: float, out_view: torch.Tensor) -> None:
    """The reference path: per request, the prefix (and the earlier tree rows of cache
    mode) read from the paged cache, earlier draft rows of store mode from the store,
    this forward's rows from ``key``/``value``; SDPA in fp32 (grouped-query heads share
    their K/V without copies)."""
    for req in plan.requests:
        rows = slice(req.query_start, req.query_start + req.num_rows)
        parts_k, parts_v = [], []
        cached = req.prefix_len + req.cached_tree_rows
        if cached:
            k_prefix, v_prefix = read_paged_kv(kv_cache, req.block_table, cached)
            parts_k.append(k_prefix)
            parts_v.append(v_prefix)
        if req.context_rows is not None and req.context_rows.numel():
            k_ctx, v_ctx = plan.store.rows(layer_name, req.context_rows)
            parts_k.append(k_ctx.transpose(0, 1))
            parts_v.append(v_ctx.transpose(0, 1))
        parts_k.append(key[rows].transpose(0, 1))
        parts_v.append(value[rows].transpose(0, 1))
        k_all = torch.cat(parts_k, dim=1).float()  # [kv_heads, S, head]
        v_all = torch.cat(parts_v, dim=1).float()
        q = query[rows].transpose(0, 1).float()  # [heads, n, head]
        out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=req.visible(q.device),
                                             scale=scale, enable_gqa=q.shape[0] != k_all.shape[0])
        out_view[rows] = out.transpose(0, 1).to(out_view.dtype)


# ---- the Triton kernel path --------------------------------------------------------------
# The tree rows' own K/V are in the paged cache already (vLLM writes every row's K/V to
# its slot before the attention forward; a drafter's plan in cache mode writes them
# itself), so the kernel reads prefix and tree alike from the cache, in one launch per
# layer for all requests. Plans whose rows also attend to K/V kept outside the cache
# (the drafter's later tree steps in store mode) use the SDPA path.
TREE_KERNEL_ENV = "VLLM_GRAFT_TREE_KERNEL"


def kernel_enabled(kv_cache: torch.Tensor) -> bool:
    """The Triton kernel serves CUDA caches unless ``VLLM_GRAFT_TREE_KERNEL=0``."""
    if not kv_cache.is_cuda or os.environ.get(TREE_KERNEL_ENV, "1") == "0":
        return False
    return _triton_available()


def check_kernel_on_layout(reader, scratch: torch.Tensor, block_table: torch.Tensor,
                           length: int, heads: int, scale: float) -> bool:
    """Start-up check, on a scratch cache the backend itself wrote: the kernel's tree rows
    equal the SDPA path's. A layout the kernel misreads is served by SDPA instead."""
    views = kernel_cache_views(reader, scratch)
    if views is None:
        return False
    rows = 3  # the last three positions form a tree: root, and two children of the root
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool,
                        device=scratch.device)
    plan = TreeAttentionPlan(requests=[TreeRequestPlan(
        query_start=0, num_rows=rows, prefix_len=length - rows, block_table=block_table,
        mask=mask)])
    head = views[0].shape[3]
    gen = torch.Generator(device="cpu").manual_seed(1)
    query = torch.randn(rows, heads, head, generator=gen).to(scratch.device, scratch.dtype)
    keys, values = reader(scratch, block_table, length)  # [kv_heads, length, head]
    expected = torch.empty_like(query)
    sdpa_tree_rows(plan, "", query, keys[:, -rows:].transpose(0, 1),
                   values[:, -rows:].transpose(0, 1), scratch, reader, scale, expected)
    got = torch.empty_like(query)
    kernel_tree_rows(plan, query, views, scale, got)
    error = float((got.float() - expected.float()).norm() / expected.float().norm())
    return error < 2e-2


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def kernel_cache_views(reader, kv_cache: torch.Tensor):
    """``(key_cache, value_cache)`` as ``[blocks, block_size, kv_heads, head]`` strided views
    of ``kv_cache`` for the layouts the kernel reads, or None (the CPU layout stores K
    transposed within a block)."""
    if reader is _read_kv_first:
        return kv_cache[0], kv_cache[1]
    if reader is _read_kv_second:
        return kv_cache[:, 0], kv_cache[:, 1]
    if reader is _read_heads_kv_last:
        head = kv_cache.shape[-1] // 2
        return (kv_cache[..., :head].permute(0, 2, 1, 3),
                kv_cache[..., head:].permute(0, 2, 1, 3))
    return None


@dataclass
class KernelBatch:
    """The plan's requests in the kernel's layout (built once per forward, shared by all
    layers): which rows of the forward are tree rows, and per request its block table,
    lengths and bit-packed tree mask."""

    rows: torch.Tensor  # [T] rows of the forward, request after request
    block_table: torch.Tensor  # [R, max_blocks] int32
    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32
    tree_start: torch.Tensor  # [R] int32
    tree_bits: torch.Tensor  # [T] int64

    @classmethod
    def from_plan(cls, plan: TreeAttentionPlan, device) -> KernelBatch:
        """Any plan the kernel serves (:func:`kernel_serves`), request by request."""
        from vllm_graft.kernels.tree_mask import pack_row_bits

        requests = plan.requests
        rows = torch.cat([torch.arange(r.query_start, r.query_start + r.num_rows)
                          for r in requests])
        counts = torch.tensor([r.num_rows for r in requests], dtype=torch.int32)
        prefix = torch.tensor([r.prefix_len for r in requests], dtype=torch.int32)
        earlier = torch.tensor([r.cached_tree_rows for r in requests], dtype=torch.int32)
        widths = {r.block_table.numel() for r in requests}
        if len(widths) == 1:  # rows of one table: one copy
            table = torch.stack([r.block_table for r in requests]).to(device, torch.int32)
        else:
            table = torch.zeros((len(requests), max(widths)), dtype=torch.int32,
                                device=device)
            for i, r in enumerate(requests):
                table[i, :r.block_table.numel()] = r.block_table.to(device)
        # packed where the masks are (a verification's on the host), then one copy
        bits = torch.cat([pack_row_bits(r.mask[:, -(r.cached_tree_rows + r.num_rows):])
                          for r in requests]).to(device)
        return cls(rows=rows.to(device), block_table=table,
                   query_start_loc=torch.cat([counts.new_zeros(1), counts.cumsum(0)]
                                             ).to(torch.int32).to(device),
                   seq_lens=(prefix + earlier + counts).to(device),
                   tree_start=prefix.to(device), tree_bits=bits)

    @classmethod
    def uniform(cls, block_table: torch.Tensor, prefix_len: torch.Tensor, mask: torch.Tensor
                ) -> KernelBatch:
        """The batch of a drafter's tree step in cache mode, built with a few batched ops
        (no per-request work): ``R`` requests of ``W`` rows each, request ``r``'s rows
        ``[r * W, (r + 1) * W)`` of the forward; ``block_table`` ``[R, max_blocks]``
        (kernel-block ids), ``prefix_len`` ``[R]``, ``mask`` ``[R, W, C + W]`` over the
        ``C`` earlier tree rows (in the cache after the prefix) and the current ones."""
        from vllm_graft.kernels.tree_mask import pack_row_bits

        requests, width, tree_rows = mask.shape
        device = mask.device
        prefix = prefix_len.to(device=device, dtype=torch.int32)
        return cls(rows=torch.arange(requests * width, device=device),
                   block_table=block_table.to(torch.int32),
                   query_start_loc=torch.arange(0, (requests + 1) * width, width,
                                                dtype=torch.int32, device=device),
                   seq_lens=prefix + tree_rows, tree_start=prefix,
                   tree_bits=pack_row_bits(mask).reshape(-1))


def kernel_tree_rows(plan: TreeAttentionPlan, query: torch.Tensor, views, scale: float,
                     out_view: torch.Tensor) -> None:
    from vllm_graft.kernels.tree_attention_triton import paged_tree_attention

    if plan.kernel_batch is None:
        plan.kernel_batch = KernelBatch.from_plan(plan, query.device)
    batch = plan.kernel_batch
    key_cache, value_cache = views
    out = paged_tree_attention(
        query[batch.rows], key_cache, value_cache, batch.block_table, batch.query_start_loc,
        batch.seq_lens, batch.tree_start, batch.tree_bits, scale)
    out_view[batch.rows] = out.view(out.shape[0], out_view.shape[1], -1).to(out_view.dtype)
