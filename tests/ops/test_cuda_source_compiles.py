"""The CUDA kernels compile with plain nvcc, even where torch has no CUDA.

The kernel source is torch-free, so a build machine without a GPU (or with a
CPU-only torch) still catches CUDA compile errors before a wheel ships.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

NVCC = shutil.which("nvcc")
KERNEL_SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "kernels" / "successor_kernels.cu"

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")

# Every explicit instantiation ops_cuda.cpp links against (int64_t is `long` on Linux).
LAUNCHER_INSTANTIATIONS = [
    "launch_successor_gather<int>",
    "launch_successor_gather<long>",
    "launch_successor_update<int, int>",
    "launch_successor_update<int, long>",
    "launch_successor_update<long, int>",
    "launch_successor_update<long, long>",
]


def _compile(output: Path, *arch_flags: str) -> None:
    command = [NVCC, "-c", "-std=c++17", "-O2", *arch_flags, str(KERNEL_SOURCE), "-o", str(output)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stderr}"
    assert output.is_file()


def test_compiles_for_default_architecture(tmp_path: Path):
    output = tmp_path / "successor_kernels.o"
    _compile(output)

    nm = shutil.which("nm")
    if nm is None:
        return
    symbols = subprocess.run([nm, "-C", str(output)], capture_output=True, text=True).stdout
    missing = [name for name in LAUNCHER_INSTANTIATIONS if name not in symbols]
    assert not missing, f"launchers not instantiated: {missing}"


def test_compiles_for_ampere_and_hopper(tmp_path: Path):
    _compile(
        tmp_path / "successor_kernels_sm80_sm90.o",
        "-gencode", "arch=compute_80,code=sm_80",
        "-gencode", "arch=compute_90,code=sm_90",
    )
