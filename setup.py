"""Build script for vllm-graft and its compiled ops, ``vllm_graft._C``.

The CPU kernels are always built. The CUDA kernels are added when torch itself
was built with CUDA and a CUDA toolkit is found; whether a GPU is visible on
the build machine does not matter, so a wheel built on a GPU-less machine
still ships them. ``VLLM_GRAFT_BUILD_CUDA`` overrides the choice: ``0`` builds
CPU only, ``1`` requires CUDA and fails loudly when it cannot be built.
``TORCH_CUDA_ARCH_LIST`` (read by torch) picks the GPU architectures.

Install (torch must already be installed: the ops are built against it)::

    pip install --no-build-isolation -e .
    pip wheel --no-build-isolation --no-deps -w dist .    # a wheel
"""

import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import (
    CUDA_HOME,
    BuildExtension,
    CppExtension,
    CUDAExtension,
)

BUILD_CUDA_ENV = "VLLM_GRAFT_BUILD_CUDA"

CPU_SOURCES = ["csrc/ops.cpp", "csrc/logits_topk.cpp", "csrc/graft_step.cpp"]
CUDA_SOURCES = ["csrc/ops_cuda.cpp", "csrc/kernels/successor_kernels.cu",
                "csrc/kernels/topk_kernels.cu"]

# The C++ standard of torch-including sources is left to torch, which passes
# the one its headers require. The CUDA kernels are torch-free C++17.
# -fopenmp: ATen's parallel_for is a header template that runs its loop on torch's
# intra-op threads only where the including source is compiled with OpenMP; without
# it every CPU kernel here runs on one thread (torch links the OpenMP runtime itself).
CXX_FLAGS = ["-O3", "-fopenmp"]
LINK_FLAGS = ["-fopenmp"]
NVCC_FLAGS = ["-O3", "-std=c++17"]


def cuda_build_blocker() -> str | None:
    """Why the CUDA kernels cannot be built here, or None when they can."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} was built without CUDA"
    if CUDA_HOME is None:
        return "no CUDA toolkit found (set CUDA_HOME or put nvcc on PATH)"
    return None


def should_build_cuda() -> bool:
    choice = os.environ.get(BUILD_CUDA_ENV, "").strip()
    if choice not in ("", "0", "1"):
        raise SystemExit(f"{BUILD_CUDA_ENV} must be 0, 1 or unset, got {choice!r}")
    if choice == "0":
        return False
    blocker = cuda_build_blocker()
    if choice == "1" and blocker:
        raise SystemExit(f"{BUILD_CUDA_ENV}=1 but the CUDA ops cannot be built: {blocker}")
    if blocker:
        print(f"vllm-graft: building the CPU ops only: {blocker} (a GPU engine will refuse "
              f"to start with them; {BUILD_CUDA_ENV}=1 makes this an error)")
    return blocker is None


def compiled_ops_extension():
    if should_build_cuda():
        return CUDAExtension(
            name="vllm_graft._C",
            sources=CPU_SOURCES + CUDA_SOURCES,
            define_macros=[("VLLM_GRAFT_WITH_CUDA", None)],
            extra_compile_args={"cxx": CXX_FLAGS, "nvcc": NVCC_FLAGS},
            extra_link_args=LINK_FLAGS,
        )
    return CppExtension(
        name="vllm_graft._C",
        sources=CPU_SOURCES,
        extra_compile_args={"cxx": CXX_FLAGS},
        extra_link_args=LINK_FLAGS,
    )


# The metadata is pyproject.toml's; this file adds the compiled ops.
setup(ext_modules=[compiled_ops_extension()], cmdclass={"build_ext": BuildExtension})
