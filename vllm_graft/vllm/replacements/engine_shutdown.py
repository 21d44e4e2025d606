"""Patch 11c and the shutdown budget: the successor state (``graft.successor_state``)
survives an engine shutdown.

The runner's shutdown save (11b, :mod:`vllm_graft.vllm.replacements.runner_lifecycle`)
comes last: after draining in-flight requests and after the executor has told its
workers to exit. When that takes longer than vLLM's shutdown budget (long requests still
draining, a loaded host), the engine is killed first and nothing is saved. So the engine
process also asks its workers for a save the moment SIGTERM is seen, while they are idle
between steps; the runner's save then adds what draining taught."""

from __future__ import annotations

import logging

from vllm.v1.engine.core import EngineCoreProc, EngineShutdownState

from vllm_graft.vllm.config import ADDITIONAL_CONFIG_KEY
from vllm_graft.vllm.patching import call_original
from vllm_graft.vllm.rpc import save_successor_state

logger = logging.getLogger(__name__)

#: seconds vLLM lets the engine process shut down when Graft saves state at shutdown
STATE_SAVE_SHUTDOWN_S = 10
#: the ``reason`` of the save made when a shutdown is requested (before draining)
SHUTDOWN_REQUESTED_REASON = "shutdown requested"


def keep_shutdown_grace(engine_args) -> None:
    """vLLM's ``--shutdown-timeout 0`` (its default, and indistinguishable from an
    explicit 0) kills the engine process right after SIGTERM, before the model runner's
    shutdown could save the successor state. With ``graft.successor_state`` it becomes
    a few seconds. That one budget covers draining in-flight requests and tearing the
    engine down: when draining takes all of it the engine is killed before the runner's
    final save, and the save made when SIGTERM arrived (11c) is what survives."""
    if not getattr(engine_args, "shutdown_timeout", None):
        logger.warning("Graft: --shutdown-timeout %d s, so that the successor state is saved "
                       "at shutdown", STATE_SAVE_SHUTDOWN_S)
        engine_args.shutdown_timeout = STATE_SAVE_SHUTDOWN_S


def handle_shutdown(self):
    """11c: ``EngineCoreProc._handle_shutdown``; when a shutdown is requested, the
    workers save the successor state before the engine drains."""
    # runs every engine step: the state test first, the config only at a shutdown
    graft = None
    if self.shutdown_state == EngineShutdownState.REQUESTED:
        graft = (self.vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    if graft is not None and graft.get("successor_state") is not None:
        try:
            self.model_executor.collective_rpc(
                save_successor_state, timeout=STATE_SAVE_SHUTDOWN_S,
                args=(SHUTDOWN_REQUESTED_REASON,))
        except Exception as err:  # the shutdown must go on whatever the save did
            # e.g. a SIGTERM to the whole process group (systemd's default) reached the
            # workers too: they are exiting, and each saves at its own shutdown (11b)
            logger.warning("Graft: no successor state save when the shutdown was "
                           "requested (%s: %s); the workers' save at their shutdown "
                           "follows", type(err).__name__, err)
    return call_original(EngineCoreProc, "_handle_shutdown")(self)
