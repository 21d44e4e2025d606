"""The ``vllm.general_plugins`` entry point (``graft``).

vLLM calls :func:`register` in every process it starts (front end, engine core,
workers, Ray workers), so installing vllm-graft is all a user does. The guards run
first: a vLLM release other than the supported one is refused with both versions named,
and a vLLM whose patched or relied-on internals differ from the recorded fingerprints
(:mod:`vllm_graft.vllm.fingerprints`) is refused with every differing symbol named,
before any patch is applied.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def route_logs_through_vllm() -> None:
    """Graft's log lines go where vLLM's go, in vLLM's format and level (its start-up
    and shutdown INFO lines included), unless the user configured ``vllm_graft``'s
    logger already."""
    ours, theirs = logging.getLogger("vllm_graft"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)


def register() -> None:
    from vllm_graft.vllm.version import check_vllm_version

    route_logs_through_vllm()
    check_vllm_version()
    from vllm_graft.vllm.fingerprints import verify_installed_vllm

    verify_installed_vllm()
    from vllm_graft.vllm.patches import apply_all

    apply_all()
