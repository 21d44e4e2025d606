"""The adapter's kernel path (``kernel_tree_rows``) against its SDPA path on the same
tree attention plans, for every paged-KV layout the kernel reads, and the start-up check
that decides whether a layout is served by the kernel (under Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch

from vllm_graft.kernels.tree_mask import unpack_ancestor_bits
from vllm_graft.testing.paged_batches import random_tree_bits, relative_error
from vllm_graft.vllm.tree_attention import (KernelBatch, TreeAttentionPlan, TreeRequestPlan,
                                            _read_heads_kv_last, _read_kv_first,
                                            _read_kv_second, check_kernel_on_layout,
                                            kernel_cache_views, kernel_tree_rows,
                                            sdpa_tree_rows)

HEADS, KV_HEADS, HEAD, BLOCK, BLOCKS = 4, 2, 64, 16, 24

LAYOUTS = {
    "kv_first": (_read_kv_first, (2, BLOCKS, BLOCK, KV_HEADS, HEAD)),
    "blocks_first": (_read_kv_second, (BLOCKS, 2, BLOCK, KV_HEADS, HEAD)),
    "heads_kv_last": (_read_heads_kv_last, (BLOCKS, KV_HEADS, BLOCK, 2 * HEAD)),
}


def plan_and_rows(generator, tree_sizes, prefixes):
    """A plan of tree requests laid out after one another in the forward's rows."""
    order = torch.randperm(BLOCKS, generator=generator)
    requests, start, used = [], 0, 0
    for n, prefix in zip(tree_sizes, prefixes):
        blocks = (prefix + n + BLOCK - 1) // BLOCK
        table = order[used:used + blocks].to(torch.int32)
        used += blocks
        mask = unpack_ancestor_bits(random_tree_bits(n, generator), n)
        requests.append(TreeRequestPlan(query_start=start, num_rows=n, prefix_len=prefix,
                                        block_table=table, mask=mask))
        start += n
    return TreeAttentionPlan(requests=requests), start


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kernel_path_equals_sdpa_path(layout):
    reader, shape = LAYOUTS[layout]
    generator = torch.Generator().manual_seed(11)
    kv_cache = torch.randn(shape, generator=generator)
    plan, rows = plan_and_rows(generator, tree_sizes=[1, 9, 33], prefixes=[40, 0, 77])
    # this forward's rows: their K/V sit in the cache right after each prefix
    keys = torch.empty(rows, KV_HEADS, HEAD)
    values = torch.empty(rows, KV_HEADS, HEAD)
    for req in plan.requests:
        k, v = reader(kv_cache, req.block_table, req.prefix_len + req.num_rows)
        current = slice(req.query_start, req.query_start + req.num_rows)
        keys[current] = k[:, req.prefix_len:].transpose(0, 1)
        values[current] = v[:, req.prefix_len:].transpose(0, 1)
    query = torch.randn(rows + 5, HEADS, HEAD, generator=generator)  # +5: rows of others
    expected = torch.zeros_like(query)
    sdpa_tree_rows(plan, "layer", query, keys, values, kv_cache, reader, 0.125, expected)
    got = torch.zeros_like(query)
    kernel_tree_rows(plan, query, kernel_cache_views(reader, kv_cache), 0.125, got)
    assert relative_error(got[:rows], expected[:rows]) < 1e-5
    assert torch.equal(got[rows:], torch.zeros(5, HEADS, HEAD)), "other rows untouched"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("earlier", [0, 8, 56])
def test_drafter_steps_with_earlier_rows_in_the_cache(layout, earlier):
    """A drafter's draft step in cache mode: each request's ``earlier`` rows of the
    previous steps sit in the cache after its prefix, its 8 current rows after them, and
    each current row sees some of the earlier ones. The kernel, fed the batch built
    request by request or with the batched builder, computes what the SDPA path does."""
    reader, shape = LAYOUTS[layout]
    generator = torch.Generator().manual_seed(5 + earlier)
    kv_cache = torch.randn(shape, generator=generator)
    width, prefixes = 8, [23, 0, 40]
    order = torch.randperm(BLOCKS, generator=generator)
    blocks_each = (max(prefixes) + earlier + width + BLOCK - 1) // BLOCK
    tables = order[:blocks_each * len(prefixes)].view(len(prefixes), blocks_each).to(torch.int32)
    mask = torch.rand(len(prefixes), width, earlier + width, generator=generator) < 0.4
    mask[:, :, earlier:] = torch.eye(width, dtype=torch.bool)
    plan = TreeAttentionPlan(requests=[
        TreeRequestPlan(query_start=r * width, num_rows=width, prefix_len=prefix,
                        block_table=tables[r], mask=mask[r], cached_tree_rows=earlier)
        for r, prefix in enumerate(prefixes)], replace_all=True)
    rows = width * len(prefixes)
    keys = torch.empty(rows, KV_HEADS, HEAD)
    values = torch.empty(rows, KV_HEADS, HEAD)
    for req in plan.requests:  # the current rows' K/V, as the cache holds them
        end = req.prefix_len + earlier + width
        k, v = reader(kv_cache, req.block_table, end)
        current = slice(req.query_start, req.query_start + width)
        keys[current] = k[:, end - width:].transpose(0, 1)
        values[current] = v[:, end - width:].transpose(0, 1)
    query = torch.randn(rows, HEADS, HEAD, generator=generator)
    expected = torch.zeros_like(query)
    sdpa_tree_rows(plan, "layer", query, keys, values, kv_cache, reader, 0.125, expected)
    views = kernel_cache_views(reader, kv_cache)
    by_request = torch.zeros_like(query)
    kernel_tree_rows(plan, query, views, 0.125, by_request)
    plan.kernel_batch = KernelBatch.uniform(tables, torch.tensor(prefixes), mask)
    batched = torch.zeros_like(query)
    kernel_tree_rows(plan, query, views, 0.125, batched)
    assert relative_error(by_request, expected) < 1e-5
    assert relative_error(batched, expected) < 1e-5
    if earlier:  # the earlier rows matter: hiding them changes the result
        hidden = plan.kernel_batch.tree_bits & ~((1 << earlier) - 1)
        plan.kernel_batch.tree_bits = hidden
        blind = torch.zeros_like(query)
        kernel_tree_rows(plan, query, views, 0.125, blind)
        assert relative_error(blind, expected) > 1e-2


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_startup_check_accepts_the_layouts_the_kernel_reads(layout):
    reader, shape = LAYOUTS[layout]
    scratch = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    table = torch.tensor([2, 1, 0], dtype=torch.int32)
    assert check_kernel_on_layout(reader, scratch, table, BLOCK + 5, HEADS, 0.125)


def test_startup_check_refuses_views_that_misread_the_cache(monkeypatch):
    # Negative control: views that swap K and V disagree with the SDPA reference, and
    # the check must say so (the layer then stays on the SDPA path).
    from vllm_graft.vllm import tree_attention

    reader, shape = LAYOUTS["kv_first"]
    scratch = torch.randn(shape, generator=torch.Generator().manual_seed(4))
    table = torch.tensor([2, 1, 0], dtype=torch.int32)
    monkeypatch.setattr(tree_attention, "kernel_cache_views",
                        lambda reader, cache: (cache[1], cache[0]))
    assert not check_kernel_on_layout(reader, scratch, table, BLOCK + 5, HEADS, 0.125)
