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
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from vllm_graft.core.config import SuccessorStateConfig
from vllm_graft.core.successor import (TOKENIZER_FINGERPRINT_KEY, MatrixSnapshot,
                                       SuccessorMatrix)

logger = logging.getLogger(__name__)


def matrix_metadata(vllm_config) -> dict:
    """What a saved matrix records about the model it was learned with."""
    from vllm_graft.core.calibration import fingerprint_model
    from vllm_graft.vllm.config import TokenizerRef

    model_config = vllm_config.model_config
    fingerprint = TokenizerRef.fingerprint_of(model_config)
    metadata = {} if fingerprint is None else {TOKENIZER_FINGERPRINT_KEY: fingerprint}
    if (Path(model_config.model) / "config.json").is_file():
        metadata["target_fingerprint"] = fingerprint_model(model_config.model)
    return metadata


def is_state_writer(vllm_config) -> bool:
    """The first tensor-parallel rank of the first data-parallel engine writes: the
    ranks of one engine hold identical matrices, and one file has one writer."""
    from vllm_graft.vllm.tp_agreement import is_first_rank

    return is_first_rank() and is_first_data_parallel_engine(vllm_config.parallel_config)


def is_first_data_parallel_engine(parallel_config) -> bool:
    """Whether this engine is data-parallel engine 0. Its ``data_parallel_index``, not
    its rank: vLLM 0.32 runs each engine of a dense model as an independent one and
    sets every engine's ``data_parallel_rank`` to 0 (``data_parallel_index`` keeps the
    engine's place), and every engine would write the one file, each over the others'."""
    index = getattr(parallel_config, "data_parallel_index", None)
    return (parallel_config.data_parallel_rank if index is None else index) == 0


class SuccessorStateKeeper:
    """Saves the live matrix to ``config.path`` every ``config.save_every_s`` seconds
    and at shutdown. A periodic save copies the touched rows to the host in the engine
    loop and hashes and writes them on a background thread, so slow storage never
    holds up a step (or, under tensor parallelism, the other ranks waiting for it); the
    shutdown save writes in the caller. A failed save (disk full, folder removed) is
    logged and tried again at the next period; it never stops serving."""

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
        self._writing: threading.Thread | None = None

    def maybe_save(self) -> None:
        if not (self.writer and self.every > 0 and self.clock() - self.last_save >= self.every):
            return
        if self._writing is not None and self._writing.is_alive():
            return  # the last one is still being written
        self.last_save = self.clock()
        snapshot = self.matrix().snapshot()
        self._writing = threading.Thread(target=self._write, args=(snapshot, "periodic"),
                                         name="graft-state-save", daemon=True)
        self._writing.start()

    def flush(self) -> None:
        """Wait for a periodic save still being written."""
        if self._writing is not None:
            self._writing.join()

    def save(self, reason: str) -> int | None:
        """Write the file now; returns its size in bytes, ``None`` when not written."""
        if not self.writer:
            return None
        self.flush()
        self.last_save = self.clock()
        return self._write(self.matrix().snapshot(), reason)

    def _write(self, snapshot: MatrixSnapshot, reason: str) -> int | None:
        metadata = {**self.metadata, "saved_at": datetime.now(timezone.utc).isoformat(),
                    "reason": reason, "pid": os.getpid()}
        try:
            size = snapshot.write(self.path, metadata)
        except OSError as err:
            logger.error("Graft: could not save the successor state to %s (%s); serving "
                         "goes on, the next save is tried in %.0f s", self.path, err, self.every)
            return None
        self.saves += 1
        logger.info("Graft: successor state saved to %s (%s, %d rows, %d bytes)", self.path,
                    reason, snapshot.num_rows, size)
        return size
