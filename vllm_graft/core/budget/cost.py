"""Step time: the target's forward as a function of the batch's query tokens, plus
what a step costs besides it in each mode (:class:`StepCosts`, :class:`CostModel`)."""

from __future__ import annotations

import bisect
import json
import math
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from vllm_graft.core.config import StepMode


def batch_bucket(batch: int) -> int:
    """Step measurements are kept per power-of-two batch bucket (1, 2, 4, 8, ...)."""
    return 1 << max(batch - 1, 0).bit_length()


def nearest_buckets(sizes, bucket: int) -> list[int]:
    """Batch buckets ``sizes`` nearest ``bucket`` first (by factor; ties: the smaller)."""
    return sorted(sizes, key=lambda size: (abs(math.log2(size / bucket)), size))



def non_decreasing(values: list[float]) -> list[float]:
    """The least-squares non-decreasing fit of ``values`` (pool adjacent violators):
    each run that decreases is replaced by its mean."""
    blocks: list[list[float]] = []  # [sum, count]
    for value in values:
        blocks.append([float(value), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def _beyond_slope(curve: tuple[list[float], list[float]]) -> float:
    """ms per query token past a curve's last point (:class:`CostModel`): its last
    segment's slope, or its mean slope where that is steeper."""
    xs, ys = curve
    return max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), (ys[-1] - ys[0]) / (xs[-1] - xs[0]))


@dataclass
class _LineSums:
    """Discounted sums of one (batch bucket, mode)'s steps: weight, nodes, cost, their
    squares and product, for a least-squares line of cost against nodes."""

    weight: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def add(self, x: float, y: float, keep: float) -> None:
        self.weight = keep * self.weight + 1.0
        self.x = keep * self.x + x
        self.y = keep * self.y + y
        self.xx = keep * self.xx + x * x
        self.xy = keep * self.xy + x * y

    def intercept(self, slope: float) -> float:
        """The line's cost at no node, given its slope (at least 0)."""
        return max((self.y - slope * self.x) / self.weight, 0.0)

    def centred(self) -> tuple[float, float]:
        """(sum of (x - mean)^2, sum of (x - mean)(y - mean))."""
        return (self.xx - self.x * self.x / self.weight,
                self.xy - self.x * self.y / self.weight)


@dataclass
class StepCosts:
    """What a decoding step costs besides the target's forward, per mode, learned from
    whole steps: ``fixed + per_node * nodes`` for a step that verifies ``nodes`` nodes.

    Each measured step's time less its forward is a point ``(nodes, extra ms)`` of its
    mode: the fixed part is fitted per batch bucket, the per-node part per mode over all
    buckets, each a discounted least-squares line (one ``window``-th forgotten per step
    of the bucket and mode), the slope shrunk toward its prior by
    ``slope_prior_weight`` (in nodes squared). A point counts at most
    ``outlier_factor`` times the prediction. Why: docs/design-log.md#cost-model."""

    window: float = 200.0
    slope_prior_weight: float = 32.0
    outlier_factor: float = 4.0
    sums: dict[tuple[int, StepMode], _LineSums] = field(default_factory=dict)
    observed: int = 0  # steps observed

    def observe(self, mode: StepMode, batch: int, nodes: int, extra_ms: float,
                prior_per_node_ms: float = 0.0) -> None:
        if batch <= 0 or nodes < 0 or not math.isfinite(extra_ms):
            return
        key = (batch_bucket(batch), mode)
        sums = self.sums.get(key)
        if sums is not None and sums.weight >= 8:
            fixed, per_node = self.line(batch, mode, prior_per_node_ms)
            extra_ms = min(extra_ms, self.outlier_factor * (fixed + per_node * nodes) + 1.0)
        self.sums.setdefault(key, _LineSums()).add(float(nodes), max(extra_ms, 0.0),
                                                   1.0 - 1.0 / self.window)
        self.observed += 1

    def describe(self) -> str:
        """One line per mode: its per-node cost and fixed cost per batch bucket."""
        lines = []
        for mode in self.modes():
            per_node = self.per_node_ms(mode)
            fixed = ", ".join(f"batch <= {size}: {sums.intercept(per_node):.2f}"
                              for (size, kind), sums in sorted(self.sums.items(),
                                                               key=lambda kv: kv[0][0])
                              if kind is mode)
            lines.append(f"{mode.value}: {per_node:.3f} ms per node, fixed ms {fixed}")
        return "; ".join(lines)

    def modes(self) -> list[StepMode]:
        """The modes with measured steps, in :class:`StepMode` order."""
        return [mode for mode in StepMode if any(kind is mode for _, kind in self.sums)]

    def per_node_ms(self, mode: StepMode, prior: float = 0.0) -> float:
        """The mode's cost per verified node, pooled over batch buckets (each centred
        on its own mean, so buckets' different fixed costs do not tilt the slope)."""
        spread = covariance = 0.0
        for (_, kind), sums in self.sums.items():
            if kind is mode and sums.weight > 0:
                xx, xy = sums.centred()
                spread, covariance = spread + xx, covariance + xy
        weight = self.slope_prior_weight
        return max((covariance + weight * prior) / (spread + weight), 0.0)

    def line(self, batch: int, mode: StepMode,
             prior_per_node_ms: float = 0.0) -> tuple[float, float] | None:
        """``(fixed_ms, per_node_ms)`` of ``mode`` at ``batch``, from its batch bucket
        or else the nearest one measured; None while the mode has no measured step."""
        measured = [size for size, kind in self.sums if kind is mode]
        if not measured:
            return None
        bucket = batch_bucket(batch)
        nearest = nearest_buckets(measured, bucket)[0]
        sums = self.sums[(nearest, mode)]
        per_node = self.per_node_ms(mode, prior_per_node_ms)
        return sums.intercept(per_node), per_node


@dataclass
class CostModel:
    """Step time (ms) = verification forward + the step's other costs in its mode.

    ``curves`` maps a batch size to ``(tokens, ms)``: increasing total query tokens of
    the batch and the forward's time there. Between measured batch sizes the time is
    interpolated linearly; past a curve's last point it grows with its last slope, or
    its mean slope where that is steeper. The other costs are learned from whole steps
    (:class:`StepCosts`); until a mode has run, and always for a ``frozen`` profile, a
    tree step pays ``overhead_ms`` on top of plain decoding's, a chain step what plain
    decoding pays, and both ``per_node_ms``. Why: docs/design-log.md#cost-model.
    """

    curves: dict[int, tuple[list[float], list[float]]]
    overhead_ms: float = 0.0
    per_node_ms: float = 0.0
    key: dict[str, str] = field(default_factory=dict)  # model, device, dtype, layout
    frozen: bool = False  # a pinned profile: no online refresh of curves or step costs
    steps: StepCosts = field(default_factory=StepCosts)
    #: the query tokens the measurement aimed to reach (0: unknown); a measurement cut
    #: short by its time budget reaches fewer, and measuring again would too
    requested_tokens: int = 0

    def __post_init__(self):
        if not self.curves:
            raise ValueError("a cost model needs at least one measured curve")
        for name in ("overhead_ms", "per_node_ms"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be finite and >= 0, got {getattr(self, name)}")
        for batch, (tokens, ms) in self.curves.items():
            if batch < 1:
                raise ValueError(f"curve for batch {batch}: batch sizes start at 1")
            if len(tokens) != len(ms) or len(tokens) < 2:
                raise ValueError(f"curve for batch {batch}: need >= 2 points, got "
                                 f"{len(tokens)} tokens and {len(ms)} times")
            if any(b <= a for a, b in zip(tokens, tokens[1:])):
                raise ValueError(f"curve for batch {batch}: tokens must increase")
            # a forward takes time: a zero would price steps at nothing (and divide by
            # zero), a NaN would never be repaired by online refreshes
            if not all(0 < value < math.inf for value in (*tokens, *ms)):
                raise ValueError(f"curve for batch {batch}: tokens and ms must be finite "
                                 f"and > 0")
            # more query tokens never make a forward cheaper: a dip is measurement noise
            self.curves[batch] = (list(tokens), non_decreasing(ms))

    # The cost model is a handful of host floats that change every step, so it is
    # evaluated on the host with numpy: a dozen tiny tensor ops per sizing cost more
    # than the arithmetic, and no device copy of the curves could be kept. The tensor
    # methods convert at their edges.
    def verify_ms(self, batch: int, total_tokens: torch.Tensor) -> torch.Tensor:
        """Forward time for ``total_tokens`` (any shape) query tokens at ``batch``
        (float64, on ``total_tokens``' device)."""
        return self._to_tensor(self._verify_ms(batch, self._host(total_tokens)), total_tokens)

    def step_ms(self, batch: int, nodes: torch.Tensor,
                mode: StepMode = StepMode.TREE) -> torch.Tensor:
        """Time of a ``mode`` step that verifies ``nodes`` nodes in total (plus the
        batch's roots); a step with no node is plain decoding and pays what it does."""
        return self._to_tensor(self._step_ms(batch, self._host(nodes), mode), nodes)

    @staticmethod
    def _host(values: torch.Tensor) -> np.ndarray:
        return values.detach().to("cpu", torch.float64).numpy()

    @staticmethod
    def _to_tensor(values: np.ndarray, like: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.asarray(values, dtype=np.float64)).to(like.device)

    def _neighbours(self, batch: int) -> tuple[int, int, float]:
        """The measured batch sizes whose curves give the forward's time at ``batch``:
        ``(lower, upper, weight of upper)``; one size twice (weight 0) at or past the
        ends of the measured sizes, or where ``batch`` was measured itself."""
        sizes = sorted(self.curves)
        if batch <= sizes[0] or batch >= sizes[-1]:
            nearest = sizes[0] if batch <= sizes[0] else sizes[-1]
            return nearest, nearest, 0.0
        upper = next(s for s in sizes if s >= batch)
        lower = max(s for s in sizes if s <= batch)
        if upper == lower:
            return lower, lower, 0.0
        return lower, upper, (batch - lower) / (upper - lower)

    def _verify_ms(self, batch: int, total_tokens: np.ndarray) -> np.ndarray:
        lower, upper, weight = self._neighbours(batch)
        if upper == lower:
            return self._curve_ms(lower, total_tokens)
        # same tokens per request on both neighbouring curves, then linear in batch
        per_request = total_tokens / batch
        low = self._curve_ms(lower, per_request * lower)
        high = self._curve_ms(upper, per_request * upper)
        return low + weight * (high - low)

    def _step_ms(self, batch: int, nodes: np.ndarray, mode: StepMode) -> np.ndarray:
        plain, fixed, per_node = self.other_costs(batch, mode)
        other = np.where(nodes > 0, fixed + per_node * nodes, plain)
        return self._verify_ms(batch, batch + nodes) + other

    def other_costs(self, batch: int, mode: StepMode) -> tuple[float, float, float]:
        """What a step at ``batch`` costs besides the forward: ``(plain decoding's,
        mode's fixed, mode's per node)`` ms (class doc)."""
        learned = None if self.frozen else self.steps.line(batch, mode, self.per_node_ms)
        plain_line = None if self.frozen else self.steps.line(batch, StepMode.PLAIN)
        if learned is None:
            plain = 0.0 if plain_line is None else plain_line[0]
            fixed = plain + (self.overhead_ms if mode is StepMode.TREE else 0.0)
            return plain, fixed, self.per_node_ms
        # plain decoding never measured (not among the guard's modes): verifying no node
        # is assumed to save nothing of the mode's fixed cost
        plain = learned[0] if plain_line is None else plain_line[0]
        return plain, learned[0], learned[1]

    def observe_step(self, mode: StepMode, batch: int, nodes: int, step_ms: float,
                     forward_ms: float) -> None:
        """One whole decoding step of ``mode`` (``nodes`` verified, none for plain
        decoding) took ``step_ms``, its forward ``forward_ms``; a frozen profile keeps
        its own costs."""
        if not self.frozen:
            self.steps.observe(mode, batch, nodes, step_ms - forward_ms, self.per_node_ms)

    def _curve_ms(self, batch: int, tokens: np.ndarray) -> np.ndarray:
        xs, ys = (np.asarray(values, dtype=np.float64) for values in self.curves[batch])
        index = np.minimum(np.maximum(np.searchsorted(xs, tokens), 1), xs.size - 1)
        x0, x1, y0, y1 = xs[index - 1], xs[index], ys[index - 1], ys[index]
        inside = y0 + (tokens - x0) * (y1 - y0) / (x1 - x0)  # also below the first point
        beyond = ys[-1] + (tokens - xs[-1]) * _beyond_slope(self.curves[batch])
        return np.where(tokens > xs[-1], beyond, inside)

    def observe(self, batch: int, total_tokens: int, measured_ms: float,
                rate: float = 0.1) -> None:
        """Move the nearest measured curve toward a real step's forward time. Half of
        the move scales the whole curve, so its level tracks the device (clock changes,
        other tenants, a different context length); the other half goes to the two
        points around ``total_tokens``, by their interpolation weights, so the shape is
        learned where steps really run (a start-up point measured while something else
        ran would otherwise stay wrong, and so would every tree size chosen by it). The
        curve stays non-decreasing. A frozen profile stays as it is."""
        if self.frozen:
            return
        nearest = min(self.curves, key=lambda size: abs(size - batch))
        predicted = float(self._curve_ms(nearest, np.float64(total_tokens)))
        if predicted <= 0 or measured_ms <= 0:
            return
        ratio = measured_ms / predicted
        tokens, ms = self.curves[nearest]
        upper = min(max(bisect.bisect_left(tokens, total_tokens), 1), len(tokens) - 1)
        weight = min(max((total_tokens - tokens[upper - 1])
                         / (tokens[upper] - tokens[upper - 1]), 0.0), 1.0)
        local = {upper - 1: 1.0 - weight, upper: weight}
        ms = [value * ratio ** (rate / 2 * (1.0 + local.get(i, 0.0)))
              for i, value in enumerate(ms)]
        self.curves[nearest] = (tokens, non_decreasing(ms))

    # persistence: a profile is cached per (model, device, dtype, parallel layout)
    def save(self, path: str | Path) -> None:
        """Written whole or not at all (a temporary file renamed over ``path``): engines
        starting together each write their profile, and a reader must never see half
        of one."""
        path = Path(path)
        text = json.dumps({
            "key": self.key, "overhead_ms": self.overhead_ms, "per_node_ms": self.per_node_ms,
            "frozen": self.frozen, "requested_tokens": self.requested_tokens,
            "curves": {str(b): {"tokens": t, "ms": m} for b, (t, m) in self.curves.items()}},
            indent=1)
        # created as open() creates files (the umask's permissions, not mkstemp's 0600)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        try:
            with open(temporary, "x") as file:
                file.write(text)
            os.replace(temporary, path)
        except OSError:
            temporary.unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | Path, expected_key: dict[str, str] | None = None) -> CostModel:
        """Raises ValueError naming the file when it is malformed or was measured for
        another model, device, dtype or layout than ``expected_key``."""
        try:
            data = json.loads(Path(path).read_text())
            if not isinstance(data, dict) or not isinstance(data.get("curves"), dict):
                raise ValueError("no 'curves' object")
            key, frozen = data.get("key", {}), data.get("frozen", False)
            if not isinstance(key, dict) or not isinstance(frozen, bool):
                raise ValueError("'key' must be an object and 'frozen' true or false")
            curves = {int(b): (list(map(float, c["tokens"])), list(map(float, c["ms"])))
                      for b, c in data["curves"].items()}
            requested = data.get("requested_tokens", 0)
            if not isinstance(requested, int) or isinstance(requested, bool) or requested < 0:
                raise ValueError("'requested_tokens' must be a whole number >= 0")
            model = cls(curves=curves, overhead_ms=float(data.get("overhead_ms", 0.0)),
                        per_node_ms=float(data.get("per_node_ms", 0.0)),
                        key=key, frozen=frozen, requested_tokens=requested)
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as error:
            raise ValueError(f"cost profile {path}: {error}") from error
        if expected_key is not None and model.key != expected_key:
            raise ValueError(f"cost profile {path} was measured for {model.key}, "
                             f"not {expected_key}")
        return model

    @classmethod
    def from_gpu_check(cls, path: str | Path, context: int) -> CostModel:
        """The verification cost curves that ``scripts/gpu_check.sh`` measured (its JSON
        report), at one context length."""
        report = json.loads(Path(path).read_text())
        section = report["sections"]["verification_cost"]
        curves: dict[int, tuple[list[float], list[float]]] = {}
        for row in sorted(section["rows"], key=lambda r: (r["batch"], r["total_tokens"])):
            if row["context"] == context:
                tokens, ms = curves.setdefault(row["batch"], ([], []))
                tokens.append(float(row["total_tokens"]))
                ms.append(float(row["forward_ms"]))
        if not curves:
            raise ValueError(f"{path} has no verification cost rows at context {context}")
        env = report.get("environment", {})
        return cls(curves=curves, key={"model": section.get("model", ""),
                                       "device": env.get("device_name", ""),
                                       "dtype": section.get("dtype", ""),
                                       "layout": f"context {context}"})
