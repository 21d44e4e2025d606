"""Random batches in the layout of Graft's paged tree attention (tests, GPU check).

A batch is the keyword arguments of ``paged_tree_attention`` and its torch reference:
requests with a context already in a paged cache (blocks in random order), each followed
by either ordinary causal rows (a prefill chunk or a decode) or the rows of a random
token tree.
"""

from __future__ import annotations

import math

import torch

from vllm_graft.kernels.tree_mask import pack_ancestor_bits


def random_tree_bits(nodes: int, generator: torch.Generator) -> torch.Tensor:
    """Ancestor bits of a random tree whose nodes come parents first (bit i of row i set)."""
    visible = torch.zeros(nodes, nodes, dtype=torch.bool)
    for node in range(nodes):
        if node:
            parent = int(torch.randint(0, node, (1,), generator=generator))
            visible[node] = visible[parent]
        visible[node, node] = True
    return pack_ancestor_bits(visible)


def paged_batch(requests, heads: int, kv_heads: int, head_dim: int, block_size: int,
                dtype: torch.dtype, device: torch.device | str,
                generator: torch.Generator, layout: str = "kv_first") -> dict:
    """``requests``: ``(context, query_rows, is_tree)`` each. The caches are strided views
    of one vLLM-shaped tensor: ``kv_first`` ``[2, blocks, block, Hkv, D]`` (FlashAttention)
    or ``blocks_first`` ``[blocks, 2, block, Hkv, D]``."""
    blocks_per_request = [(c + q + block_size - 1) // block_size for c, q, _ in requests]
    num_blocks = sum(blocks_per_request) + 2
    shape = (num_blocks, block_size, kv_heads, head_dim)
    if layout == "kv_first":
        kv = torch.randn((2, *shape), generator=generator).to(device, dtype)
        key_cache, value_cache = kv[0], kv[1]
    elif layout == "blocks_first":
        kv = torch.randn((shape[0], 2, *shape[1:]), generator=generator).to(device, dtype)
        key_cache, value_cache = kv[:, 0], kv[:, 1]
    else:
        raise ValueError(f"unknown layout {layout!r} (kv_first or blocks_first)")
    order = torch.randperm(num_blocks, generator=generator)
    block_table = torch.zeros(len(requests), max(blocks_per_request), dtype=torch.int32)
    query_start, seq_lens, tree_start, bits, used = [0], [], [], [], 0
    for r, (context, rows, is_tree) in enumerate(requests):
        block_table[r, :blocks_per_request[r]] = order[used:used + blocks_per_request[r]]
        used += blocks_per_request[r]
        query_start.append(query_start[-1] + rows)
        seq_lens.append(context + rows)
        if is_tree:
            tree_start.append(context)
            bits.append(random_tree_bits(rows, generator))
        else:
            tree_start.append(context + rows)
            bits.append(torch.zeros(rows, dtype=torch.int64))
    query = torch.randn(query_start[-1], heads, head_dim, generator=generator).to(device, dtype)

    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    return dict(query=query, key_cache=key_cache, value_cache=value_cache,
                block_table=block_table.to(device), query_start_loc=ints(query_start),
                seq_lens=ints(seq_lens), tree_start=ints(tree_start),
                tree_bits=torch.cat(bits).to(device), scale=1 / math.sqrt(head_dim))


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """``|got - expected| / |expected|`` in float64 (NaN anywhere gives NaN)."""
    got, expected = got.double(), expected.double()
    return float((got - expected).norm() / expected.norm())
