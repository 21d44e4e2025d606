"""Which model a run names: a local model directory or a Hugging Face Hub model ID, and
the identity recorded for it (the SHA-256 of its ``config.json``, the fingerprint that
calibration and warm-up files carry).

A Hub ID's ``config.json`` comes from the Hugging Face cache (downloaded when absent),
the same bytes a local snapshot of that model holds, so a file made for the ID fits the
snapshot and the other way round. A name that is neither is an error naming it, raised
before any engine starts."""

from __future__ import annotations

import hashlib
from pathlib import Path


class ModelNotFoundError(ValueError):
    """A model name that is neither a local model directory nor a reachable Hub ID."""


def model_config_file(model: str, *, local_files_only: bool = False,
                      cache_dir: str | Path | None = None) -> Path:
    """The ``config.json`` of ``model``: ``MODEL/config.json`` for a directory, else the
    Hub ID's file in the Hugging Face cache (``cache_dir``: that cache's location;
    ``local_files_only``: never download)."""
    local = Path(model).expanduser()
    if (local / "config.json").is_file():
        return local / "config.json"
    if local.exists():
        raise ModelNotFoundError(f"model {model!r}: {local} exists but holds no config.json")
    from transformers.utils import cached_file

    try:
        found = cached_file(model, "config.json", cache_dir=cache_dir,
                            local_files_only=local_files_only)
    except (OSError, ValueError) as err:  # unreachable, unknown, or not an ID's shape
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelNotFoundError(
            f"model {model!r}: neither a local model directory nor a Hugging Face Hub "
            f"model ID whose config.json can be read ({first_line})") from None
    if found is None:
        raise ModelNotFoundError(f"model {model!r}: the Hub repository has no config.json")
    return Path(found)


def model_fingerprint(model: str, **where) -> str:
    """SHA-256 of ``model``'s ``config.json`` (:func:`model_config_file`): the identity
    :func:`vllm_graft.core.calibration.fingerprint_model` gives a local directory."""
    return hashlib.sha256(model_config_file(model, **where).read_bytes()).hexdigest()


def model_name(model: str) -> str:
    """A short name for reports: a directory's name, or a Hub ID's last part."""
    return Path(str(model).rstrip("/")).name


def local_model_dir(model: str) -> Path:
    """``model`` as a local directory: itself, or a Hub ID's snapshot in the Hugging Face
    cache (downloaded when absent), for the tools that read the weights themselves."""
    local = Path(model).expanduser()
    if (local / "config.json").is_file():
        return local
    model_config_file(model)  # a clear error for a name that is neither
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model))
