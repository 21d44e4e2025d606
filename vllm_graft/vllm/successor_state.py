"""The successor matrix across restarts (``graft.successor_state``).

At start-up the proposer loads the state file when it exists (it wins over the warm-up
file: it holds everything the warm-up taught plus what serving taught since); the
runner asks :meth:`SuccessorStateKeeper.maybe_save` once per engine step, and vLLM's
model-runner shutdown (``vllm serve`` stopping on SIGTERM, ``LLM`` shut down) saves a
last time. Each save is a complete file written atomically
(:meth:`~vllm_graft.core.successor.SuccessorMatrix.save`, 0600), carrying the
tokenizer's fingerprint so that it is never loaded for another tokenizer. A file that
cannot be used is moved aside (``on_corrupt``); a save that fails is logged, counted and
retried, never stopping serving.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from vllm_graft.core.config import SuccessorStateConfig
from vllm_graft.core.successor import (TOKENIZER_FINGERPRINT_KEY, MatrixSnapshot,
                                       SuccessorFileError, SuccessorMatrix, temporary_files)

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


def load_successor_state(config: SuccessorStateConfig, *, writer: bool,
                         fallback: str = "the warm-up file", **load) -> SuccessorMatrix | None:
    """The matrix saved at ``config.path`` (``load``: :meth:`SuccessorMatrix.load`'s
    checks and placement), ``None`` when there is no file or, under ``on_corrupt:
    "move_aside"``, when it cannot be used: the writer renames it to
    ``<path>.corrupt-<UTC time>`` (never deleted) and the engine starts from
    ``fallback`` (what the warning names); the other ranks leave the file to the writer.
    ``"refuse"``: the :class:`SuccessorFileError` naming the file."""
    path = Path(config.path)
    if not path.is_file():
        return None
    try:
        return SuccessorMatrix.load(path, **load)
    except SuccessorFileError as err:
        if config.on_corrupt == "refuse":
            raise
        if not writer:
            logger.warning("Graft: the successor state file cannot be used (%s); starting "
                           "from %s (the writing rank moves the file aside)", err, fallback)
            return None
        kept = move_aside(path)
        logger.warning("Graft: the successor state file cannot be used (%s); moved it "
                       "aside to %s (kept) and starting from %s; the next save writes %s "
                       "anew", err, kept, fallback, path)
        return None


def move_aside(path: Path) -> Path:
    """Rename ``path`` to ``<path>.corrupt-<UTC time>`` (``-2``, ``-3``... when that
    exists): never over another file, never deleted. A file that cannot be moved stops
    start-up (the first save would replace it)."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    base = path.with_name(f"{path.name}.corrupt-{stamp}")
    target, n = base, 1
    while os.path.lexists(target):
        n += 1
        target = base.with_name(f"{base.name}-{n}")
    try:
        os.rename(path, target)
    except OSError as err:
        raise SuccessorFileError(
            f"successor matrix file {str(path)!r} cannot be used and could not be moved "
            f"aside to {str(target)!r} ({err.strerror or err}); move or delete it, or fix "
            f"the folder's permissions") from None
    return target


class SuccessorStateKeeper:
    """Saves the live matrix to ``config.path`` every ``config.save_every_s`` seconds
    and at shutdown. A periodic save copies the touched rows to the host in the engine
    loop and hashes and writes them on a background thread, so slow storage never
    holds up a step (or, under tensor parallelism, the other ranks waiting for it); the
    shutdown save writes in the caller. A failed save (disk full, file too large, folder
    removed) is logged once per kind of error until a save succeeds, counted
    (:meth:`take_failures`, the runner's ``successor_state_save_failures``) and tried
    again at the next period; it never stops serving and never raises. The writer
    removes the temporary files a killed save left beside the file when it starts."""

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
        self.failures = 0  # failed saves since start-up
        self._untaken_failures = 0
        self._failing: dict[str, int] = {}  # error kind -> failures since the last save
        self._lock = threading.Lock()
        self._writing: threading.Thread | None = None
        if writer:
            self.remove_stray_temporaries()

    def remove_stray_temporaries(self) -> list[Path]:
        """Delete what saves killed mid-write left (``.<name>.<random>.tmp`` beside the
        file; nothing else). Only the file's one writer calls it, at start-up."""
        removed = []
        for stray in temporary_files(self.path):
            try:
                stray.unlink()
                removed.append(stray)
            except FileNotFoundError:
                pass
            except OSError as err:
                logger.warning("Graft: could not remove %s, left by an interrupted save of "
                               "the successor state (%s)", stray, err)
        if removed:
            logger.info("Graft: removed %d temporary file(s) an interrupted save of %s left",
                        len(removed), self.path)
        return removed

    def maybe_save(self) -> None:
        if not (self.writer and self.every > 0 and self.clock() - self.last_save >= self.every):
            return
        if self._writing is not None and self._writing.is_alive():
            return  # the last one is still being written
        self.last_save = self.clock()
        try:
            snapshot = self.matrix().snapshot()
        except Exception as err:
            self._failed(err, "periodic")
            return
        self._writing = threading.Thread(target=self._write, args=(snapshot, "periodic"),
                                         name="graft-state-save", daemon=True)
        self._writing.start()

    def flush(self) -> None:
        """Wait for a periodic save still being written."""
        if self._writing is not None:
            self._writing.join()

    def save(self, reason: str) -> int | None:
        """Write the file now; returns its size in bytes, ``None`` when not written
        (not the writer, or the save failed: logged and counted, never raised)."""
        if not self.writer:
            return None
        self.flush()
        self.last_save = self.clock()
        try:
            snapshot = self.matrix().snapshot()
        except Exception as err:
            self._failed(err, reason)
            return None
        return self._write(snapshot, reason)

    def take_failures(self) -> int:
        """Failed saves since the last call (the runner adds them to its counters)."""
        with self._lock:
            count, self._untaken_failures = self._untaken_failures, 0
        return count

    def _write(self, snapshot: MatrixSnapshot, reason: str) -> int | None:
        metadata = {**self.metadata, "saved_at": datetime.now(timezone.utc).isoformat(),
                    "reason": reason, "pid": os.getpid()}
        try:
            size = snapshot.write(self.path, metadata)
        except Exception as err:  # disk full, file too large, folder gone: serving goes on
            self._failed(err, reason)
            return None
        with self._lock:
            failed, self._failing = sum(self._failing.values()), {}
            self.saves += 1
        if failed:
            logger.warning("Graft: successor state saved to %s again, after %d failed "
                           "save(s)", self.path, failed)
        logger.info("Graft: successor state saved to %s (%s, %d rows, %d bytes)", self.path,
                    reason, snapshot.num_rows, size)
        return size

    def _failed(self, err: Exception, reason: str) -> None:
        kind = (errno.errorcode.get(err.errno, str(err.errno))
                if isinstance(err, OSError) and err.errno else type(err).__name__)
        with self._lock:
            self.failures += 1
            self._untaken_failures += 1
            first = kind not in self._failing
            self._failing[kind] = self._failing.get(kind, 0) + 1
        retry = (f"the next save is tried in {self.every:g} s" if self.every > 0
                 else "the next save is at shutdown")
        if first or reason != "periodic":  # a kind once until a save succeeds, not per retry
            logger.error("Graft: could not save the successor state to %s (%s save: %s); "
                         "serving goes on, %s (further %s failures are logged only once a "
                         "save has succeeded)", self.path, reason, err, retry, kind)
        else:
            logger.debug("Graft: successor state save to %s failed again (%s)", self.path,
                         err)
