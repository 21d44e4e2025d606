"""The ``vllm.general_plugins`` entry point (``graft``).

vLLM calls :func:`register` in every process it starts (front end, engine core,
workers, Ray workers), so installing vllm-graft is all a user does. The guards run
first: on a vLLM release other than the supported one, or one whose patched or
relied-on internals differ from the recorded fingerprints
(:mod:`vllm_graft.vllm.fingerprints`), no patch is applied and one warning names both
versions or every differing symbol; vLLM itself runs on.
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


#: why Graft is off in this process (empty: it is on, or the plugin has not loaded)
DISABLED: list[str] = []


def register() -> None:
    """Apply Graft to this vLLM, or, on a vLLM it does not support, stay out of it:
    vLLM loads every installed plugin in every process without a guard, so a plugin
    that raised here would break every vLLM user of the environment, Graft or not. Then
    one warning names the versions (or the differing internals), no patch is applied,
    and a Graft speculative config is refused by vLLM as an unknown method."""
    from vllm_graft.vllm.fingerprinting import VLLMFingerprintMismatch
    from vllm_graft.vllm.fingerprints import verify_installed_vllm
    from vllm_graft.vllm.version import UnsupportedVLLMVersion, check_vllm_version

    route_logs_through_vllm()
    try:
        check_vllm_version()
        verify_installed_vllm()
    except (UnsupportedVLLMVersion, VLLMFingerprintMismatch) as error:
        if not DISABLED:
            logger.warning("vllm-graft is installed but off: %s. vLLM runs as it is, "
                           "without Graft.", error)
        DISABLED[:] = [str(error)]
        return
    from vllm_graft.vllm.patches import apply_all

    apply_all()
