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
from typing import Any, Literal

import numpy as np
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

# the tally a calibration file records is the acceptance model's (SourceAcceptance is
# re-exported for the files' readers)
from vllm_graft.core.budget.acceptance_model import (SOURCE_NAMES, AcceptanceModel,  # noqa: F401
                                                     AcceptanceTally, SourceAcceptance,
                                                     class_index)
from vllm_graft.core.config import GraftConfig, format_validation_error
from vllm_graft.core.hybrid import UNKNOWN_SCORE

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
    shape: Literal["tree", "chain"] = Field(
        "tree", description="fitted on Graft trees, or on Graft-TAIL chains (variant tail)")
    target: ModelIdentity
    drafter: ModelIdentity
    warmup_corpus_sha256: str = Field(pattern="^[0-9a-f]{64}$")
    fit: dict[str, Any] = Field(default_factory=dict, description="how the fit went")
    acceptance: AcceptanceTally | None = Field(
        None, description="per source and depth, how often the calibration runs' nodes "
        "were accepted: seeds the acceptance model of budget auto (files written before "
        "it was recorded have none, and the model starts from its prior)")
    chain_acceptance: AcceptanceTally | None = Field(
        None, description="the same for copy chains' nodes, what a chain-only budget-auto "
        "run learned (verified and shadow chains): seeds the chain acceptance model, a "
        "population of its own (files without it leave that model at its prior)")

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
        shape = "chain" if config.variant.chains else "tree"
        if calibration.shape != shape:
            raise CalibrationError(
                f"{where}: field 'shape' is {calibration.shape!r} but graft.variant "
                f"{config.variant.value!r} drafts {shape}s; calibrate with --variant "
                f"{config.variant.value}")
        keys = ("checkpoints", "budget") if config.variant.chains \
            else ("checkpoints", "budget", "draft_keep")
        for key in keys:
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
    outcomes = []
    for record in records:
        accepted, drafted = float(record.full_accepted), max_depth
        for i, (cp, tau) in enumerate(zip(checkpoints, thresholds)):
            c = record.confidence[cp] if cp < len(record.confidence) else float("nan")
            if c == c and c < tau:  # c == c: not NaN
                accepted, drafted = record.kept_accepted[i] + retrieval_gain[i], cp + 1
                break
        outcomes.append((accepted, drafted))
    return _per_step(outcomes, draft_cost)


def _per_step(outcomes: list[tuple[float, int]], draft_cost: float
              ) -> tuple[float, float, float]:
    """(tokens per step, draft steps per step, tokens per unit cost) of simulated steps,
    each ``(accepted drafts, draft steps)``; a step emits ``1 + accepted`` tokens and
    costs ``1 + draft_cost * draft steps`` (verification = 1)."""
    tokens = sum(1 + accepted for accepted, _ in outcomes)
    steps = sum(drafted for _, drafted in outcomes)
    cost = sum(1 + draft_cost * drafted for _, drafted in outcomes)
    n = max(len(outcomes), 1)
    return tokens / n, steps / n, tokens / max(cost, 1e-9)


def _coordinate_search(candidates: list[list[float]], score, rounds: int = 3
                       ) -> tuple[float, ...]:
    """Thresholds maximising ``score(thresholds)``, one coordinate at a time; the
    candidates of coordinate ``i``: 0, 1 (stop always) and the midpoints between the
    sorted confidences observed where threshold ``i`` applies."""
    thresholds = [0.0] * len(candidates)
    for _ in range(rounds):
        for i, observed in enumerate(candidates):
            observed = sorted(set(observed))
            options = [0.0, 1.0001] + [(a + b) / 2 for a, b in zip(observed, observed[1:])]
            best = max(options, key=lambda t: score(
                tuple(thresholds[:i] + [t] + thresholds[i + 1:])))
            thresholds[i] = min(best, 1.0)
    return tuple(thresholds)


def _fit_summary(simulated, unpruned, count: int, draft_cost: float,
                 retrieval_gain: tuple[float, ...]) -> dict:
    def show(result):
        mat, steps, per_cost = result
        return {"mean_accepted_tokens": round(mat, 3), "draft_steps": round(steps, 2),
                "tokens_per_cost": round(per_cost, 3)}
    return {"records": count, "draft_cost": draft_cost, "retrieval_gain": list(retrieval_gain),
            "predicted": show(simulated), "dense": show(unpruned)}


def fit_thresholds(records: list[TreeRecord], checkpoints: tuple[int, ...],
                   retrieval_gain: tuple[float, ...], max_depth: int,
                   draft_cost: float = 0.1, rounds: int = 3) -> tuple[tuple[float, ...], dict]:
    """Coordinate search of the thresholds that maximise accepted tokens per unit of
    step cost on the recorded trees (candidates: the observed confidences, 0 and 1)."""
    if not records:
        raise ValueError("no dense-tree records to fit thresholds on")
    candidates = [[r.confidence[cp] for r in records
                   if cp < len(r.confidence) and r.confidence[cp] == r.confidence[cp]]
                  for cp in checkpoints]

    def run(thresholds):
        return simulate(records, thresholds, checkpoints, retrieval_gain, max_depth,
                        draft_cost)
    thresholds = _coordinate_search(candidates, lambda t: run(t)[2], rounds)
    return tuple(round(t, 4) for t in thresholds), _fit_summary(
        run(thresholds), run(tuple(0.0 for _ in checkpoints)), len(records), draft_cost,
        retrieval_gain)


# ---- acceptance per source and depth ------------------------------------------------------
def tally_acceptance(records: list[dict]) -> AcceptanceTally:
    """Per source class, depth and score bucket, the nodes of verified trees whose parent
    lay on the accepted path (trials) and those accepted. ``records``: verified trees as
    the engine's tree recording gives them (``parents``, ``depths``, ``source`` and
    ``score``, None when unscored, per row, row 0 the root; and ``accepted_rows``);
    depths and scores are bucketed as the acceptance model buckets them."""
    max_depth, score_buckets = AcceptanceModel.max_depth, AcceptanceModel.score_buckets
    shape = (len(SOURCE_NAMES), max_depth, score_buckets)
    trials = np.zeros(shape, dtype=np.int64)
    accepts = np.zeros_like(trials)
    for record in records:
        parents = np.asarray(record["parents"], dtype=np.int64)
        on_path = np.zeros(parents.size, dtype=bool)
        on_path[0] = True
        on_path[np.asarray(record["accepted_rows"], dtype=np.int64)] = True
        tried = (parents >= 0) & on_path[np.maximum(parents, 0)]
        score = record.get("score")
        score = np.full(parents.size, UNKNOWN_SCORE) if score is None else np.asarray(score)
        where = class_index(np.asarray(record["source"])[tried],
                            np.asarray(record["depths"])[tried], score[tried], max_depth,
                            score_buckets)
        trials += np.bincount(where, minlength=trials.size).reshape(shape)
        accepts += np.bincount(where, weights=on_path[tried],
                               minlength=trials.size).astype(np.int64).reshape(shape)
    return AcceptanceTally.of_counts(trials, accepts)


# ---- Graft-TAIL chains ------------------------------------------------------------------
@dataclass(frozen=True)
class ChainRecord:
    """What one unpruned Graft-TAIL chain tells about pruning: the cumulative confidence
    after each draft step, and how many of its drafted tokens were accepted."""

    confidence: tuple[float, ...]
    accepted: int


def _stage_of_step(checkpoints: tuple[int, ...], step: int) -> int:
    """Index of the checkpoint whose threshold is in force at draft ``step``."""
    return max(i for i, cp in enumerate(checkpoints) if cp <= step)


def simulate_chains(records: list[ChainRecord], thresholds: tuple[float, ...],
                    checkpoints: tuple[int, ...], retrieval_gain: tuple[float, ...],
                    length: int, draft_cost: float) -> tuple[float, float, float]:
    """(tokens per step, draft steps per chain, tokens per unit cost) under
    ``thresholds`` (:func:`vllm_graft.core.tail.step_thresholds`): a chain stops at the
    first step ``s`` whose confidence is below the threshold in force, keeps
    ``min(accepted, s)`` drafted tokens and gains the retrieval gain of that stage."""
    from vllm_graft.core.tail import step_thresholds

    per_step = step_thresholds(checkpoints, thresholds, length)
    outcomes = []
    for record in records:
        accepted, drafted = float(record.accepted), length
        for step, tau in enumerate(per_step):
            c = record.confidence[step] if step < len(record.confidence) else float("nan")
            if c == c and c < tau:
                stage = _stage_of_step(checkpoints, step)
                accepted = min(record.accepted, step) + retrieval_gain[stage]
                drafted = step + 1
                break
        outcomes.append((accepted, drafted))
    return _per_step(outcomes, draft_cost)


def fit_chain_thresholds(records: list[ChainRecord], checkpoints: tuple[int, ...],
                         retrieval_gain: tuple[float, ...], length: int,
                         draft_cost: float = 0.1, rounds: int = 3
                         ) -> tuple[tuple[float, ...], dict]:
    """The Graft-TAIL thresholds that maximise accepted tokens per unit of step cost on
    the recorded chains (candidates: the confidences observed in each threshold's
    steps, 0 and 1). A checkpoint at or past ``length`` never applies; it keeps 0."""
    if not records:
        raise ValueError("no chain records to fit thresholds on")
    if not checkpoints or checkpoints[0] != 0:
        raise ValueError(f"chain calibration needs a checkpoint at step 0, got "
                         f"{list(checkpoints)}")
    bounds = [*checkpoints[1:], length]
    candidates = [[r.confidence[s] for r in records
                   for s in range(cp, min(end, len(r.confidence)))
                   if r.confidence[s] == r.confidence[s]] if cp < length else []
                  for cp, end in zip(checkpoints, bounds)]

    def run(thresholds):
        return simulate_chains(records, thresholds, checkpoints, retrieval_gain, length,
                               draft_cost)
    thresholds = _coordinate_search(candidates, lambda t: run(t)[2], rounds)
    thresholds = tuple(t if cp < length else 0.0 for t, cp in zip(thresholds, checkpoints))
    return tuple(round(t, 4) for t in thresholds), _fit_summary(
        run(thresholds), run(tuple(0.0 for _ in checkpoints)), len(records), draft_cost,
        retrieval_gain)
