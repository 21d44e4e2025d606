"""Counting the aten ops a piece of torch code issues, on any device."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts, inside ``with OpCounter() as ops:``, the aten ops that are not views
    (``ops.ops``: on a GPU each one is a kernel launch) and those that wait for the
    host on a GPU (``ops.host_waits``: a scalar read, ``nonzero``, a boolean-mask
    indexing, whose output size the host must learn first). Runs on the CPU, so the
    GPU path's launch and wait counts are checked without a GPU."""

    VIEWS = frozenset({"view", "_unsafe_view", "slice", "select", "unsqueeze", "squeeze",
                       "expand", "alias", "detach", "t", "transpose", "permute"})
    WAITS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "unique",
                       "_unique2"})
    MASK_INDEXING = frozenset({"index", "index_put_", "_index_put_impl_"})

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.host_waits = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops += name not in self.VIEWS
        self.host_waits += name in self.WAITS or (
            name in self.MASK_INDEXING and any(
                index is not None and index.dtype in (torch.bool, torch.uint8)
                for index in args[1]))
        return func(*args, **(kwargs or {}))
