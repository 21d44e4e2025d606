"""The Triton tree-attention kernel against the torch SDPA reference, under Triton's
interpreter (collected only with TRITON_INTERPRET=1; see ../conftest.py).

Fresh random inputs per case: mixed batches of prefill chunks, decodes and trees of 1 to
64 nodes, contexts off block boundaries, both paged-KV layouts, GQA, head dims 64 and 128,
fp32 / bf16 / fp16. The output is poisoned with NaN first, so an unwritten row fails; so is
the split path's workspace, so an unwritten partial (an empty K/V range) fails too.
"""

from __future__ import annotations

import pytest
import torch

from vllm_graft.kernels import paged_tree_attention_reference
from vllm_graft.kernels import tree_attention_triton
from vllm_graft.kernels.tree_attention_triton import (auto_num_splits, choose_num_splits,
                                                      paged_tree_attention)
from vllm_graft.testing.paged_batches import paged_batch, relative_error

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def run_both(batch, **tiles):
    out = torch.full_like(batch["query"], float("nan"))
    paged_tree_attention(**batch, out=out, **tiles)
    expected = paged_tree_attention_reference(**batch, compute_dtype=torch.float64)
    return out, expected


@pytest.fixture(autouse=True)
def poisoned_workspace(monkeypatch):
    def workspace(shape, device):
        return torch.full(shape, float("nan"), device=device)
    monkeypatch.setattr(tree_attention_triton, "_workspace", workspace)


def random_requests(generator, tree_sizes, plain, longest=90):
    def context():
        return int(torch.randint(0, longest, (1,), generator=generator))

    requests = [(context(), n, True) for n in tree_sizes] + [(context(), n, False) for n in plain]
    order = torch.randperm(len(requests), generator=generator).tolist()
    return [requests[i] for i in order]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (8, 2)])
@pytest.mark.parametrize("layout, block_size", [("kv_first", 16), ("blocks_first", 32)])
def test_matches_reference(dtype, head_dim, heads, kv_heads, layout, block_size):
    seed = hash((str(dtype), head_dim, heads, layout)) % 2**31
    generator = torch.Generator().manual_seed(seed)
    requests = random_requests(generator, tree_sizes=[1, 5, 64], plain=[1, 21])
    batch = paged_batch(requests, heads, kv_heads, head_dim, block_size, dtype, "cpu",
                        generator, layout)
    out, expected = run_both(batch, block_m=16, block_n=16)
    assert torch.isfinite(out).all(), "some rows were not written"
    assert relative_error(out, expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize("block_m, block_n", [(16, 32), (32, 16), (64, 64)])
def test_tile_shapes_agree(block_m, block_n):
    generator = torch.Generator().manual_seed(block_m * 100 + block_n)
    requests = random_requests(generator, tree_sizes=[3, 60], plain=[40, 1])
    batch = paged_batch(requests, 8, 2, 64, 16, torch.float32, "cpu", generator)
    out, expected = run_both(batch, block_m=block_m, block_n=block_n)
    assert relative_error(out, expected) <= TOLERANCE[torch.float32]


def test_tree_mask_changes_the_result():
    # Negative control: the same rows attended causally (as a plain prefill would) must
    # differ from the tree result, or the mask is not reaching the kernel.
    generator = torch.Generator().manual_seed(5)
    batch = paged_batch([(20, 12, True)], 2, 2, 64, 16, torch.float32, "cpu", generator)
    tree_out, _ = run_both(batch, block_m=16, block_n=16)
    causal = dict(batch, tree_start=batch["seq_lens"].clone())
    causal_out, causal_expected = run_both(causal, block_m=16, block_n=16)
    assert relative_error(causal_out, causal_expected) <= TOLERANCE[torch.float32]
    differs = (tree_out - causal_out).abs().amax(dim=(1, 2)) > 1e-4
    assert differs[1:].any() and not differs[0], "only rows past the root see other nodes"


def test_requests_with_no_rows_and_empty_batch():
    generator = torch.Generator().manual_seed(6)
    batch = paged_batch([(10, 4, True), (7, 1, False)], 2, 2, 64, 16, torch.float32, "cpu",
                        generator)
    # request 0 has no rows in this forward; request 1 gets the 4 tree rows
    batch["query"], batch["tree_bits"] = batch["query"][:4], batch["tree_bits"][:4]
    batch["query_start_loc"] = torch.tensor([0, 0, 4], dtype=torch.int32)
    batch["seq_lens"] = torch.tensor([10, 14], dtype=torch.int32)
    batch["tree_start"] = torch.tensor([10, 10], dtype=torch.int32)
    out, expected = run_both(batch, block_m=16, block_n=16)
    assert relative_error(out, expected) <= TOLERANCE[torch.float32]
    empty = {name: value[:0] if name in ("query", "tree_bits") else value
             for name, value in batch.items()}
    empty["query_start_loc"] = torch.zeros(3, dtype=torch.int32)
    assert paged_tree_attention(**empty).shape == (0, 2, 64)


SPLIT_CASES = [  # dtype, heads, kv_heads, head_dim, layout, block_size, num_splits
    (torch.float32, 8, 2, 64, "kv_first", 16, 2),
    (torch.float32, 2, 2, 64, "blocks_first", 32, 7),
    (torch.bfloat16, 8, 2, 64, "blocks_first", 16, 3),
    (torch.bfloat16, 4, 1, 128, "kv_first", 16, 2),
    (torch.float16, 8, 2, 64, "kv_first", 32, 4),
    (torch.float16, 2, 2, 128, "blocks_first", 16, 5),
]


@pytest.mark.parametrize("dtype, heads, kv_heads, head_dim, layout, block_size, num_splits",
                         SPLIT_CASES)
def test_split_matches_reference(dtype, heads, kv_heads, head_dim, layout, block_size,
                                 num_splits):
    # Trees of 1 to 64 nodes beside a decode and a prefill chunk over several query tiles;
    # contexts up to 160 split in runs of 16-position tiles, some past a short context.
    generator = torch.Generator().manual_seed(num_splits * 1000 + heads * 10 + head_dim)
    tree = 2 + int(torch.randint(0, 60, (1,), generator=generator))
    requests = random_requests(generator, tree_sizes=[1, tree, 64], plain=[1, 21],
                               longest=160)
    batch = paged_batch(requests, heads, kv_heads, head_dim, block_size, dtype, "cpu",
                        generator, layout)
    out, expected = run_both(batch, block_m=16, block_n=16, num_splits=num_splits)
    assert torch.isfinite(out).all(), "some rows were not written"
    assert relative_error(out, expected) <= TOLERANCE[dtype]


def test_split_empty_ranges_and_rows_of_no_request():
    # Contexts of one K/V tile: all splits but the first are empty. Three trailing rows
    # belong to no request (padding): neither path writes them.
    generator = torch.Generator().manual_seed(8)
    batch = paged_batch([(0, 1, False), (3, 2, True), (9, 5, True), (12, 1, False)], 8, 2,
                        64, 16, torch.float32, "cpu", generator)
    batch["query"] = torch.cat([batch["query"], torch.randn(3, 8, 64, generator=generator)])
    batch["tree_bits"] = torch.cat([batch["tree_bits"], torch.zeros(3, dtype=torch.int64)])
    single, expected = run_both(batch, block_m=16, block_n=16, num_splits=1)
    split, _ = run_both(batch, block_m=16, block_n=16, num_splits=6)
    assert split[-3:].isnan().all() and single[-3:].isnan().all()
    assert relative_error(split[:-3], expected[:-3]) <= TOLERANCE[torch.float32]
    assert torch.allclose(split[:-3], single[:-3], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("block_m, block_n, num_splits", [(64, 32, 3), (32, 16, 2)])
def test_split_agrees_with_single_launch(block_m, block_n, num_splits):
    generator = torch.Generator().manual_seed(block_m + num_splits)
    requests = random_requests(generator, tree_sizes=[3, 60], plain=[40], longest=200)
    batch = paged_batch(requests, 8, 2, 64, 16, torch.float32, "cpu", generator)
    single, expected = run_both(batch, block_m=block_m, block_n=block_n, num_splits=1)
    split, _ = run_both(batch, block_m=block_m, block_n=block_n, num_splits=num_splits)
    assert relative_error(split, expected) <= TOLERANCE[torch.float32]
    assert relative_error(split, single) <= 1e-6


def test_auto_num_splits_from_shapes():
    # batch 1, 60-node tree, 8 KV heads, 8K context on 132 SMs: 32 programs -> 8 splits
    assert choose_num_splits(programs=32, kv_tiles=129, slots=264) == 8
    assert choose_num_splits(programs=1216, kv_tiles=129, slots=264) == 1  # batch 32
    assert choose_num_splits(programs=32, kv_tiles=1, slots=264) == 1
    for programs in (1, 8, 32, 100):
        for kv_tiles in (2, 5, 17, 129, 4096):
            splits = choose_num_splits(programs, kv_tiles, slots=264)
            assert 1 <= splits <= min(kv_tiles, 64)
    generator = torch.Generator().manual_seed(9)
    batch = paged_batch([(30, 4, True)], 8, 2, 64, 16, torch.float32, "cpu", generator)
    assert auto_num_splits(batch["query"], batch["key_cache"], batch["block_table"]) == 1
    with pytest.raises(ValueError, match="num_splits"):
        paged_tree_attention(**batch, num_splits=0)


@pytest.mark.parametrize("change, message", [
    (lambda b: b.update(tree_bits=b["tree_bits"].int()), "tree_bits must be 1-D torch.int64"),
    (lambda b: b.update(block_table=b["block_table"].long()), "block_table must be 2-D"),
    (lambda b: b.update(seq_lens=b["seq_lens"][:1]), "one row per request"),
    (lambda b: b.update(value_cache=b["value_cache"].half()), "value_cache dtype"),
    (lambda b: b.update(query=b["query"][:, :3]), "not a multiple of"),
    (lambda b: b.update(tree_bits=b["tree_bits"][:-1]), "one entry per query row"),
])
def test_bad_inputs_name_the_argument(change, message):
    generator = torch.Generator().manual_seed(7)
    batch = paged_batch([(10, 4, True), (3, 2, False)], 4, 2, 64, 16, torch.float32, "cpu",
                        generator)
    change(batch)
    with pytest.raises(ValueError, match=message):
        paged_tree_attention(**batch)
