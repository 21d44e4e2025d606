"""Bit-packed tree masks and the torch reference's visibility rule (no Triton needed)."""

from __future__ import annotations

import pytest
import torch

from vllm_graft.kernels.tree_attention_reference import visible_positions
from vllm_graft.kernels.tree_mask import pack_ancestor_bits, unpack_ancestor_bits


def test_pack_roundtrip_uses_all_64_bits():
    visible = torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(0)) < 0.5
    visible[:, 63, 63] = True  # the sign bit
    bits = pack_ancestor_bits(visible)
    assert bits.dtype == torch.int64 and bits.shape == (3, 64)
    assert torch.equal(unpack_ancestor_bits(bits, 64), visible)


@pytest.mark.parametrize("shape, message", [((4, 5), "must be"), ((65, 65), "at most 64")])
def test_pack_rejects_bad_masks(shape, message):
    with pytest.raises(ValueError, match=message):
        pack_ancestor_bits(torch.ones(shape, dtype=torch.bool))


def test_visibility_of_a_small_tree_after_context():
    # context of 3 positions, then a tree: 0 root, 1 and 2 children of 0, 3 child of 2
    visible = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]],
                           dtype=torch.bool)
    got = visible_positions(seq_len=7, q_len=4, tree_start=3,
                            tree_bits=pack_ancestor_bits(visible))
    expected = torch.cat([torch.ones(4, 3, dtype=torch.bool), visible], dim=1)
    assert torch.equal(got, expected)


def test_rows_without_a_tree_are_causal():
    got = visible_positions(seq_len=5, q_len=3, tree_start=5,
                            tree_bits=torch.zeros(3, dtype=torch.int64))
    assert torch.equal(got, torch.ones(3, 5, dtype=torch.bool).tril(diagonal=2))


def test_gpu_check_imports_need_no_vllm():
    # scripts/gpu_check.sh runs where vLLM is not installed: what it imports must not
    # import vLLM (blocked here so a stray import fails)
    import subprocess
    import sys

    script = ("import sys\nsys.modules['vllm'] = None\n"
              "import vllm_graft.vllm.tree_attention, vllm_graft.kernels, "
              "vllm_graft.testing.paged_batches, vllm_graft.core.budget\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_kernel_serves_only_plans_whose_rows_it_can_read():
    """The Triton kernel reads a forward's own rows from the paged cache and packs each
    tree's mask into one word. A drafter's forward in store mode (rows kept in a store,
    none written to the cache: the kernel would read stale K/V, on a GPU, from its first
    step), a tree of more than 64 rows (budget 64 and more: the packer raises inside
    the forward, counting a drafter's earlier rows in the cache) and rows that see rows
    of the store take the SDPA path."""
    from vllm_graft.vllm.tree_attention import (TreeAttentionPlan, TreeRequestPlan,
                                                TreeKVStore, kernel_serves)

    def request(rows: int, context: int = 0, cached: int = 0) -> TreeRequestPlan:
        return TreeRequestPlan(query_start=0, num_rows=rows, prefix_len=8,
                               block_table=torch.zeros(1, dtype=torch.int32),
                               mask=torch.ones(rows, context + cached + rows,
                                               dtype=torch.bool),
                               context_rows=torch.arange(context) if context else None,
                               cached_tree_rows=cached)

    assert kernel_serves(TreeAttentionPlan(requests=[request(61), request(64)]))
    assert not kernel_serves(TreeAttentionPlan(requests=[request(61), request(65)]))
    assert not kernel_serves(TreeAttentionPlan(requests=[request(5, context=3)]))
    # a drafter's step in cache mode: its earlier rows are in the cache, and count
    # towards the 64 rows one word of mask holds
    assert kernel_serves(TreeAttentionPlan(requests=[request(10, cached=50)]))
    assert not kernel_serves(TreeAttentionPlan(requests=[request(10, cached=60)]))
    assert not kernel_serves(TreeAttentionPlan(requests=[request(5)], store=TreeKVStore()))
