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
from dataclasses import dataclass
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


# ---- fitting the thresholds ---------------------------------------------------------------
@dataclass(frozen=True)
class TreeRecord:
    """What one dense (unpruned) tree tells about pruning.

    confidence[d]: best-path confidence after draft step d
    kept_accepted[i]: accepted tokens the tree would have kept had it stopped at
                      checkpoint i (the accepted path's prefix inside the best
                      ``draft_keep[i]`` nodes drafted by then)
    full_accepted: accepted tokens of the full tree
    """

    confidence: tuple[float, ...]
    kept_accepted: tuple[int, ...]
    full_accepted: int

    @classmethod
    def from_dense_tree(cls, depths: list[int], accepted_rows: list[int],
                        confidence: list[float], checkpoints: tuple[int, ...],
                        draft_keep: tuple[int, ...]) -> TreeRecord:
        """depths: tree depth of every row (row 0 = root), rows in score order."""
        kept = []
        for checkpoint, keep in zip(checkpoints, draft_keep):
            eligible = [r for r in range(1, len(depths)) if depths[r] <= checkpoint + 1][:keep]
            inside = set(eligible)
            count = 0
            for row in accepted_rows:
                if row not in inside:
                    break
                count += 1
            kept.append(count)
        return cls(tuple(confidence), tuple(kept), len(accepted_rows))


def simulate(records: list[TreeRecord], thresholds: tuple[float, ...],
             checkpoints: tuple[int, ...], retrieval_gain: tuple[float, ...],
             max_depth: int, draft_cost: float) -> tuple[float, float, float]:
    """(tokens per step, draft steps per tree, tokens per unit cost) under
    ``thresholds``: a tree stops at the first checkpoint whose confidence is below its
    threshold, keeps ``kept_accepted`` and gains ``retrieval_gain`` from the freed
    slots; a step costs ``1 + draft_cost * draft_steps`` (verification = 1)."""
    tokens = steps = cost = 0.0
    for record in records:
        accepted, drafted = float(record.full_accepted), max_depth
        for i, (cp, tau) in enumerate(zip(checkpoints, thresholds)):
            c = record.confidence[cp] if cp < len(record.confidence) else float("nan")
            if c == c and c < tau:  # c == c: not NaN
                accepted, drafted = record.kept_accepted[i] + retrieval_gain[i], cp + 1
                break
        tokens += 1 + accepted
        steps += drafted
        cost += 1 + draft_cost * drafted
    n = max(len(records), 1)
    return tokens / n, steps / n, tokens / max(cost, 1e-9)


def fit_thresholds(records: list[TreeRecord], checkpoints: tuple[int, ...],
                   retrieval_gain: tuple[float, ...], max_depth: int,
                   draft_cost: float = 0.1, rounds: int = 3) -> tuple[tuple[float, ...], dict]:
    """Coordinate search of the thresholds that maximise accepted tokens per unit of
    step cost on the recorded trees (candidates: the observed confidences, 0 and 1)."""
    if not records:
        raise ValueError("no dense-tree records to fit thresholds on")
    thresholds = [0.0] * len(checkpoints)
    for _ in range(rounds):
        for i, cp in enumerate(checkpoints):
            observed = sorted({r.confidence[cp] for r in records
                               if cp < len(r.confidence) and r.confidence[cp] == r.confidence[cp]})
            candidates = [0.0, 1.0001] + [(a + b) / 2 for a, b in zip(observed, observed[1:])]
            best = max(candidates, key=lambda t: simulate(
                records, tuple(thresholds[:i] + [t] + thresholds[i + 1:]), checkpoints,
                retrieval_gain, max_depth, draft_cost)[2])
            thresholds[i] = min(best, 1.0)
    mat, steps, per_cost = simulate(records, tuple(thresholds), checkpoints, retrieval_gain,
                                    max_depth, draft_cost)
    dense = simulate(records, tuple(0.0 for _ in checkpoints), checkpoints, retrieval_gain,
                     max_depth, draft_cost)
    return tuple(round(t, 4) for t in thresholds), {
        "records": len(records), "draft_cost": draft_cost,
        "retrieval_gain": list(retrieval_gain),
        "predicted": {"mean_accepted_tokens": round(mat, 3), "draft_steps": round(steps, 2),
                      "tokens_per_cost": round(per_cost, 3)},
        "dense": {"mean_accepted_tokens": round(dense[0], 3), "draft_steps": round(dense[1], 2),
                  "tokens_per_cost": round(dense[2], 3)},
    }
