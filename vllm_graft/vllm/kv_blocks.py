"""How Graft addresses vLLM's paged KV cache: the one place that turns block tables into
slots and kernel-block tables.

vLLM writes K/V through *slot mappings* in the KV-cache manager's blocks
(``slot = block * block_size + offset``). A backend may ask for smaller *kernel blocks*:
the per-layer cache tensors are then viewed in kernel blocks and vLLM hands its kernels
a mapped block table (``map_to_kernel_block_table`` in ``vllm/v1/worker/utils.py``).
Graft reads the cache itself (tree attention), so it maps the same way; indexing the
kernel-block view with the manager's table would silently read other requests' K/V.
Manager block ``b`` holds kernel blocks ``b * r .. b * r + r - 1`` with
``r = block_size // kernel_block_size``, and slot numbers are the same in both views.

Graft serves models whose attention layers share one KV-cache group (checked at
start-up), so the target and the drafter use the same table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class KVLayoutError(ValueError):
    """The engine's KV-cache layout is one Graft cannot address."""


@dataclass(frozen=True)
class PagedKVLayout:
    """Block sizes of the KV-cache group Graft reads and writes.

    group_id: the KV-cache group of the attention layers (Graft needs exactly one)
    block_size: the manager's block size, which slot mappings use
    kernel_block_size: the block size the layers' cache tensors are viewed in
    """

    group_id: int
    block_size: int
    kernel_block_size: int

    def __post_init__(self):
        if self.kernel_block_size <= 0 or self.block_size % self.kernel_block_size:
            raise KVLayoutError(
                f"KV-cache block size {self.block_size} is not a multiple of the kernel "
                f"block size {self.kernel_block_size}")

    @property
    def kernel_blocks_per_block(self) -> int:
        return self.block_size // self.kernel_block_size

    @classmethod
    def from_runner(cls, runner) -> PagedKVLayout:
        """The layout of a V1 model runner whose KV cache is initialised.

        Raises:
            KVLayoutError: several KV-cache groups, or a packed cache whose kernel blocks
                are not consecutive (``kernel_block_stride``).
        """
        groups = runner.kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise KVLayoutError(
                f"Graft supports models whose attention layers share one KV-cache group "
                f"(full attention in every layer); this model has {len(groups)} groups")
        block_size = runner.input_batch.block_table[0].block_size
        kernel_block_size = block_size
        for attn_group in runner.attn_groups[0]:
            if getattr(attn_group, "kernel_block_stride", 0):
                raise KVLayoutError(
                    "Graft cannot address a packed KV cache whose kernel blocks are "
                    "interleaved with other layers' pages (kernel_block_stride "
                    f"{attn_group.kernel_block_stride})")
            kernel_block_size = getattr(attn_group, "kernel_block_size", None) or block_size
        return cls(group_id=0, block_size=block_size, kernel_block_size=kernel_block_size)

    def block_table(self, runner) -> torch.Tensor:
        """``[num_reqs, max_blocks]`` int32 manager block ids of the persistent batch."""
        table = runner.input_batch.block_table[self.group_id]
        return table.get_device_tensor(runner.input_batch.num_reqs)

    def allocated_slots(self, runner, batch_rows) -> np.ndarray:
        """Slots allocated to the requests at ``batch_rows`` of the persistent batch (its
        block table's blocks times the block size, read on the host): positions
        ``[0, allocated)`` may be written."""
        table = runner.input_batch.block_table[self.group_id]
        return table.num_blocks_per_row[batch_rows].astype(np.int64) * self.block_size

    def kernel_block_table(self, block_table: torch.Tensor) -> torch.Tensor:
        """Manager block ids (``[..., blocks]``) to the kernel-block ids that index the
        layers' cache tensors (``[..., blocks * r]``)."""
        ratio = self.kernel_blocks_per_block
        if ratio == 1:
            return block_table
        offsets = torch.arange(ratio, dtype=block_table.dtype, device=block_table.device)
        return (block_table.unsqueeze(-1) * ratio + offsets).flatten(-2)

    def slots(self, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Cache slots of ``positions`` (int64), each row of ``block_table`` (manager ids)
        paired with the same row of ``positions``; what vLLM's slot mapping holds."""
        blocks = block_table.gather(-1, (positions // self.block_size).long())
        return blocks.long() * self.block_size + positions % self.block_size
