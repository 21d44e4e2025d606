"""What machine this is, as results and caches name it."""

from __future__ import annotations

import shutil
import subprocess


def has_gpu() -> bool:
    """Whether an NVIDIA GPU is visible (``nvidia-smi -L`` lists one)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    return subprocess.run([smi, "-L"], capture_output=True).returncode == 0


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line.split(":", 1)[1].strip() for line in cpuinfo
                         if line.startswith("model name")), "")
    except OSError:
        return ""
