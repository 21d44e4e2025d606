"""The adapter's kernel path (``kernel_tree_rows``) against its SDPA path on the same
tree attention plans, for every paged-KV layout the kernel reads, and the start-up check
that decides whether a layout is served by the kernel (under Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch

from vllm_graft.kernels.tree_mask import unpack_ancestor_bits
from vllm_graft.testing.paged_batches import random_tree_bits, relative_error
from vllm_graft.vllm.tree_attention import (TreeAttentionPlan, TreeRequestPlan,
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
