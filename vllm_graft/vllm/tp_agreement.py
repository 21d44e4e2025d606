"""Tensor-parallel ranks run one Graft: the first rank decides, the others follow.

Every rank of a tensor-parallel engine builds its own trees (the drafter's forward is
sharded too, so all ranks must draft the same batch), and every rank verifies the tree
it holds. Trees that differ between ranks would not fail loudly: each rank would run
its own attention mask, the all-reduces would mix the two, and the KV caches would
silently diverge. Some of Graft's decisions come from wall-clock measurements that no
two ranks share (the throughput guard's mode, the cost model behind ``budget: "auto"``),
so agreement cannot rest on determinism. Each step, the first rank of the
tensor-parallel group broadcasts its decision (the step's mode, then the trees to
verify) over the group's CPU channel and every other rank adopts it; with one rank
nothing is sent.
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def tensor_parallel_size() -> int:
    from vllm.distributed import get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_world_size()


def is_first_rank() -> bool:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank() == 0


def agree(value: T) -> T:
    """The first tensor-parallel rank's ``value``, on every rank (picklable values); the
    value itself where no tensor-parallel group exists (outside an engine)."""
    from vllm.distributed import get_tp_group
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if not model_parallel_is_initialized():
        return value
    group = get_tp_group()
    if group.world_size == 1:
        return value
    return group.broadcast_object(value, src=0)
