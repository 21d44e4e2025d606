"""The calibration file: pruning thresholds fitted on warm-up conversations.

Thresholds only make sense for the drafter and target they were fitted with and for
the checkpoint layout they were fitted at, so the file records both identities (a
fingerprint of each model's ``config.json``, path independent), the checkpoints and
budgets, the template and a hash of the warm-up corpus. :func:`load_calibration`
validates all of it; every error names the file and the field.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from vllm_graft.core.config import GraftConfig, format_validation_error

CALIBRATION_FORMAT_VERSION = 1


class CalibrationError(ValueError):
    """A calibration file is unreadable, malformed or does not fit this deployment."""


class ModelIdentity(BaseModel):
    """Which model a calibration belongs to. ``fingerprint`` is the SHA-256 of the
    model's ``config.json`` bytes, so a copy at another path still matches."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(min_length=1)
    fingerprint: str = Field(pattern="^[0-9a-f]{64}$")


class Calibration(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: int
    checkpoints: tuple[int, ...]
    thresholds: tuple[float, ...]
    budget: int = Field(ge=1)
    draft_keep: tuple[int, ...]
    template: str = Field(min_length=1)
    target: ModelIdentity
    drafter: ModelIdentity
    warmup_corpus_sha256: str = Field(pattern="^[0-9a-f]{64}$")
    fit: dict[str, Any] = Field(default_factory=dict, description="how the fit went")

    @field_validator("format_version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v != CALIBRATION_FORMAT_VERSION:
            raise ValueError(f"version {v} is not supported (expected {CALIBRATION_FORMAT_VERSION})")
        return v

    @field_validator("thresholds")
    @classmethod
    def _probabilities(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if any(not 0.0 <= t <= 1.0 for t in v):
            raise ValueError(f"every threshold must lie in [0, 1], got {list(v)}")
        return v

    @model_validator(mode="after")
    def _lengths(self) -> Calibration:
        n = len(self.checkpoints)
        if len(self.thresholds) != n or len(self.draft_keep) != n:
            raise ValueError(
                f"checkpoints ({n}), thresholds ({len(self.thresholds)}) and draft_keep "
                f"({len(self.draft_keep)}) must have the same length")
        return self

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.model_dump(mode="json"), indent=2) + "\n")


def fingerprint_model(model_dir: str | os.PathLike) -> str:
    """SHA-256 of a model directory's config.json (the identity stored in calibrations)."""
    return hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()


def load_calibration(path: str | os.PathLike, config: GraftConfig | None = None, *,
                     target_fingerprint: str | None = None,
                     drafter_fingerprint: str | None = None) -> Calibration:
    """Read and validate a calibration file, and check it fits ``config`` and the models."""
    path = Path(path)
    where = f"calibration file {str(path)!r}"
    try:
        raw = json.loads(path.read_text())
    except OSError as err:
        raise CalibrationError(f"{where}: cannot be read ({err.strerror or err})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CalibrationError(f"{where}: not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise CalibrationError(f"{where}: top level must be a JSON object")
    try:
        calibration = Calibration.model_validate(raw)
    except ValidationError as err:
        raise CalibrationError(f"{where}: {format_validation_error(err, 'calibration')}") from None

    if config is not None:
        for key in ("checkpoints", "budget", "draft_keep"):
            mine, theirs = getattr(config, key), getattr(calibration, key)
            if mine != theirs:
                raise CalibrationError(
                    f"{where}: field {key!r} is {_show(theirs)} but graft.{key} is "
                    f"{_show(mine)}; recalibrate for this layout")
    for key, expected in (("target", target_fingerprint), ("drafter", drafter_fingerprint)):
        found = getattr(calibration, key)
        if expected is not None and found.fingerprint != expected:
            raise CalibrationError(
                f"{where}: field '{key}.fingerprint' belongs to {found.name!r}, not to the "
                f"{key} being served; recalibrate with this {key}")
    return calibration


def _show(value: Any) -> str:
    return json.dumps(list(value) if isinstance(value, tuple) else value)
