"""CUDA graphs that check themselves: the first tree steps run replayed and eager.

On GPUs a Graft engine runs its target under vLLM's piecewise CUDA graphs (patch 1:
``cudagraph_mode`` PIECEWISE): the captured pieces hold the dense layers, attention runs
eagerly between them, and with it Graft's tree attention (the plan of the step is read
when the layer runs, so no graph ever holds a stale one). Full graphs would capture the
attention itself and are never used.

If vLLM's start-up capture of those graphs fails, :func:`run_eagerly_after_failed_capture`
keeps the engine up without them, with one log line saying why (patch 11e); only a
device left unusable by the failure stops the start-up, naming it.

No GPU in the project's test machines has vLLM, so that combination is checked where it
runs: the target forward of each of the first :data:`CHECKED_STEPS` tree steps that
replay graphs runs a second time eagerly (the KV writes are the same values to the same
slots), and the two outputs must be equal at every scheduled row. A difference, or any
error while checking, turns the engine's CUDA graphs off for good with one log line
naming it; the step returns the eager output either way. ``graft.cuda_graphs: false``
keeps the engine eager from the start.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

logger = logging.getLogger(__name__)

#: tree steps whose replayed forward is compared with an eager one
CHECKED_STEPS = 3


def replaying_graphs() -> bool:
    """Whether the forward about to run replays CUDA graphs (vLLM's forward context)."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return False
    return get_forward_context().cudagraph_runtime_mode != CUDAGraphMode.NONE


def _tensors(output) -> list[torch.Tensor]:
    """The tensors of a model forward's output (hidden states, EAGLE-3's auxiliary
    hidden states), in order."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    return []


def difference(replayed, eager, rows: int) -> str | None:
    """Where two forward outputs differ in their first ``rows`` rows, or None."""
    first, second = _tensors(replayed), _tensors(eager)
    if len(first) != len(second):
        return f"{len(first)} output tensors replayed, {len(second)} eager"
    for index, (a, b) in enumerate(zip(first, second)):
        a, b = a[:rows], b[:rows]
        if a.shape != b.shape:
            return f"output {index} has shape {tuple(a.shape)} replayed, {tuple(b.shape)} eager"
        if not torch.equal(a, b):
            unequal = (a != b) & ~(a.isnan() & b.isnan())
            if bool(unequal.any()):
                gaps = torch.where(unequal, (a.float() - b.float()).abs(), 0.0)
                worst = gaps.nan_to_num(float("inf")).max()
                return (f"output {index} differs at {int(unequal.any(-1).sum())} of {rows} "
                        f"rows (largest difference {float(worst):.3g})")
    return None


class ReplayCheck:
    """The check of the module docstring for one runner. ``always``: compare every
    checked step, replaying or not (two eager forwards; the tests' way to run it on a
    CPU)."""

    def __init__(self, steps: int = CHECKED_STEPS, always: bool = False):
        self.left = steps
        self.always = always
        self.verdict: str | None = None  # "on" once every check passed, else why off

    def due(self) -> bool:
        return self.left > 0 and (self.always or replaying_graphs())

    def run(self, runner, forward: Callable[[], object], rows: int):
        """The step's forward, replayed and eager; returns the eager output."""
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import get_forward_context

        self.left -= 1
        eager = None
        try:
            replayed = [t.clone() for t in _tensors(forward())]
            context = get_forward_context()
            saved = context.cudagraph_runtime_mode
            context.cudagraph_runtime_mode = CUDAGraphMode.NONE
            try:
                eager = forward()
            finally:
                context.cudagraph_runtime_mode = saved
            problem = difference(replayed, _tensors(eager), rows)
        except Exception as error:  # never let the check take the engine down
            problem = f"the check failed: {type(error).__name__}: {error}"
            if eager is None:
                context = get_forward_context()
                context.cudagraph_runtime_mode = CUDAGraphMode.NONE
                eager = forward()
        if problem is not None:
            self.turn_off(runner, f"a tree step's forward replayed in CUDA graphs is not the "
                                  f"eager one: {problem}")
        elif self.left == 0:
            self.verdict = "on"
            logger.info("Graft: CUDA graphs checked: %d tree steps replayed as they run "
                        "eagerly", CHECKED_STEPS)
        return eager

    def turn_off(self, runner, reason: str) -> None:
        from vllm.config import CUDAGraphMode

        self.left = 0
        self.verdict = f"off: {reason}"
        dispatcher = getattr(runner, "cudagraph_dispatcher", None)
        if dispatcher is not None:
            dispatcher.cudagraph_mode = CUDAGraphMode.NONE
        logger.error("Graft: CUDA graphs turned off, the engine runs eagerly from now on: %s",
                     reason)


def run_eagerly_after_failed_capture(runner, error: BaseException) -> None:
    """After vLLM's ``capture_model`` raised ``error`` in a Graft engine: the engine runs
    eagerly from now on (the graphs' dispatcher set to none, as :meth:`ReplayCheck.
    turn_off` does, with its one log line), unless the device is still capturing or was
    left unusable, which no eager forward could run on: then the start-up fails with
    that said, ``error`` as its cause. Graphs captured before the failure keep their
    memory until the engine stops."""
    from vllm.compilation.monitor import set_cudagraph_capturing_enabled

    set_cudagraph_capturing_enabled(False)  # vLLM resets it only after a whole capture
    if runner.device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("Graft: CUDA graph capture failed and left the stream "
                               "capturing, so the engine cannot run eagerly either") from error
        try:
            torch.cuda.synchronize(runner.device)
            torch.cuda.empty_cache()
        except Exception as lost:
            raise RuntimeError(f"Graft: CUDA graph capture failed and left the device "
                               f"unusable ({type(lost).__name__}: {lost})") from error
    check = runner._graft_graph_check or ReplayCheck(steps=0)
    runner._graft_graph_check = check
    check.turn_off(runner, f"CUDA graph capture failed at start-up: "
                           f"{type(error).__name__}: {error}")
