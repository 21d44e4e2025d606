"""The successor matrix across restarts (``graft.successor_state``).

At start-up the proposer loads the state file when it exists (it wins over the warm-up
file: it holds everything the warm-up taught plus what serving taught since); the
runner asks :meth:`SuccessorStateKeeper.maybe_save` once per engine step, and vLLM's
model-runner shutdown (``vllm serve`` stopping on SIGTERM, ``LLM`` shut down) saves a
last time. Each save is a complete file written atomically
(:meth:`~vllm_graft.core.successor.SuccessorMatrix.save`), carrying the tokenizer's
fingerprint so that it is never loaded for another tokenizer.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from vllm_graft.core.config import SuccessorStateConfig
from vllm_graft.core.successor import TOKENIZER_FINGERPRINT_KEY, SuccessorMatrix

logger = logging.getLogger(__name__)


def matrix_metadata(vllm_config) -> dict:
    """What a saved matrix records about the model it was learned with."""
    from vllm_graft.core.calibration import fingerprint_model
    from vllm_graft.vllm.config import tokenizer_fingerprint

    model_config = vllm_config.model_config
    metadata = {TOKENIZER_FINGERPRINT_KEY: tokenizer_fingerprint(model_config.tokenizer)}
    if (Path(model_config.model) / "config.json").is_file():
        metadata["target_fingerprint"] = fingerprint_model(model_config.model)
    return metadata


def is_state_writer(vllm_config) -> bool:
    """The first tensor-parallel rank of the first data-parallel engine writes: the
    ranks of one engine hold identical matrices, and one file has one writer."""
    from vllm.distributed import get_tensor_model_parallel_rank

    return (get_tensor_model_parallel_rank() == 0
            and vllm_config.parallel_config.data_parallel_rank == 0)


class SuccessorStateKeeper:
    """Saves the live matrix to ``config.path`` every ``config.save_every_s`` seconds
    and at shutdown. A failed save (disk full, folder removed) is logged and retried at
    the next period; it never stops serving."""

    def __init__(self, config: SuccessorStateConfig, matrix: Callable[[], SuccessorMatrix],
                 metadata: dict, *, writer: bool, clock: Callable[[], float] = time.monotonic):
        self.path = Path(config.path)
        self.every = config.save_every_s
        self.matrix = matrix
        self.metadata = metadata
        self.writer = writer
        self.clock = clock
        self.last_save = clock()
        self.saves = 0

    def maybe_save(self) -> None:
        if self.writer and self.every > 0 and self.clock() - self.last_save >= self.every:
            self.save("periodic")

    def save(self, reason: str) -> int | None:
        """Write the file now; returns its size in bytes, ``None`` when not written."""
        if not self.writer:
            return None
        self.last_save = self.clock()
        matrix = self.matrix()
        metadata = {**self.metadata, "saved_at": datetime.now(timezone.utc).isoformat(),
                    "reason": reason, "pid": os.getpid()}
        try:
            size = matrix.save(self.path, metadata)
        except OSError as err:
            logger.error("Graft: could not save the successor state to %s (%s); serving "
                         "goes on, the next save is tried in %.0f s", self.path, err, self.every)
            return None
        self.saves += 1
        logger.info("Graft: successor state saved to %s (%s, %d rows, %d bytes)", self.path,
                    reason, int(matrix.touched_rows().numel()), size)
        return size
