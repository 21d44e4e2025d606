"""Which successor matrix each request reads and teaches (``graft.isolation``).

The successor matrix learns online from every verified token. Shared by everyone
(``global``), one user's text changes which tokens another user's trees retrieve, and so
how fast the other's requests run: a timing side channel between tenants. ``tenant``
gives each tenant its own matrix, and a request that names no tenant a private one
(``unnamed: "private"``, the default) or the one matrix all such requests share
(``"shared"``); ``request`` gives each request a private one. Each new matrix starts as
a copy of the seed (the warm-up file, or empty), which no request changes. Matrices are
stacked partitions of one table (:class:`~vllm_graft.core.successor.SuccessorMatrix`),
so a batch mixing tenants still costs one op call per retrieval level.

All ``max_matrices`` partitions are allocated at start-up (before vLLM sizes its KV
cache from the memory left, so they never fail an engine step later). A new owner (a
tenant, or a request with a private matrix) takes a free partition, else the least
recently used one no running request holds; either way the partition is reset to the
seed first, so no owner ever reads what another one taught it. A private matrix is
freed when its request ends (or is preempted). When every partition is held, the
request runs without retrieval (drafted and copied nodes only), never with another
owner's matrix, and asks again at its next step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from enum import Enum

import torch

from vllm_graft.core.successor import SuccessorMatrix

logger = logging.getLogger(__name__)

#: partition of a request that got none (no retrieval, teaches nothing)
NO_PARTITION = -1
#: the most memory the default count of matrices takes (graft.isolation.max_matrices)
DEFAULT_MATRICES_BYTES = 1 << 30
#: matrices the default count keeps at least, whatever they take: 16 tenants and one more
FEWEST_DEFAULT_MATRICES = 17


def default_max_matrices(max_num_seqs: int, matrix_bytes: int) -> int:
    """How many matrices ``max_matrices`` unset allocates: one per running request
    (``max_num_seqs``) beside 16 tenants, at most as many as
    :data:`DEFAULT_MATRICES_BYTES` holds (at least 17). Each rank allocates them all
    before vLLM sizes its KV cache from what is left: a GPU server's 1,024 requests at
    Qwen's vocabulary (4.9 MB a matrix) would have taken 5 GB of it."""
    fit = DEFAULT_MATRICES_BYTES // max(matrix_bytes, 1)
    return max(min(max_num_seqs + 16, fit), FEWEST_DEFAULT_MATRICES)


class IsolationMode(str, Enum):
    GLOBAL = "global"  # one matrix for every request
    TENANT = "tenant"  # one matrix per tenant; requests that name none: see Unnamed
    REQUEST = "request"  # one matrix per request, reset when it ends


class Unnamed(str, Enum):
    """The matrix of a request that names no tenant, in ``tenant`` mode."""

    PRIVATE = "private"  # its own, seeded from the warm-up state, freed when it ends
    SHARED = "shared"  # the one matrix every such request reads and teaches


class MatrixPartitions:
    """Assigns requests to partitions of ``matrix`` under ``mode``.

    Each new partition starts as a copy of the seed: the matrix as it is now (the
    warm-up file, or empty). In ``global`` mode everything uses partition 0 and the
    matrix keeps one partition."""

    def __init__(self, mode: IsolationMode, matrix: SuccessorMatrix, max_matrices: int):
        if max_matrices < 1:
            raise ValueError(f"max_matrices must be >= 1, got {max_matrices}")
        self.mode = IsolationMode(mode)
        self.matrix = matrix
        self.max_matrices = 1 if self.mode is IsolationMode.GLOBAL else max_matrices
        self.seed = None  # global mode never resets a matrix: no copy kept
        if self.mode is not IsolationMode.GLOBAL:
            self.seed = matrix.partition(0).clone()
            matrix.resize_partitions_(self.max_matrices)  # new partitions start empty
        self.owner_of: OrderedDict[str, int] = OrderedDict()  # owner -> partition, LRU first
        self.partition_of: dict[str, int] = {}  # request -> partition
        self.holders: dict[int, set[str]] = {}  # partition -> requests using it
        self.evictions = 0  # idle owners whose matrix went to a newcomer
        self.refusals = 0  # steps a request ran without a matrix (all were held)

    def assign(self, req_id: str, tenant: str | None = None,
               unnamed: Unnamed | str = Unnamed.PRIVATE) -> int:
        """The partition of ``req_id``: fixed while the request stays in the batch once
        it has one (a preempted request is released, and assigned again when it resumes:
        a private matrix starts again from the seed); a request that got none (every
        partition busy) asks again at its next step. ``tenant`` None: the request names
        none, and in ``tenant`` mode ``unnamed`` says whose matrix it gets."""
        if req_id in self.partition_of:
            return self.partition_of[req_id]
        if self.mode is IsolationMode.GLOBAL:
            partition = 0
        else:
            partition = self._partition_of_owner(self._owner(req_id, tenant, unnamed))
        if partition == NO_PARTITION:
            if not self.refusals:
                logger.warning("Graft: all %d successor matrices (graft.isolation."
                               "max_matrices) are held by running requests: a request "
                               "runs without retrieval until one is free",
                               self.max_matrices)
            self.refusals += 1
        else:
            self.partition_of[req_id] = partition
            self.holders.setdefault(partition, set()).add(req_id)
        return partition

    def _owner(self, req_id: str, tenant: str | None, unnamed: Unnamed | str) -> str:
        """Who a new request's matrix belongs to: itself (a private matrix), a tenant, or
        every request that names none (``unnamed: "shared"``)."""
        if self.mode is IsolationMode.REQUEST:
            return f"request:{req_id}"
        if tenant is None:
            return f"request:{req_id}" if Unnamed(unnamed) is Unnamed.PRIVATE else "unnamed"
        return f"tenant:{tenant}"

    def release(self, req_id: str) -> None:
        """The request left the batch (finished, aborted or preempted)."""
        partition = self.partition_of.pop(req_id, NO_PARTITION)
        if partition == NO_PARTITION:
            return
        held = self.holders.get(partition)
        if held is not None:
            held.discard(req_id)
        owner = f"request:{req_id}"
        if not held and self.owner_of.get(owner) == partition:
            # a private matrix dies with its request: free the partition for the next
            # owner, who gets it reset to the seed
            del self.owner_of[owner]

    def partitions(self, req_ids: list[str], device: torch.device | str) -> torch.Tensor | None:
        """[B] partition per request (-1: none); ``None`` in global mode."""
        if self.mode is IsolationMode.GLOBAL:
            return None
        return torch.tensor([self.partition_of.get(r, NO_PARTITION) for r in req_ids],
                            dtype=torch.long, device=device)

    def _partition_of_owner(self, owner: str) -> int:
        if owner in self.owner_of:
            self.owner_of.move_to_end(owner)
            return self.owner_of[owner]
        used = set(self.owner_of.values())
        free = [p for p in range(self.matrix.partitions) if p not in used]
        if free:
            partition = free[0]
        else:
            idle = [o for o, p in self.owner_of.items() if not self.holders.get(p)]
            if not idle:
                return NO_PARTITION
            partition = self.owner_of.pop(idle[0])  # least recently used, not running
            self.evictions += 1
        self.matrix.partition(partition).copy_(self.seed)
        self.owner_of[owner] = partition
        return partition
