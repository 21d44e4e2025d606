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


class _ToVllmHandlers(logging.Handler):
    """Hands each record to the handlers vLLM's logger has when the record is emitted:
    vLLM installs them when an engine starts in a process (``configure_logging``), which
    is after plugins load, so handlers copied at load time would be none."""

    def emit(self, record: logging.LogRecord) -> None:
        for handler in logging.getLogger("vllm").handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def route_logs_through_vllm() -> None:
    """Graft's log lines go where vLLM's go, in vLLM's format, at vLLM's configured
    level (its start-up and shutdown INFO lines included), unless the user configured
    ``vllm_graft``'s logger already."""
    import vllm.envs as envs

    ours = logging.getLogger("vllm_graft")
    if ours.handlers:
        return
    ours.addHandler(_ToVllmHandlers())
    if ours.level == logging.NOTSET:
        ours.setLevel(envs.VLLM_LOGGING_LEVEL)


def register() -> None:
    from vllm_graft.vllm.version import check_vllm_version

    route_logs_through_vllm()
    check_vllm_version()
    from vllm_graft.vllm.fingerprints import verify_installed_vllm

    verify_installed_vllm()
    from vllm_graft.vllm.patches import apply_all

    apply_all()
