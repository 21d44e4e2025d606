"""Timing Graft's phases on any device."""

from __future__ import annotations

import time

import torch


def device_clock(device: torch.device | str) -> float:
    """Wall clock after waiting for ``device``, so a timed span holds its GPU work.
    Called at the phase boundaries of a step only: a fixed few synchronisations per
    step, never one per request, level or layer."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
