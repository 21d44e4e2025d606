"""Counting the aten ops a piece of torch code issues, on any device."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts, inside ``with OpCounter() as ops:``, the ops that are not views
    (``ops.ops``: on a GPU each one is a kernel launch; a fused custom op counts one)
    and the reads of the device by the host (``ops.host_waits``): a scalar read,
    ``nonzero``, a boolean-mask indexing (whose output size the host must learn
    first), and every copy to the host: ``.tolist()``, ``.numpy()``, ``.cpu()``,
    ``.item()`` and a copy into pinned memory. Runs on the CPU, so the GPU path's
    launch and wait counts are checked without a GPU (a CPU tensor's ``.cpu()`` copies
    nothing, yet on a GPU it is a wait: it counts the same; ``.to(device)`` is not
    counted, as code on the CPU cannot tell a move to the host from one to its own
    device).
    ``names`` tallies the ops by name."""

    VIEWS = frozenset({"view", "_unsafe_view", "slice", "select", "unsqueeze", "squeeze",
                       "expand", "alias", "detach", "t", "transpose", "permute"})
    WAITS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "unique",
                       "_unique2"})
    MASK_INDEXING = frozenset({"index", "index_put_", "_index_put_impl_"})
    #: tensor methods that read the device from the host; ``item`` dispatches
    #: ``_local_scalar_dense``, which counts already
    HOST_METHODS = ("tolist", "numpy", "cpu")

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.host_waits = 0
        self.names: dict[str, int] = {}
        self._saved: dict[str, object] = {}

    def __enter__(self):
        for name in self.HOST_METHODS:
            self._saved[name] = getattr(torch.Tensor, name)
        counter = self

        def reading(name):
            original = counter._saved[name]

            def method(tensor, *args, **kwargs):
                counter.host_waits += 1
                return original(tensor, *args, **kwargs)
            return method

        for name in self.HOST_METHODS:
            setattr(torch.Tensor, name, reading(name))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in self.VIEWS:
            self.ops += 1
            self.names[name] = self.names.get(name, 0) + 1
        self.host_waits += name in self.WAITS or (
            name in self.MASK_INDEXING and any(
                index is not None and index.dtype in (torch.bool, torch.uint8)
                for index in args[1])) or (
            name == "copy_" and args[0].device.type == "cpu" and args[0].is_pinned())
        return func(*args, **(kwargs or {}))
