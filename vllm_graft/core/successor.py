"""The successor matrix: for every token, the target's top-k likely next tokens.

``M`` is ``[vocab, k]`` int32 on the device; ``-1`` marks an empty entry (a token the
target has not been seen to follow yet). Retrieval reads it one template level at a
time (``successor_gather``); after every verification each verified node writes the
target's top-k at that node into its token's row (``successor_update_``). Both go
through the compiled ops of ``csrc/`` unless the torch reference is asked for.

Files store only touched rows, so a warmed-up matrix is a few hundred KB rather than
the 4.9 MB of a full Qwen-vocabulary table, with a format version and a SHA-256 of the
payload; every load error names the file. They are written atomically and private
(0600, whatever the umask).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

EMPTY = -1
FILE_MAGIC = b"GRAFTSM\x00"
FILE_FORMAT_VERSION = 1
_HEADER_LEN = struct.Struct("<I")


class SuccessorFileError(ValueError):
    """A successor matrix file is unreadable, corrupt or does not fit the model."""


def _ops(backend: str):
    if backend == "compiled":
        from vllm_graft import ops

        return ops.successor_gather, ops.successor_update_
    if backend == "reference":
        from vllm_graft import ops_reference

        return ops_reference.reference_successor_gather, ops_reference.reference_successor_update_
    raise ValueError(f"unknown ops backend {backend!r} (expected 'compiled' or 'reference')")


class SuccessorMatrix:
    """Holds ``table`` (``[vocab, k]`` int32) and the ops that read and write it.

    Isolated serving (:mod:`vllm_graft.core.isolation`) stacks several matrices in one
    table, ``[partitions * vocab, k]``: partition ``p`` holds token ``t``'s successors in
    row ``p * vocab + t``, so one op call still serves a whole batch whose requests read
    different partitions (:meth:`for_batch`)."""

    def __init__(self, table: torch.Tensor, *, backend: str = "compiled", check: bool = True,
                 partitions: int = 1):
        """``check``: validate ids before each op. The CPU kernels always validate, so
        this only adds the facade's check for tables on a GPU: a few reductions and one
        device synchronisation per op, eight gathers in one tree build. Graft's engine
        turns it off (:meth:`empty` and :meth:`load` take it): every id it passes is the
        target's own token, a prompt's token (vLLM checks those against the
        vocabulary), or an entry of this matrix (the target's top-k, or a file's ids,
        which :meth:`load` checks)."""
        if table.dtype != torch.int32 or table.dim() != 2 or not table.is_contiguous():
            raise ValueError(
                f"successor table must be a contiguous 2-D int32 tensor, got "
                f"{table.dtype} of shape {tuple(table.shape)}")
        if partitions < 1 or table.shape[0] % partitions:
            raise ValueError(f"{table.shape[0]} table rows do not split into {partitions} "
                             f"partitions")
        self.table = table
        self.partitions = partitions
        self.backend = backend
        self.check = check and not table.is_cpu
        self._gather, self._update = _ops(backend)

    @classmethod
    def empty(cls, vocab_size: int, k: int = 8, *, device: torch.device | str = "cpu",
              backend: str = "compiled", check: bool = True) -> SuccessorMatrix:
        if vocab_size < 1 or k < 1:
            raise ValueError(f"vocab_size and k must be positive, got {vocab_size}, {k}")
        table = torch.full((vocab_size, k), EMPTY, dtype=torch.int32, device=device)
        return cls(table, backend=backend, check=check)

    @property
    def vocab_size(self) -> int:
        return self.table.shape[0] // self.partitions

    @property
    def k(self) -> int:
        return self.table.shape[1]

    @property
    def device(self) -> torch.device:
        return self.table.device

    @property
    def nbytes(self) -> int:
        """Device memory of the table (151,936 x 8 x 4 B = 4.9 MB for Qwen)."""
        return self.table.numel() * self.table.element_size()

    def touched_rows(self) -> torch.Tensor:
        """Ids of tokens whose row holds at least one successor. [num_touched] int64"""
        return torch.nonzero(self.table[:, 0] != EMPTY).flatten()

    def gather(self, parent_tokens: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
        """``M[parent, rank]`` for one template level of all requests; -1 parents give -1."""
        if self.backend == "compiled":
            return self._gather(self.table, parent_tokens, ranks, check=self.check)
        return self._gather(self.table, parent_tokens, ranks)

    def update_(self, tokens: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """``M[tokens[i]] = next_tokens[i]``; tokens -1 are skipped, the last duplicate wins."""
        if self.backend == "compiled":
            self._update(self.table, tokens, next_tokens, check=self.check)
        else:
            self._update(self.table, tokens, next_tokens)

    def target_topk(self, logits: torch.Tensor, rows: torch.Tensor | None = None
                    ) -> torch.Tensor:
        """[N, k] the target's ``k`` most likely next tokens at logits rows ``rows``
        (default: every row), best first, column 0 the row's argmax; ``-1`` in ``rows``
        skips the row (a row of -1). One pass over each row read, where it lies."""
        if self.backend == "compiled":
            from vllm_graft.ops import logits_topk

            return logits_topk(logits, self.k, rows, check=self.check)
        from vllm_graft.ops_reference import reference_logits_topk

        return reference_logits_topk(logits, self.k, rows)

    def update_from_logits_(self, tokens: torch.Tensor, logits: torch.Tensor,
                            rows: torch.Tensor | None = None,
                            partitions: torch.Tensor | None = None,
                            next_tokens: torch.Tensor | None = None) -> None:
        """Write the target's top-k at every verified node.

        tokens: [N] node tokens (-1 = padding, skipped by the update); logits: [R, vocab]
        target logits; rows: [N] the row of ``logits`` at each node (default: row i);
        partitions: [N] the partition each node teaches (default: 0; -1: none);
        next_tokens: [N, k] the top-k at each node when the caller already has it
        (:meth:`target_topk`), else it is computed here for the rows written only.
        """
        if tokens.numel() == 0:
            return
        if partitions is not None:
            tokens = self.partition_rows(tokens, partitions)
        if next_tokens is None:
            if rows is None:
                rows = torch.arange(tokens.numel(), device=tokens.device)
            next_tokens = self.target_topk(logits, torch.where(tokens >= 0, rows, EMPTY))
        self.update_(tokens, next_tokens)

    # ---- partitions (isolated serving) ------------------------------------------------
    def partition_rows(self, tokens: torch.Tensor, partitions: torch.Tensor) -> torch.Tensor:
        """Table rows of ``tokens`` in ``partitions`` (same shape, or broadcastable);
        token -1 or partition -1 give -1, which the ops read as empty and never write."""
        rows = tokens + partitions * self.vocab_size
        return torch.where((tokens >= 0) & (partitions >= 0), rows, EMPTY)

    def for_batch(self, partitions: torch.Tensor | None) -> SuccessorMatrix | BatchView:
        """The matrix as the requests of one batch see it: ``partitions[b]`` is the
        partition request ``b`` reads (``None``: this matrix, every request in
        partition 0)."""
        return self if partitions is None else BatchView(self, partitions)

    def resize_partitions_(self, partitions: int) -> None:
        """Grow (or shrink) to ``partitions`` stacked matrices; new ones start empty."""
        if partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions}")
        rows = partitions * self.vocab_size
        if rows > self.table.shape[0]:
            grown = torch.full((rows, self.k), EMPTY, dtype=torch.int32,
                               device=self.table.device)
            grown[:self.table.shape[0]] = self.table
            self.table = grown
        else:
            self.table = self.table[:rows].contiguous()
        self.partitions = partitions

    def partition(self, index: int) -> torch.Tensor:
        """The ``[vocab, k]`` rows of one partition (a view: writes go to the table)."""
        return self.table[index * self.vocab_size:(index + 1) * self.vocab_size]

    # ---- persistence ------------------------------------------------------------------
    def save(self, path: str | os.PathLike, metadata: dict[str, Any] | None = None) -> int:
        """Write touched rows only; returns the file size in bytes."""
        return self.snapshot().write(path, metadata)

    def snapshot(self) -> MatrixSnapshot:
        """The touched rows, copied to the host (the file's payload, written later)."""
        if self.partitions != 1:
            raise ValueError("only a single (global) successor matrix can be saved")
        rows = self.touched_rows()
        return MatrixSnapshot(
            vocab_size=self.vocab_size, k=self.k,
            rows=rows.to(torch.int32).cpu().numpy().astype("<i4"),
            values=self.table[rows].cpu().numpy().astype("<i4"))

    @classmethod
    def load(cls, path: str | os.PathLike, *, vocab_size: int | None = None,
             k: int | None = None, tokenizer_fingerprint: str | None = None,
             device: torch.device | str = "cpu", backend: str = "compiled",
             check: bool = True) -> SuccessorMatrix:
        """Read a file written by :meth:`save`; checks format, checksum and id ranges.

        ``vocab_size`` / ``k`` / ``tokenizer_fingerprint`` given: the file must match them
        (a matrix warmed on another tokenizer would retrieve nonsense). ``check``: the
        ops' id checks after loading (:class:`SuccessorMatrix`).
        """
        table, _ = read_successor_file(path, vocab_size=vocab_size, k=k,
                                       tokenizer_fingerprint=tokenizer_fingerprint)
        return cls(table.to(device), backend=backend, check=check)


@dataclass(frozen=True)
class MatrixSnapshot:
    """A matrix's touched rows on the host, ready to be written (possibly from another
    thread while the engine goes on)."""

    vocab_size: int
    k: int
    rows: Any  # [num_rows] little-endian int32 (numpy)
    values: Any  # [num_rows, k] little-endian int32 (numpy)

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def write(self, path: str | os.PathLike, metadata: dict[str, Any] | None = None) -> int:
        """Write the file atomically; returns its size in bytes."""
        payload = self.rows.tobytes() + self.values.tobytes()
        header = {
            "format_version": FILE_FORMAT_VERSION,
            "vocab_size": self.vocab_size,
            "k": self.k,
            "num_rows": self.num_rows,
            "sha256": hashlib.sha256(payload).hexdigest(),
            "metadata": metadata or {},
        }
        header_bytes = json.dumps(header, sort_keys=True).encode()
        path = Path(path)
        # a private temporary file (0600 whatever the umask), flushed to disk, then
        # renamed over the old one: a crash or a second writer never leaves a
        # half-written matrix behind, and a kill at any moment leaves at most a stray
        # temporary file (``temporary_files`` finds them)
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}{TEMPORARY_SUFFIX}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
                     | getattr(os, "O_NOFOLLOW", 0), FILE_MODE)
        try:
            try:
                os.fchmod(fd, FILE_MODE)  # the umask may have taken bits away
                _write_all(fd, FILE_MAGIC + _HEADER_LEN.pack(len(header_bytes))
                           + header_bytes + payload)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        _fsync_folder(path.parent)  # the rename itself survives a power loss
        return path.stat().st_size


#: permissions of matrix files and their temporary files, whatever the umask: they hold
#: what serving learned from users' text
FILE_MODE = 0o600
TEMPORARY_SUFFIX = ".tmp"


def temporary_files(path: str | os.PathLike) -> list[Path]:
    """Temporary files that :meth:`MatrixSnapshot.write` to ``path`` left behind (a
    writer killed mid-save): ``.<name>.<random>.tmp`` beside it (12 hex digits, or the
    8 characters of the earlier versions' temporary files), nothing else."""
    path = Path(path)
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(?:[0-9a-f]{{12}}|[a-z0-9_]{{8}})"
                         rf"{re.escape(TEMPORARY_SUFFIX)}")
    try:
        names = os.listdir(path.parent)
    except OSError:
        return []
    return sorted(path.parent / name for name in names if pattern.fullmatch(name))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # not every file system syncs folders
        pass
    finally:
        os.close(fd)


class BatchView:
    """A :class:`SuccessorMatrix` seen by one batch whose requests read different
    partitions: ``gather`` takes ids flattened from ``[B, ...]`` tensors in batch-major
    order (as the template expansion and copy chains pass them), so element ``i``
    belongs to request ``i // (n / B)``."""

    def __init__(self, matrix: SuccessorMatrix, partitions: torch.Tensor):
        self.matrix = matrix
        self.partitions = partitions.to(matrix.table.device, torch.long)

    @property
    def vocab_size(self) -> int:
        return self.matrix.vocab_size

    @property
    def k(self) -> int:
        return self.matrix.k

    @property
    def device(self) -> torch.device:
        return self.matrix.device

    def gather(self, parent_tokens: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
        batch = self.partitions.numel()
        if parent_tokens.numel() % max(batch, 1):
            raise ValueError(f"{parent_tokens.numel()} ids do not split over a batch of "
                             f"{batch} requests")
        per_request = self.partitions.repeat_interleave(parent_tokens.numel() // max(batch, 1))
        rows = self.matrix.partition_rows(parent_tokens.long(), per_request)
        return self.matrix.gather(rows.to(parent_tokens.dtype), ranks)


#: metadata key of the fingerprint of the tokenizer whose ids the matrix holds
TOKENIZER_FINGERPRINT_KEY = "tokenizer_fingerprint"


def read_successor_file(path: str | os.PathLike, *, vocab_size: int | None = None,
                        k: int | None = None, tokenizer_fingerprint: str | None = None
                        ) -> tuple[torch.Tensor, dict[str, Any]]:
    """Return ``(table [vocab, k] int32 on CPU, metadata)``; every error names the file.

    ``tokenizer_fingerprint`` given: a file that records another tokenizer's is refused
    (two tokenizers with equal vocabulary sizes still map ids to different text)."""
    import numpy as np

    path = Path(path)

    def fail(msg: str) -> SuccessorFileError:
        return SuccessorFileError(f"successor matrix file {str(path)!r}: {msg}")

    try:
        data = path.read_bytes()
    except OSError as err:
        raise fail(f"cannot be read ({err.strerror or err})") from None
    prefix = len(FILE_MAGIC) + _HEADER_LEN.size
    if len(data) < prefix or not data.startswith(FILE_MAGIC):
        raise fail("not a successor matrix file (bad magic bytes)")
    (header_len,) = _HEADER_LEN.unpack_from(data, len(FILE_MAGIC))
    try:
        header = json.loads(data[prefix:prefix + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise fail("header is not valid JSON") from None
    if not isinstance(header, dict):
        raise fail("header is not a JSON object")
    version = header.get("format_version")
    if version != FILE_FORMAT_VERSION:
        raise fail(f"format_version {version!r} is not supported (expected {FILE_FORMAT_VERSION})")
    for key in ("vocab_size", "k", "num_rows"):
        if not isinstance(header.get(key), int) or header[key] < (0 if key == "num_rows" else 1):
            raise fail(f"header field {key!r} is missing or invalid: {header.get(key)!r}")
    file_vocab, file_k, num_rows = header["vocab_size"], header["k"], header["num_rows"]
    if vocab_size is not None and file_vocab != vocab_size:
        raise fail(f"vocab_size {file_vocab} does not match the model's {vocab_size}")
    if k is not None and file_k != k:
        raise fail(f"k {file_k} does not match successor_k {k}")
    metadata = header.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise fail("header field 'metadata' is not a JSON object")
    recorded = metadata.get(TOKENIZER_FINGERPRINT_KEY)
    if tokenizer_fingerprint is not None and recorded is not None \
            and recorded != tokenizer_fingerprint:
        raise fail(f"it was learned with another tokenizer (fingerprint {str(recorded)[:12]}, "
                   f"this model's is {tokenizer_fingerprint[:12]})")
    payload = data[prefix + header_len:]
    expected = 4 * num_rows * (1 + file_k)
    if len(payload) != expected:
        raise fail(f"payload has {len(payload)} bytes, header implies {expected} (truncated?)")
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise fail("checksum mismatch: the file is corrupt")
    rows = np.frombuffer(payload, dtype="<i4", count=num_rows).astype(np.int64)
    values = np.frombuffer(payload, dtype="<i4", offset=4 * num_rows).reshape(num_rows, file_k)
    if num_rows and (rows.min() < 0 or rows.max() >= file_vocab or np.any(np.diff(rows) <= 0)):
        raise fail("row ids must be strictly increasing and inside the vocabulary")
    if num_rows and (values.min() < EMPTY or values.max() >= file_vocab):
        raise fail("successor ids outside [-1, vocab_size)")
    table = torch.full((file_vocab, file_k), EMPTY, dtype=torch.int32)
    table[torch.from_numpy(rows)] = torch.from_numpy(values.astype(np.int32))
    return table, metadata
