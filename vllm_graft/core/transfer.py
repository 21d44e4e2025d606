"""Many device tensors brought to the host in one copy.

On a GPU every device-to-host copy is a wait for everything queued before it; a step
that needs several tensors on the host (a tree and its build's facts, an acceptance
result) waits once if they travel together: their bytes packed into one tensor (one
concatenation; each tensor's byte view costs nothing where it is contiguous), copied,
and viewed on the host as tensors of the original dtypes and shapes, every value (NaN
included) exactly as sent.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, TypeVar

import torch

T = TypeVar("T")


def to_host_at_once(tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """``tensors`` as new host tensors (None stays None), from one copy. The host
    tensors are views of one buffer."""
    present = [i for i, t in enumerate(tensors) if t is not None]
    if not present:
        return list(tensors)
    # widest elements first, so that every tensor starts at a multiple of its own size
    order = sorted(present, key=lambda i: -tensors[i].element_size())
    packed = torch.cat([_flat(tensors[i]).view(torch.uint8) for i in order]).cpu()
    out: list[torch.Tensor | None] = [None] * len(tensors)
    offset = 0
    for i in order:
        t = tensors[i]
        size = t.numel() * t.element_size()
        out[i] = packed[offset:offset + size].view(t.dtype).view(t.shape)
        offset += size
    return out


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as one dimension of stride 1, which a byte view needs: a view where
    the tensor is contiguous, a copy where it is not. A one-element slice of a wider
    buffer counts as contiguous yet keeps the wider stride: it gets a view of stride 1."""
    if tensor.numel() == 1:
        return tensor.reshape(-1).as_strided((1,), (1,))
    return tensor.contiguous().view(-1)


def dataclasses_to_host(*objects: T) -> list[T]:
    """Copies of dataclass ``objects`` with every tensor field on the host, all of them
    from one copy (:func:`to_host_at_once`)."""
    names = [[f.name for f in dataclasses.fields(o)
              if isinstance(getattr(o, f.name), torch.Tensor)] for o in objects]
    host = iter(to_host_at_once([getattr(o, n) for o, fields in zip(objects, names)
                                 for n in fields]))
    return [dataclasses.replace(o, **{n: next(host) for n in fields})
            for o, fields in zip(objects, names)]
