"""The fused step's Triton kernels are registered as its ops' CUDA kernels where a GPU is
visible (vllm_graft/ops.py), and without Triton each op's CUDA kernel raises naming the
op. Each case imports the ops in a process of its own that believes a GPU is there."""

from __future__ import annotations

import subprocess
import sys

PRELUDE = """
import sys, torch
torch.cuda.is_available = lambda: True
{hide}
import vllm_graft.ops as ops
for name in ops._FUSED_OPS:
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"vllm_graft::{{name}}", "CUDA"), name
"""


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_triton_kernels_are_the_fused_ops_cuda_kernels():
    out = _run(PRELUDE.format(hide="") + """
from vllm_graft.kernels import graft_step_triton
assert ops._cuda_kernels()["graft_draft_step"] is graft_step_triton.graft_draft_step_cuda
print("registered")
""")
    assert "registered" in out


def test_without_triton_the_cuda_kernels_name_the_op_and_what_is_missing():
    out = _run(PRELUDE.format(hide="sys.modules['triton'] = None") + """
try:
    ops._cuda_kernels()["graft_tree_finalize"]()
except RuntimeError as error:
    print(error)
""")
    assert out.startswith("graft_tree_finalize: its CUDA kernel is a Triton kernel, and "
                          "Triton could not be imported"), out
