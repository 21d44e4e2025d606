"""The CUDA kernels compile with plain nvcc, even where torch has no CUDA.

The kernel sources are torch-free, so a build machine without a GPU (or with a
CPU-only torch) still catches CUDA compile errors before a wheel ships.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

NVCC = shutil.which("nvcc")
KERNELS = Path(__file__).resolve().parents[2] / "csrc" / "kernels"

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")

_TOPK_TYPES = [("float", "int"), ("float", "long"), ("__half", "int"), ("__half", "long"),
               ("__nv_bfloat16", "int"), ("__nv_bfloat16", "long"), ("double", "int"),
               ("double", "long")]

# Every kernel source and the explicit instantiations ops_cuda.cpp links against
# (int64_t is `long` on Linux).
LAUNCHER_INSTANTIATIONS = {
    "successor_kernels.cu": [
        "launch_successor_gather<int>",
        "launch_successor_gather<long>",
        "launch_successor_update<int, int>",
        "launch_successor_update<int, long>",
        "launch_successor_update<long, int>",
        "launch_successor_update<long, long>",
    ],
    "topk_kernels.cu": [
        *(f"launch_logits_topk<{scalar}, {row}>" for scalar, row in _TOPK_TYPES),
        "logits_topk_splits(long, long, long*)",
    ],
}
SOURCES = sorted(LAUNCHER_INSTANTIATIONS)


def _compile(source: str, output: Path, *arch_flags: str) -> None:
    command = [NVCC, "-c", "-std=c++17", "-O2", *arch_flags, str(KERNELS / source), "-o",
               str(output)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stderr}"
    assert output.is_file()


@pytest.mark.parametrize("source", SOURCES)
def test_compiles_for_default_architecture(tmp_path: Path, source: str):
    output = tmp_path / f"{Path(source).stem}.o"
    _compile(source, output)

    nm = shutil.which("nm")
    if nm is None:
        return
    symbols = subprocess.run([nm, "-C", str(output)], capture_output=True, text=True).stdout
    missing = [name for name in LAUNCHER_INSTANTIATIONS[source] if name not in symbols]
    assert not missing, f"launchers not instantiated: {missing}"


@pytest.mark.parametrize("source", SOURCES)
def test_compiles_for_ampere_and_hopper(tmp_path: Path, source: str):
    _compile(
        source,
        tmp_path / f"{Path(source).stem}_sm80_sm90.o",
        "-gencode", "arch=compute_80,code=sm_80",
        "-gencode", "arch=compute_90,code=sm_90",
    )
