"""Cost-aware tree size: how many of a step's candidate nodes are worth verifying.

A verification forward costs more as the batch's query tokens grow (slowly while the
GPU has idle compute, then linearly), and a node is only worth its tokens if it is
likely to be accepted. Three pieces, all batched and device-agnostic:

* :class:`CostModel`: step time in ms as a function of the batch size and the batch's
  total query tokens: the target's forward, piecewise linear through measured points (a
  start-up profile or ``scripts/gpu_check.sh``'s cost curve), plus what a step costs
  besides the forward in each mode, a fixed part and a part per verified node
  (:class:`StepCosts`, learned from whole steps); refreshed online from measured steps.
* :class:`AcceptanceModel`: the probability that a node is accepted given that its
  parent was, per (source, depth, score bucket), learned online from verified trees
  (Beta counts seeded by a prior). A node's probability of lying on the accepted path
  is the product along its ancestors (:func:`path_probability`).
* :func:`choose_nodes`: for the whole batch, the set of nodes whose verification
  maximises expected emitted tokens per millisecond. Expected emitted tokens of a step
  are ``batch + sum of the chosen nodes' path probabilities`` (every request emits its
  bonus token), so ranking all candidates by path probability and taking the best
  prefix is exact for a cost that depends on the token count only; ties keep parents
  before children, so the choice is always a set of subtrees under the roots. Choosing
  no node means plain decoding for that request.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import statistics
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from vllm_graft.core.acceptance import AcceptanceResult
from vllm_graft.core.chain import HostChains
from vllm_graft.core.config import StepMode
from vllm_graft.core.hybrid import SOURCE_CONTEXT, UNKNOWN_SCORE, HybridTree, trim_tree

#: the acceptance model's source classes; a context-copied node is ``context`` whatever
#: else proposed it
SOURCE_NAMES = ("draft", "retrieved", "both", "context")
#: the most trials a calibration's measurement of one (source, depth) counts as
CALIBRATION_EVIDENCE_TRIALS = 32.0


# ---- cost ------------------------------------------------------------------------------
def batch_bucket(batch: int) -> int:
    """Step measurements are kept per power-of-two batch bucket (1, 2, 4, 8, ...)."""
    return 1 << max(batch - 1, 0).bit_length()


def nearest_buckets(sizes, bucket: int) -> list[int]:
    """Batch buckets ``sizes`` nearest ``bucket`` first (by factor; ties: the smaller)."""
    return sorted(sizes, key=lambda size: (abs(math.log2(size / bucket)), size))


def mostly_new(joined: int, batch: int) -> bool:
    """Whether a batch whose ``joined`` of ``batch`` requests just arrived is new text
    (at least half of it): the chain scout looks at its first steps, and the guard
    leaves its chains to the scout."""
    return 2 * joined >= batch


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

    The forward curve alone leaves out everything else a step pays: the engine's own
    scheduling and sampling (plain decoding pays it too), the drafter's forwards, and
    Graft's work per verified node (its row of logits, sampling, tree attention set-up,
    the matrix update). A sizer that knows only the forward verifies nodes whose real
    cost it never sees (humaneval at batch 1: 3.7 tokens verified per step for 1.6
    accepted, slower than plain). So each measured step's time less its measured
    forward is a point ``(nodes, extra ms)`` of its mode: the fixed part is fitted per
    batch bucket (drafting grows with the batch), the per-node part per mode over all
    buckets (a node costs about the same whatever the batch), each a discounted least
    squares line (one ``window``-th forgotten per step of the bucket and mode), the
    slope shrunk toward its prior by ``slope_prior_weight`` (in nodes squared) so a few
    steps of equal size do not decide it. A point far above the line (a stall of the
    host, say) counts as at most ``outlier_factor`` times the prediction."""

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
    interpolated linearly; past the last point of a curve it grows with the curve's last
    slope, or its mean slope where that is steeper: a last segment that noise flattened
    (pooled with its neighbour by :func:`non_decreasing`) would price every larger step
    as the last point, and the sizer would fill every tree. The other costs are learned
    from whole steps (:class:`StepCosts`); until a mode has run, and always for a
    ``frozen`` profile, a tree step pays ``overhead_ms`` (drafting, bookkeeping) on top
    of plain decoding's, a chain step what plain decoding pays, and both
    ``per_node_ms`` (Graft's work per verified node).
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

    def _verify_point_ms(self, batch: int):
        """:meth:`_verify_ms` at ``batch`` as a function of one point's total tokens, in
        plain Python (the same arithmetic in the same order); the curves it reads are
        chosen once."""
        lower, upper, weight = self._neighbours(batch)
        if upper == lower:
            return lambda total_tokens: self._curve_point_ms(lower, total_tokens)

        def interpolated(total_tokens: float) -> float:
            per_request = total_tokens / batch
            low = self._curve_point_ms(lower, per_request * lower)
            high = self._curve_point_ms(upper, per_request * upper)
            return low + weight * (high - low)
        return interpolated

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

    def _curve_point_ms(self, batch: int, tokens: float) -> float:
        """:meth:`_curve_ms` at one point, in plain Python: it runs once per engine step,
        where even numpy's per-call cost exceeds the arithmetic."""
        xs, ys = self.curves[batch]
        if tokens > xs[-1]:
            return ys[-1] + (tokens - xs[-1]) * _beyond_slope(self.curves[batch])
        upper = min(max(bisect.bisect_left(xs, tokens), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[upper - 1], xs[upper], ys[upper - 1], ys[upper]
        return y0 + (tokens - x0) * (y1 - y0) / (x1 - x0)

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
        predicted = self._curve_point_ms(nearest, float(total_tokens))
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


# ---- acceptance -------------------------------------------------------------------------
@dataclass
class AcceptanceModel:
    """P(node accepted | parent accepted) per (source, depth, score bucket), as Beta counts.

    ``score`` is what is known of a node when the tree is built, in [0, 1]; buckets
    split it evenly. The engine scores context-copied nodes by the length of their
    match (:func:`vllm_graft.core.context.match_score`: a long match is copied far more
    often than a short one), a tree's drafted nodes by their probability under the
    drafter given their parent (:func:`vllm_graft.core.graft.local_probability`) and its
    retrieved nodes by their successor rank (:func:`vllm_graft.core.graft.rank_score`):
    a tree's many siblings are accepted far less often than its first child, and one
    rate per depth would keep or cut them all. A node proposed by several sources keeps
    the highest score; nodes of chains walked by the matrix are :data:`UNKNOWN_SCORE`.
    ``prior_accepts`` / ``prior_trials`` seed every bucket; :meth:`seed` adds the rates
    a calibration run measured, so a cold model is not blind.
    """

    max_depth: int = 10
    score_buckets: int = 4
    prior_accepts: float = 1.0
    prior_trials: float = 4.0
    #: standard errors added when choosing (:meth:`optimistic`)
    explore: float = 1.0
    accepts: torch.Tensor = field(init=False)
    trials: torch.Tensor = field(init=False)
    seeded: bool = field(default=False, init=False)  # by a calibration (:meth:`seed`)

    def __post_init__(self):
        shape = (len(SOURCE_NAMES), self.max_depth, self.score_buckets)
        self.accepts = torch.full(shape, self.prior_accepts, dtype=torch.float64)
        self.trials = torch.full(shape, self.prior_trials, dtype=torch.float64)

    def _bucket(self, source, depth, score) -> np.ndarray:
        """Host flat indices into the (source class, depth, score bucket) counts of nodes
        of any shape; source: the hybrid tree's tags (1 drafted, 2 retrieved, 3 both,
        context bit)."""
        return class_index(source, depth, score, self.max_depth, self.score_buckets)

    def _rates_at(self, buckets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The measured odds and trials at :meth:`_bucket`'s indices, on the host."""
        trials = self.trials.view(-1).numpy()[buckets]
        return self.accepts.view(-1).numpy()[buckets] / trials, trials

    def _optimistic_at(self, buckets: np.ndarray) -> np.ndarray:
        """:meth:`optimistic` at :meth:`_bucket`'s indices, on the host."""
        mean, trials = self._rates_at(buckets)
        error = np.sqrt(mean * (1 - mean) / (trials + 1))
        return np.minimum(mean + self.explore * error, 1.0)

    def conditional(self, source, depth, score) -> torch.Tensor:
        """P(accepted | parent accepted) for nodes of any shape (float64, on ``score``'s
        device)."""
        mean, _ = self._rates_at(self._bucket(source, depth, score))
        return torch.from_numpy(mean).to(score.device)

    def optimistic(self, source, depth, score) -> torch.Tensor:
        """:meth:`conditional` plus ``explore`` standard errors of its estimate (at most
        1): what the sizer chooses by. A class of nodes is only learned from when it is
        verified, and a class that was never verified sits at the prior; on a device
        where every token costs, the prior alone would keep it unverified for ever (a
        copy chain's second token after a long match, say, whose real odds are above
        0.9). The margin shrinks as the class is tried, so what is well measured is
        chosen by its measured odds."""
        optimistic = self._optimistic_at(self._bucket(source, depth, score))
        return torch.from_numpy(optimistic).to(score.device)

    def observe(self, source, depth, score, parent_accepted, accepted) -> None:
        """Learn from one verified batch: every node whose parent was on the accepted
        path is a trial; it succeeds when the node is on the path too."""
        trial = host_array(parent_accepted).astype(bool)
        flat = self._bucket(source, depth, score)[trial]
        accepted = host_array(accepted)[trial].astype(np.float64)
        # one count per class (a bincount), added to the tensors' flat host views (view,
        # not reshape: a copy would silently drop the counts)
        trials, accepts = self.trials.view(-1).numpy(), self.accepts.view(-1).numpy()
        trials += np.bincount(flat, minlength=trials.size)
        accepts += np.bincount(flat, weights=accepted, minlength=accepts.size)

    def optimistic_lookup(self):
        """A function from a class's flat index (:meth:`class_of`) to its
        :meth:`optimistic` odds, in Python over the counts as they are now: the same
        arithmetic as :meth:`_optimistic_at`, in the same order."""
        accepts, trials = self.accepts.view(-1).tolist(), self.trials.view(-1).tolist()
        explore = self.explore

        def optimistic(index: int) -> float:
            mean = accepts[index] / trials[index]
            error = math.sqrt(mean * (1 - mean) / (trials[index] + 1))
            return min(mean + explore * error, 1.0)
        return optimistic

    def class_of(self, tag: int, depth: int, score: float) -> int:
        """:meth:`_bucket` of one node, in Python (a chain's few nodes cost less this way
        than as arrays)."""
        depth = min(max(depth, 1), self.max_depth) - 1
        bucket = min(int(min(max(score, 0.0), 1.0) * self.score_buckets),
                     self.score_buckets - 1)
        return (_SOURCE_CLASS_OF_TAG_LIST[tag] * self.max_depth + depth) \
            * self.score_buckets + bucket

    def observe_chains(self, chains) -> int:
        """:meth:`observe` for chains given as host lists: per chain, the tags of its nodes
        after the root, their scores (None: unknown), how many were accepted and how many
        of the first were learned from already (skipped). Node ``j`` (depth ``j``) was a
        trial when its parent was accepted (``j <= accepted + 1``) and succeeded when
        ``j <= accepted``. Returns the trials counted."""
        tried: dict[int, list[float]] = {}  # class: [trials, accepts]
        for tags, scores, accepted, skipped in chains:
            for depth in range(skipped + 1, min(accepted + 1, len(tags)) + 1):
                score = UNKNOWN_SCORE if scores is None else scores[depth - 1]
                counts = tried.setdefault(self.class_of(tags[depth - 1], depth, score),
                                          [0.0, 0.0])
                counts[0] += 1.0
                counts[1] += depth <= accepted
        # each class's totals added once, as :meth:`observe`'s bincount does: on counts
        # seeded with fractions, adding one at a time would round differently
        trials, accepts = self.trials.view(-1).numpy(), self.accepts.view(-1).numpy()
        for index, (tried_here, accepted_here) in tried.items():
            trials[index] += tried_here
            accepts[index] += accepted_here
        return int(sum(counts[0] for counts in tried.values()))

    def seed(self, measured, evidence_trials: float = CALIBRATION_EVIDENCE_TRIALS) -> None:
        """Add what a calibration run measured (``measured``:
        :class:`~vllm_graft.core.calibration.AcceptanceTally`, trials and accepts per
        source, depth and score bucket) to the prior. Each (source, depth, bucket)
        weighs at most ``evidence_trials`` trials at its measured rate: the calibration
        ran other prompts, so a few dozen of serving's own trials should outweigh it;
        until then a cold model chooses by measured odds, not by the prior alone."""
        if measured.score_buckets != self.score_buckets:
            raise ValueError(f"calibration field 'acceptance.score_buckets' is "
                             f"{measured.score_buckets}, but the acceptance model has "
                             f"{self.score_buckets} score buckets; recalibrate")
        trials, accepts = self.trials.numpy(), self.accepts.numpy()
        for name, counts in measured.sources.items():
            source = SOURCE_NAMES.index(name)
            for depth, (tried, accepted) in enumerate(zip(counts.trials, counts.accepts)):
                depth = min(depth, self.max_depth - 1)
                tried, accepted = np.asarray(tried, float), np.asarray(accepted, float)
                weight = np.minimum(tried, evidence_trials)
                trials[source, depth] += weight
                accepts[source, depth] += weight * accepted / np.maximum(tried, 1.0)
        self.seeded = True

    def learned(self):
        """What this model counted beyond its prior, as a calibration tally
        (:class:`~vllm_graft.core.calibration.AcceptanceTally`) that :meth:`seed` reads:
        per source, the depths up to its deepest tried one. Only for a model that was
        not seeded itself (its counts above the prior are whole trials), so that a
        calibration run can hand what serving's online model learned to the next
        engine's, e.g. the copy chains' odds, which no recorded tree holds."""
        from vllm_graft.core.calibration import AcceptanceTally

        if self.seeded:
            raise ValueError("AcceptanceModel.learned: this model was seeded by a "
                             "calibration; its counts are not all its own trials")
        trials = np.rint(self.trials.numpy() - self.prior_trials).astype(np.int64)
        accepts = np.rint(self.accepts.numpy() - self.prior_accepts).astype(np.int64)
        return AcceptanceTally.of_counts(trials, accepts)


#: :func:`source_classes` of every tag value (bits 1, 2, 4 and 8), read with one index
_SOURCE_CLASS_OF_TAG = np.array(
    [SOURCE_NAMES.index("context") if tag & SOURCE_CONTEXT else min(max(tag, 1), 3) - 1
     for tag in range(2 * SOURCE_CONTEXT)], dtype=np.int64)
_SOURCE_CLASS_OF_TAG_LIST = _SOURCE_CLASS_OF_TAG.tolist()


# np.clip is avoided below: on arrays of a few dozen entries its Python wrapper costs
# several times what np.minimum / np.maximum do, and these run in every chain step
def source_classes(source) -> np.ndarray:
    """Index into :data:`SOURCE_NAMES` of nodes tagged ``source`` (the hybrid tree's tags:
    1 drafted, 2 retrieved, 3 both, context bit; a copied node is ``context``)."""
    return _SOURCE_CLASS_OF_TAG[host_array(source).astype(np.intp)]


def score_buckets_of(score, buckets: int) -> np.ndarray:
    """Which of ``buckets`` even buckets of [0, 1] each score falls in (host array)."""
    score = np.minimum(np.maximum(host_array(score).astype(np.float64), 0.0), 1.0)
    return np.minimum((score * buckets).astype(np.int64), buckets - 1)


def class_index(source, depth, score, max_depth: int, buckets: int) -> np.ndarray:
    """Flat index into ``[len(SOURCE_NAMES), max_depth, buckets]`` counts of nodes of any
    shape: source class, depth (1 to ``max_depth``; deeper nodes share the last) and score
    bucket (:func:`score_buckets_of`)."""
    depth = np.minimum(np.maximum(host_array(depth).astype(np.int64), 1), max_depth) - 1
    return ((source_classes(source) * max_depth + depth) * buckets
            + score_buckets_of(score, buckets))


def host_array(values) -> np.ndarray:
    """A tensor (any device) or array as a host numpy array (a view for CPU tensors)."""
    if isinstance(values, torch.Tensor):
        if values.device.type == "cpu" and not values.requires_grad:
            return values.numpy()  # one call: detach() and cpu() are dispatches too
        return values.detach().cpu().numpy()
    return np.asarray(values)


def context_scores(source: torch.Tensor, request_scores: torch.Tensor,
                   others: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, N]`` scores of a tree's nodes: each context-copied node gets its request's
    match score (``request_scores`` ``[B]``, :func:`vllm_graft.core.context.match_score`),
    every other node its score in ``others`` (``[B, N]``; None: :data:`UNKNOWN_SCORE`)."""
    copied = (source.long() & SOURCE_CONTEXT) > 0
    if others is None:
        others = torch.full(source.shape, UNKNOWN_SCORE, device=source.device)
    return torch.where(copied, request_scores.to(torch.float32).unsqueeze(1).to(source.device),
                       others.to(torch.float32))


# The sizer's arithmetic runs on the host in numpy: its arrays are a batch of trees of a
# few dozen nodes, where each tensor op's dispatch costs more than its arithmetic, and it
# runs in every speculative step. The tensor functions below convert at their edges.
def path_probability(parents: torch.Tensor, depths: torch.Tensor, valid: torch.Tensor,
                     conditional: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` probability that each node lies on the accepted path: the product of
    the conditional acceptance probabilities along its ancestors (root, row 0: 1;
    invalid rows: 0). Nodes come parents first."""
    return torch.from_numpy(_path_probability(
        host_array(parents), host_array(depths), host_array(valid),
        host_array(conditional))).to(conditional.device)


def _path_probability(parents: np.ndarray, depths: np.ndarray, valid: np.ndarray,
                      conditional: np.ndarray) -> np.ndarray:
    prob = np.zeros(conditional.shape, dtype=np.float64)
    prob[:, 0] = 1.0
    top = int(depths.max()) if depths.size else 0
    parent_index = np.maximum(parents, 0)
    request = np.arange(prob.shape[0])[:, None]
    for depth in range(1, top + 1):
        level = valid & (depths == depth)
        parent_prob = prob[request, parent_index]
        prob = np.where(level, parent_prob * conditional, prob)
    return np.where(valid, prob, 0.0)


# ---- choice -----------------------------------------------------------------------------
@dataclass
class Choice:
    #: [B, N] bool: nodes to verify (row 0, the root, always kept); None for host
    #: chains, which keep their first ``nodes_per_request`` nodes
    keep: torch.Tensor | None
    nodes_per_request: torch.Tensor  # [B], on the host
    expected_tokens: float  # emitted tokens per step predicted for the choice
    step_ms: float  # predicted step time
    #: each chosen request's predicted tokens (its root and its nodes' path
    #: probabilities), in ``nodes_per_request``'s order; kept by host chains' choices
    request_tokens: list[float] | None = None

    def step_tokens(self, batch: int) -> float:
        """Tokens the whole step of ``batch`` requests is predicted to emit: the chosen
        requests' expected tokens and one for each other request (decoded plainly)."""
        return self.expected_tokens + batch - self.nodes_per_request.numel()

    def tokens_by_request(self, batch: int) -> list[float]:
        """:meth:`step_tokens` split over the step's ``batch`` requests: the chosen
        requests' own and one for each other. What the throughput guard will credit
        the step with is its :meth:`ThroughputGuard.credited_tokens` of these."""
        if self.request_tokens is None:
            raise ValueError("this choice kept no tokens per request (a tree's)")
        return self.request_tokens + [1.0] * (batch - len(self.request_tokens))


def choose_nodes(path_prob: torch.Tensor, valid: torch.Tensor, cost: CostModel,
                 max_nodes: int | None = None, mode: StepMode = StepMode.TREE) -> Choice:
    """The nodes whose verification maximises expected emitted tokens per millisecond
    for the whole batch (module doc). ``path_prob``/``valid``: ``[B, N]``, row 0 the root;
    ``max_nodes`` caps the total; ``mode``: the kind of step, whose costs apply."""
    return _choose_nodes(host_array(path_prob), host_array(valid), cost, max_nodes, mode,
                         path_prob.device)


def _choose_nodes(path_prob: np.ndarray, valid: np.ndarray, cost: CostModel,
                  max_nodes: int | None, mode: StepMode, device) -> Choice:
    batch, rows = path_prob.shape
    candidate = valid.copy()
    candidate[:, 0] = False
    flat = np.where(candidate, path_prob, -1.0).reshape(-1)
    # stable descending sort: among equal probabilities, parents (earlier rows) first
    order = np.argsort(-flat, kind="stable")
    available = int(candidate.sum())
    if max_nodes is not None:
        available = min(available, max_nodes)
    best, expected, step_ms = _best_count(flat[order[:available]], batch, cost, mode)
    keep = np.zeros(batch * rows, dtype=bool)
    keep[order[:best]] = True
    keep = keep.reshape(batch, rows)
    keep[:, 0] = True
    keep_tensor = torch.from_numpy(keep).to(device)
    return Choice(keep=keep_tensor, nodes_per_request=torch.from_numpy(keep[:, 1:].sum(1)),
                  expected_tokens=expected, step_ms=step_ms)


#: candidates up to which the sizer counts in Python (a chain step's few), not numpy
SMALL_CHOICE = 32


def _best_count(ordered_prob, batch: int, cost: CostModel, mode: StepMode
                ) -> tuple[int, float, float]:
    """How many of the candidate nodes, best first (``ordered_prob``: their path
    probabilities in that order), to verify for the most expected tokens per ms, with
    the expected tokens and step time of that choice."""
    if len(ordered_prob) <= SMALL_CHOICE:
        return _best_count_small(ordered_prob, batch, cost, mode)
    return _best_count_arrays(ordered_prob, batch, cost, mode)


def _best_count_arrays(ordered_prob, batch: int, cost: CostModel, mode: StepMode
                       ) -> tuple[int, float, float]:
    expected = batch + np.concatenate(([0.0], np.cumsum(ordered_prob, dtype=np.float64)))
    time = cost._step_ms(batch, np.arange(len(ordered_prob) + 1, dtype=np.float64), mode)
    best = int(np.argmax(expected / time))
    return best, float(expected[best]), float(time[best])


def _best_count_small(ordered_prob, batch: int, cost: CostModel, mode: StepMode
                      ) -> tuple[int, float, float]:
    """:func:`_best_count_arrays` in Python: the same arithmetic in the same order, so
    the same choice to the last bit, without numpy's cost per call."""
    plain, fixed, per_node = cost.other_costs(batch, mode)
    verify_ms = cost._verify_point_ms(batch)
    best, best_rate, best_expected, best_ms = 0, -math.inf, 0.0, 0.0
    total = 0.0
    for nodes in range(len(ordered_prob) + 1):
        if nodes:
            total += float(ordered_prob[nodes - 1])
        expected = batch + total
        step_ms = verify_ms(batch + nodes) + (fixed + per_node * nodes if nodes > 0 else plain)
        rate = expected / step_ms
        if rate > best_rate:
            best, best_rate, best_expected, best_ms = nodes, rate, expected, step_ms
    return best, best_expected, best_ms


# ---- measured throughput ------------------------------------------------------------------
#: the share of its weight below which a faded guard record is dropped
#: (:class:`ThroughputGuard`): far above where its sums lose precision or underflow
FORGOTTEN = 1e-30


@dataclass
class _ModeStats:
    """Discounted sums over one mode's steps at one batch size: steps (weight), emitted
    tokens, their squares, seconds; ``step`` is the guard step they were last decayed to."""

    weight: float = 0.0
    tokens: float = 0.0
    tokens_sq: float = 0.0
    seconds: float = 0.0
    step: int = 0

    def decayed(self, step: int, keep: float) -> _ModeStats:
        factor = keep ** max(step - self.step, 0)
        return _ModeStats(self.weight * factor, self.tokens * factor,
                          self.tokens_sq * factor, self.seconds * factor, step)


@dataclass
class ThroughputGuard:
    """Run each step in the mode measured fastest (emitted tokens per second).

    The cost and acceptance models predict; this measures. Whole decoding steps are
    timed in every mode, per batch size (power-of-two buckets): a mode's rate is its
    emitted tokens over its seconds, both sums over its steps discounted by one
    ``window``-th per engine step, so what a mode measured fades while it does not run.

    Choosing is a discounted upper-confidence-bound bandit: each batch size first runs
    ``probe_steps`` steps of every mode, then each step the mode whose rate could still
    be highest, its rate plus ``confidence`` standard errors of its tokens per step
    (at least ``noise_floor`` of their mean, so even plain decoding's constant yield
    is re-checked). A speculative mode's yield varies from one token to a whole chain
    per step: a few lucky or unlucky steps move its bound, not the decision. A mode
    that measured slower runs again only once its old measurements have faded enough
    that it might have become faster (a change of text, load or context length), so a
    much slower mode costs a step now and then, and a mode that was close keeps being
    compared. Steps with prefill chunks are not measured (their time is not the decoding
    cost of any mode).

    Plain decoding, the rate every other mode must beat, is measured again whenever its
    last step at the batch size is more than ``plain_refresh`` guard steps old. Modes
    are measured at different times and this machine's speed moves; a plain rate
    measured while the engine was cold or the host busy would otherwise stand, slow and
    stale, while a speculative mode measured later looks faster and keeps running (a
    plain step's bound grows back only as its weight fades: dozens of steps). A plain
    step never costs speed against plain decoding; where a speculative mode really is
    faster it costs one step in ``plain_refresh + 1`` of its gain.

    A probe of a mode measured slower costs what it loses against the fastest mode:
    its step time over the fastest's, times the share of the fastest's rate it lacks.
    A tree step at batch 32 takes four plain steps at half their rate: one probe loses
    two plain steps. So a slower mode runs again only once the steps since its last run
    make that loss at most ``probe_share`` of them (a tree probe at batch 32 every 400
    steps, a chain 16 % slower at twice a plain step's time every 60), however wide its
    bound has grown. Plain refreshes are not held back: they are the drift check.
    The first probes at a new batch size follow the same rule, priced at the nearest
    batch size that measured the mode: plain decoding runs first, and a mode that lost
    there runs once the steps since this batch size was first seen pay for that loss.
    A batch draining to its end passes through every smaller batch size within a few
    steps each, and a tree probe at 15 requests, with the drafter catching up on every
    position it missed, cost 8 plain steps there; a mode that was faster (or a batch
    size with no measured neighbour) is probed at once.

    A record that has faded to under :data:`FORGOTTEN` of its weight (about 6,900 steps
    at the default window) is dropped, and the batch size counts as first seen again:
    its modes are measured afresh. Left in place, its sums would
    go on shrinking until they underflow to zero; a plain record at zero has no rate,
    no refresh runs for a mode without one, and its first probe is long past: a batch
    size served again after some 75,000 steps at others (an hour of a busy server)
    would have run trees at every step from then on, at a third of plain's rate.

    A step chosen to measure (a first probe, a plain refresh) says so in ``measuring``:
    nothing may run another mode in its place (:class:`ChainScout` looks only at the
    plain steps the guard prefers), or that measurement never happens and is asked for
    again at every step.

    A step that took more than ``outlier_steps`` times its mode's mean step at the batch
    size counts as that long. On a CPU the first step at a new query length sets up its
    kernels (oneDNN primitives: a copy-chain step at batch 8 took 690 ms where its mode's
    steps took 130), and a page-fault storm or another process can stall any step. Such
    a step is no cost of its mode, yet it falls mostly on the modes whose query lengths
    vary (chains and trees; plain decoding's shape is fixed per batch size). Counted
    whole, one such step among a dozen cuts the mode's rate by a third, and holds it down
    for about ``window`` steps, in which a mode measured slower runs only as a probe: a
    few unlucky steps early in an engine's life would decide its choice for a long
    while. A mode's regular dear steps (a tree step feeding the drafter what it missed)
    stay well inside the cap.

    A step at several requests counts as many tokens as its median request emitted,
    times the requests (:meth:`credited_tokens`), not their sum. Speculation's gain is
    uneven over a batch: the requests whose text matches (a copy, a recited fact) accept
    whole chains while the others emit one token, and the batch pays every chain's
    verification. Tokens gained by a few requests are worth less to the batch than
    their count: a closed batch ends with its slowest request, so the leaders' extra
    tokens end in steps of a shrinking batch at almost a full step's cost; where slots
    refill, requests that finish at different steps each bring a new prompt's prefill
    into its own step, which costs more per token than one prefill of many prompts.
    Measured on a 2-core CPU at batch 8 (copy chains alone, SmolLM2-135M, 8 prompts of
    64 tokens, against plain decoding's steps in another engine the same hour): on
    mtbench chain steps emitted 1.02x plain decoding's tokens per second by their sum
    and 0.94x by the median request's; the batch took 61 steps against plain's 63, each
    dearer, and lost to plain end to end. On humaneval (1.13x by sum, 1.07x by median)
    it took 49 steps. Crediting the median request speculates where the typical
    request gains; at one request it is that request's tokens, as before.
    ``credit_median`` off credits the sum.

    A speculative step at several requests also counts ``batch_charge`` more than the
    time it took. What speculation costs a batch besides its steps falls outside any
    step: requests drift apart, so a closed batch waits for its slowest, and where slots
    refill, each finished request brings a prompt's prefill into a step of its own.
    The median request's credit sees part of that, not all. Measured on a 2-core CPU at
    batch 32 (SmolLM2-135M, humaneval, 64 tokens a request): in one engine the guard ran
    copy chains in 29 of 49 steps, whose credited rate was 1.04x plain decoding's; in
    another, 16 chain steps of 78 ms (its plain steps took 46) saved one decoding step
    of 63 and cost about 0.5 s. The benchmark's fresh engines ran at 0.89x plain in each
    of five rounds. A mode that does not beat plain decoding by more than the charge at
    several requests is not worth the risk; at one request nothing drifts and nothing is
    charged.

    What copy chains measured is a property of the text they ran on: whether it copies
    its context. When requests join the batch (:meth:`requests_joined`), the chains'
    record of other text counts as at most ``text_steps`` steps for a batch whose every
    request is new (geometrically between its weight and that for fewer), so the new
    text's own chain steps decide within a few steps. Measured on a 2-core CPU at batch
    8 (SmolLM2-135M, 64 tokens a request): an engine that ran chains in 40 of 50 steps
    of humaneval, where they paid, went on to run them in 58 of 62 steps of the chat
    prompts that followed, where they lost; the record of one batch outweighed the next
    batch's evidence for about as long as a batch lasts. A few steps' worth stays, not
    less: then the first chain step on the new text does not decide alone (a step that
    meets a new query length sets up its kernels on this CPU, and one slow step, capped
    at three mean steps, would otherwise make chains measure slow and hold their next
    probe back for hundreds of steps).
    Plain decoding's and trees' records stay: their step's cost does not depend on the
    text, and a drafter's odds depend more on the models than on it.

    The non-tree modes do not run the drafter; the adapter feeds it the positions it
    missed just before the next tree step, so its cache stays complete.

    What the adapter spends outside tree steps only so that trees can run (the drafter
    reading a new batch's prompts, keeping the rows of the requests it follows while
    another mode decodes them) is charged to trees (:meth:`charge`): their record's
    seconds grow, its steps and tokens do not, so their rate falls and a probe of them
    is priced higher. Counted in the steps where it fell, that time slowed whichever
    mode ran them (mostly plain decoding), and the probe rule priced a tree probe at its
    step alone. Measured on a 2-core CPU at batch 32 (SmolLM2-135M, 64 tokens a request, 24
    runs of 32 requests in one engine): the drafter followed six batches, its forwards
    taking 0.1-0.27 s of each, for three tree probes (four tree steps); those six runs
    lost 2.1 s of the engine's 234 (0.9 %) against the same engine decoding plainly,
    where the probe rule allows 0.5 %.
    """

    modes: tuple[StepMode, ...] = (StepMode.TREE, StepMode.PLAIN)
    probe_steps: int = 1
    window: float = 100.0
    confidence: float = 2.0
    noise_floor: float = 0.2
    plain_refresh: int = 16  # 0: never forced
    probe_share: float | None = 0.005  # None: a slower mode runs whenever its bound wins
    outlier_steps: float | None = 3.0  # None: every step counts as long as it took
    credit_median: bool = True  # False: a step counts its requests' summed tokens
    batch_charge: float = 0.1  # a speculative step at several requests counts 1.1x its time
    text_steps: float = 2.0  # the most steps the chains' record weighs for a new batch
    scout_new_batches: bool = True  # a scouted new batch of several drops that record
    stats: dict[tuple[int, StepMode], _ModeStats] = field(default_factory=dict)
    measured: dict[tuple[int, StepMode], int] = field(default_factory=dict)
    first_seen: dict[int, int] = field(default_factory=dict)  # bucket: guard step
    steps: int = 0
    measuring: bool = False  # the last choice was a first probe or a plain refresh

    def __post_init__(self):
        if self.probe_steps < 1 or self.window <= 1.0:
            raise ValueError(f"ThroughputGuard needs probe_steps >= 1 and window > 1, got "
                             f"{self.probe_steps}, {self.window}")
        if self.confidence < 0 or self.noise_floor < 0 or self.plain_refresh < 0:
            raise ValueError(f"ThroughputGuard confidence, noise_floor and plain_refresh "
                             f"must be >= 0, got {self.confidence}, {self.noise_floor}, "
                             f"{self.plain_refresh}")
        if self.probe_share is not None and self.probe_share <= 0:
            raise ValueError(f"ThroughputGuard probe_share must be > 0 or None, got "
                             f"{self.probe_share}")
        if self.batch_charge < 0:
            raise ValueError(f"ThroughputGuard batch_charge must be >= 0, got "
                             f"{self.batch_charge}")
        if self.text_steps < 1.0:  # a step's weight or more: the outlier cap holds
            raise ValueError(f"ThroughputGuard text_steps must be >= 1, got "
                             f"{self.text_steps}")
        if self.outlier_steps is not None and self.outlier_steps <= 1:
            raise ValueError(f"ThroughputGuard outlier_steps must be > 1 or None, got "
                             f"{self.outlier_steps}")
        if not self.modes or len(set(self.modes)) != len(self.modes):
            raise ValueError(f"ThroughputGuard needs distinct modes, got {self.modes}")

    def _stats(self, batch: int, mode: StepMode) -> _ModeStats | None:
        stats = self.stats.get((batch_bucket(batch), mode))
        return None if stats is None else stats.decayed(self.steps, 1.0 - 1.0 / self.window)

    def rate_of(self, batch: int, mode: StepMode) -> float | None:
        """Measured tokens per second of ``mode`` at ``batch`` (None: not measured)."""
        stats = self._stats(batch, mode)
        return None if stats is None or stats.seconds <= 0 else stats.tokens / stats.seconds

    def bound_of(self, batch: int, mode: StepMode) -> float | None:
        """The rate ``mode`` could have at ``batch``: its upper confidence bound."""
        stats = self._stats(batch, mode)
        if stats is None or stats.seconds <= 0 or stats.weight <= 0:
            return None
        mean = stats.tokens / stats.weight
        variance = max(stats.tokens_sq / stats.weight - mean * mean,
                       (self.noise_floor * mean) ** 2)
        return (stats.tokens + self.confidence * math.sqrt(variance * stats.weight)) \
            / stats.seconds

    @property
    def rates(self) -> dict[tuple[int, StepMode], float]:
        """Measured tokens per second per (batch bucket, mode)."""
        return {(batch, mode): self.rate_of(batch, mode) for batch, mode in self.stats}

    def preferred(self, batch: int) -> StepMode | None:
        """The mode measured fastest at ``batch``; None until every mode was measured."""
        rates = [self.rate_of(batch, mode) for mode in self.modes]
        if any(rate is None for rate in rates):
            return None
        return self.modes[max(range(len(rates)), key=lambda i: rates[i])]

    def within_reach(self, batch: int, mode: StepMode, share: float = 0.8) -> bool:
        """Whether ``mode`` may still be worth preparing for at ``batch``: it is one of
        the guard's modes and the rate it could have (its upper bound, which widens as
        its measurements fade) is at least ``share`` of the fastest mode's measured
        rate there, of the modes measured there (a mode not measured yet is no reason
        to prepare for another: a fresh engine's warm-up measured trees and plain
        decoding at batch 32, not chains, and the drafter read every prompt of the
        first batches there, 2 % of their time, where trees ran at a fifth of plain
        decoding's rate). A batch size where ``mode`` or every other mode was not
        measured is judged by a neighbouring one (half or twice) that was: a batch of 32
        whose prompts arrive in two prefill chunks is seen at 16 requests first, and the
        drafter followed every one of them, reading each prompt, where trees at 32 were
        far too slow to run. True where neither neighbour was measured either.

        A mode measured slower is also in reach only once its next probe is due within
        ``window`` steps (:meth:`_probe_due`): preparing for a mode that will not run
        for hundreds of steps is pure cost. Measured on a 2-core CPU at batch 8: once
        a tree probe's record had faded (after about 400 steps), the bound put trees in
        reach, and the drafter read every prompt and caught up on every step, 2-4 % of
        each run, while the probe rule held the next tree step 700 steps away."""
        if mode not in self.modes:
            return False
        bucket = batch_bucket(batch)
        neighbours = [size for size in (bucket // 2, 2 * bucket) if size >= 1]
        for size in [bucket] + nearest_buckets(neighbours, bucket):
            rates = {m: rate for m in self.modes
                     if (rate := self.rate_of(size, m)) is not None}
            if mode in rates and len(rates) >= 2:
                fastest = max(rates, key=rates.get)
                return (self.bound_of(size, mode) >= share * rates[fastest]
                        and (mode is fastest or self._probe_due(size, mode, fastest,
                                                                lead=self.window)))
        return True

    def choose(self, batch: int, unavailable: tuple[StepMode, ...] = ()) -> StepMode:
        """The mode of the next step at ``batch`` requests, among the guard's modes
        less ``unavailable`` ones (a mode no request of the batch can run this step:
        its step would be another mode's and measure nothing of its own)."""
        self.steps += 1
        self.measuring = True
        bucket = batch_bucket(batch)
        self._forget_faded(bucket)
        self.first_seen.setdefault(bucket, self.steps)
        modes = [mode for mode in self.modes if mode not in unavailable] or [StepMode.PLAIN]
        for mode in modes:  # first measure every mode (as far as the first probe pays)
            if self.measured.get((bucket, mode), 0) < self.probe_steps \
                    and self._first_probe_due(bucket, mode):
                return mode
        modes = [mode for mode in modes if self.rate_of(batch, mode) is not None]
        if not modes:  # every mode's first probe waits (a guard without plain decoding)
            return self.modes[0]
        fastest = max(modes, key=lambda mode: self.rate_of(batch, mode))
        due = [mode for mode in modes
               if mode is fastest or self._probe_due(batch, mode, fastest)]
        bounds = [self.bound_of(batch, mode) for mode in due]
        best = due[max(range(len(bounds)), key=lambda i: bounds[i])]
        plain = self.stats.get((bucket, StepMode.PLAIN))
        if (best is not StepMode.PLAIN and StepMode.PLAIN in modes and self.plain_refresh
                and plain is not None and self.steps - plain.step > self.plain_refresh):
            return StepMode.PLAIN  # the baseline's rate is stale: measure it again
        self.measuring = False
        return best

    def _forget_faded(self, bucket: int) -> None:
        """Drop the records at ``bucket`` that faded to under :data:`FORGOTTEN` of their
        weight; with none left, the bucket is seen for the first time now (class doc)."""
        keep, forgot = 1.0 - 1.0 / self.window, False
        for mode in self.modes:
            stats = self.stats.get((bucket, mode))
            if stats is not None and keep ** max(self.steps - stats.step, 0) < FORGOTTEN:
                del self.stats[bucket, mode]
                self.measured.pop((bucket, mode), None)
                forgot = True
        if forgot and not any((bucket, mode) in self.stats for mode in self.modes):
            self.first_seen[bucket] = self.steps

    def _probe_due(self, batch: int, mode: StepMode, fastest: StepMode,
                   lead: float = 0.0) -> bool:
        """Whether ``mode``, measured slower than ``fastest``, may run again (class doc),
        or will within ``lead`` more steps."""
        if self.probe_share is None:
            return True
        since = self.steps - self.stats[(batch_bucket(batch), mode)].step + lead
        return since * self.probe_share >= self._probe_loss(batch, mode, fastest)

    def _probe_loss(self, batch: int, mode: StepMode, fastest: StepMode) -> float:
        """What one step of ``mode`` at ``batch`` loses against ``fastest``, in steps of
        ``fastest``: its step time over the fastest's, times the share of the fastest's
        rate it lacks (both measured there)."""
        own, best = self._stats(batch, mode), self._stats(batch, fastest)
        if own.weight <= 0 or best.weight <= 0 or best.tokens <= 0 or own.seconds <= 0:
            return 0.0
        step_ratio = (own.seconds / own.weight) / (best.seconds / best.weight)
        rate_ratio = (own.tokens / own.seconds) / (best.tokens / best.seconds)
        return step_ratio * max(0.0, 1.0 - rate_ratio)

    def _first_probe_due(self, bucket: int, mode: StepMode) -> bool:
        """Whether ``mode`` may run its first steps at ``bucket`` (class doc): plain
        decoding always; another mode once the steps since the bucket was first seen pay
        for what it lost at the nearest bucket that measured it beside another mode, as
        a re-probe would (at once where no bucket did)."""
        if self.probe_share is None or mode is StepMode.PLAIN:
            return True
        measured = {size for size, kind in self.stats if kind is mode and size != bucket}
        for size in nearest_buckets(measured, bucket):
            rated = [m for m in self.modes if self.rate_of(size, m) is not None]
            if len(rated) < 2:
                continue
            fastest = max(rated, key=lambda m: self.rate_of(size, m))
            loss = self._probe_loss(size, mode, fastest)
            return (self.steps - self.first_seen[bucket]) * self.probe_share >= loss
        return True

    def requests_joined(self, joined: int, batch: int, scouted: bool = False) -> None:
        """``joined`` of the ``batch`` requests of the coming steps are new: the copy
        chains' record, measured on text they replace, shrinks by ``text_steps`` over
        its weight, to the power of the new share (class doc). Its sums shrink alike:
        its rate, mean step and last step stay, so a chain measured slower is not
        probed sooner, though its confidence bound widens with the lost weight.

        Where a :class:`ChainScout` looks at new batches (``scouted``) and at least half
        of a batch of several requests is new, the record is dropped instead (with
        ``scout_new_batches``): chains run on the new text once the scout, which reads
        it, finds them worth a step, and from then on the guard measures them as ever.
        A record of faster chains on other text, weighing two steps, put the chains'
        bound above plain decoding's: the guard ran one to three chain steps at the
        start of each batch that did not copy, each at 1.4-1.9 plain steps at batch 32
        (measured on a 2-core CPU, SmolLM2-135M, chat after code). At one request the
        record shrinks as above: nothing there waits for a slower request."""
        if joined <= 0 or batch <= 0:
            return
        if scouted and self.scout_new_batches and batch >= 2 and mostly_new(joined, batch):
            for key in [key for key in self.stats if key[1] is StepMode.CHAIN]:
                del self.stats[key]
            return
        share = min(joined / batch, 1.0)
        for (bucket, mode), stats in self.stats.items():
            if mode is not StepMode.CHAIN:
                continue
            weight = self._stats(bucket, mode).weight
            if weight > self.text_steps:
                keep = (self.text_steps / weight) ** share
                self.stats[bucket, mode] = _ModeStats(
                    stats.weight * keep, stats.tokens * keep, stats.tokens_sq * keep,
                    stats.seconds * keep, stats.step)

    def counted_seconds(self, mode: StepMode, batch: int, seconds: float) -> float:
        """What a step of ``mode`` at ``batch`` that took ``seconds`` counts as: a
        speculative step at several requests ``batch_charge`` more, and at most
        ``outlier_steps`` times the mode's mean step there (class doc)."""
        if mode is not StepMode.PLAIN and batch >= 2:
            seconds *= 1.0 + self.batch_charge
        stats = self._stats(batch, mode)
        if self.outlier_steps is None or stats is None or stats.weight < 1.0:
            return seconds
        return min(seconds, self.outlier_steps * stats.seconds / stats.weight)

    def charge(self, mode: StepMode, batch: int, seconds: float) -> None:
        """Add ``seconds`` spent outside ``mode``'s steps only so that it can run, at
        ``batch`` requests, to its record there (class doc): its rate falls, its steps,
        tokens and the step it last ran stay (its next probe is priced higher, not
        reset). Nothing where ``mode`` has no record at that batch size yet: its first
        probe measures it."""
        key = (batch_bucket(batch), mode)
        stats = self.stats.get(key)
        if stats is None or not 0 < seconds < math.inf:
            return
        # the record is discounted lazily from its last step: add what is worth
        # ``seconds`` now (a record faded past any weight is left alone)
        factor = (1.0 - 1.0 / self.window) ** max(self.steps - stats.step, 0)
        if factor > 1e-200:
            self.stats[key] = replace(stats, seconds=stats.seconds + seconds / factor)

    def credited_tokens(self, row_tokens: list[int]) -> float:
        """What a step whose requests emitted ``row_tokens`` (one count per request)
        counts as: the median request's tokens times the requests (class doc); their
        sum with ``credit_median`` off."""
        if not self.credit_median or len(row_tokens) < 2:
            return float(sum(row_tokens))
        return float(statistics.median(row_tokens) * len(row_tokens))

    def observe(self, mode: StepMode, batch: int, tokens: float, seconds: float) -> None:
        """One decoding step (no prefill): ``tokens`` emitted by ``batch`` requests in
        ``seconds``, in the given mode, counted as :meth:`counted_seconds` says (a
        speculative step at several requests charged, a stall capped)."""
        if not 0 < seconds < math.inf or batch <= 0:  # a NaN would poison the record
            return
        key = (batch_bucket(batch), mode)
        seconds = self.counted_seconds(mode, batch, seconds)
        stats = self._stats(batch, mode) or _ModeStats(step=self.steps)
        self.stats[key] = _ModeStats(stats.weight + 1.0, stats.tokens + tokens,
                                     stats.tokens_sq + tokens * tokens,
                                     stats.seconds + seconds, self.steps)
        self.measured[key] = self.measured.get(key, 0) + 1


def copied_prefix(proposed, emitted) -> int:
    """How many of a chain's nodes verifying it would have accepted, read from the
    tokens decoding emitted at their positions instead: its nodes up to the first that
    is not the emitted token (``proposed``, ``emitted``: the nodes after the root and the
    tokens at the same positions). Where the nodes before one matched, the target saw
    the same context as a verification would, and its emitted token is a draw from the
    distribution acceptance samples there (its argmax when greedy), so these outcomes
    are distributed as a verification's: the acceptance model learns copied nodes from
    steps that verified none (:meth:`AcceptanceModel.observe_chains`: every node up to
    the first mismatch is a trial, the matched ones accepted)."""
    matched = 0
    while matched < len(proposed) and proposed[matched] == emitted[matched]:
        matched += 1
    return matched


class ChainScout:
    """While the throughput guard decodes plainly, a look now and then at the copy chains
    the batch's contexts offer, and a chain step when they promise to beat plain decoding.

    The guard is blind to the text: it knows what each mode measured over recent steps on
    whatever ran then. When the text changes (requests that edit their own context arrive
    where chat ran), chains may have become faster, but the guard runs a mode it measured
    slower only as often as its probe budget allows (a chain 16 % slower at twice a plain
    step's time: once in 60 steps at batch 32), and a batch of short requests may finish
    before that (code edits at batch 32 ran 62 of 65 steps plainly, where chains alone
    were 1.16x plain). The sizer does see the text: from the match lengths and the
    learned acceptance it predicts a chain step's emitted tokens, from the cost model its
    time. Those predictions are corrected by how they fared: measured over predicted
    tokens, and measured over predicted milliseconds, over recent chain steps (whatever
    ran them). Every ``every`` plain steps the scout builds the chains the step could
    verify, and the step runs them when the corrected prediction beats plain decoding's
    measured rate by ``margin``; while they keep promising, it looks again at every plain
    step the guard prefers (never at one it chose to measure: a plain refresh the scout
    replaced would be asked for again at every step, and plain decoding's rate, which
    the scout compares with, would never be measured again). The guard measures such a
    step like any chain step, so chains that really are faster take over through its own
    choice, and a prediction that fared badly shrinks its correction until it stops
    firing. Each look's chains also teach the acceptance model once decoding has emitted
    their positions (:func:`copied_prefix`), so its odds for copied nodes do not stay at
    the cold prior while no chain runs.

    The correction counts ``prior_steps`` steps that fared as predicted besides the
    measured ones: a chain step or two cannot silence the scout. The only chain step a
    fresh engine had run was the guard's first probe, in the warm-up, on chat (on
    8 requests, 8 tokens credited of 13.5 predicted, at a new query length's set-up
    cost): its correction of 0.42 alone decided that humaneval's first copies (53 tokens
    predicted in 76 ms, 2.5 times plain decoding's rate) did not beat plain decoding,
    and as the scout never fired, no chain step came to revise it: no chain ran in the
    engine's 190 steps of three datasets. Another engine, started alike, drew 0.49;
    the same look fired, and chains ran in 36 of humaneval's 53 steps. Measured on a
    2-core CPU at batch 8 (the traced engine's steps ran about a tenth slower than the
    other's); in the sweeps' rounds that started their engines in its order, budget auto
    ran no chain on humaneval in 5 of 5.

    A look builds and sizes the batch's chains: about 1 ms at batch 8 on a 2-core CPU,
    4 % of a plain step there, paid once in ``every`` plain steps. Where looks keep
    finding nothing (chat, where the guard rightly decodes plainly), each look that does
    not promise doubles the steps until the next, up to ``max_every``; one that promises
    keeps them at ``every`` at most, and so does new text: a request joining the batch
    (:meth:`text_changed`), which is when chains may have become worth it.

    A batch that is at least half new is looked at from its first plain step, each look
    that does not promise doubling the steps to the next (steps 1, 3, 7, 15, ...). New
    requests copy the most in their first steps, and a look after the first token sees
    matches one token long: humaneval's eight requests at batch 8 repeat their
    function's signature from the prompt around their seventh token, accepting whole
    chains for a few steps. Looking every ``every`` steps, a fresh engine's scout looked
    at step 1 (nothing promised) and next at step 17, after the copies; the guard's own
    choice reached them in some engines and not in others, and a batch whose first
    chains came late took 63-64 steps, as plain decoding, where one whose chains came
    in time took 51-54 (measured on a 2-core CPU, SmolLM2-135M, 64 tokens a request).
    A request joining a batch of older ones only brings the looks back to ``every``:
    under a steady stream of arrivals, a look at every step would cost 4 % of each.
    """

    def __init__(self, every: int = 8, margin: float = 0.05, window: float = 50.0,
                 max_every: int | None = None, prior_steps: float = 2.0):
        max_every = 8 * every if max_every is None else max_every
        if every < 1 or margin < 0 or window <= 1.0 or max_every < every or prior_steps < 0:
            raise ValueError(f"ChainScout needs every >= 1, margin >= 0, window > 1, "
                             f"max_every >= every and prior_steps >= 0, got {every}, "
                             f"{margin}, {window}, {max_every}, {prior_steps}")
        self.every, self.margin, self.keep = every, margin, 1.0 - 1.0 / window
        self.max_every, self.prior_steps = max_every, prior_steps
        # discounted sums over chain steps: their weight, predicted and measured tokens
        # and ms
        self.weight = 0.0
        self.predicted_tokens = self.tokens = 0.0
        self.predicted_ms = self.measured_ms = 0.0
        self.plain_steps = 0  # plain steps since the last look
        self.interval = every  # plain steps from one look to the next
        self.promised = False  # the last look found chains worth a step
        self.unpromised_interval = every  # where that look would have left the interval

    def due(self) -> bool:
        """Called once per step the guard decodes plainly: whether to look this step."""
        self.plain_steps += 1
        if self.promised or self.plain_steps >= self.interval:
            self.plain_steps = 0
            return True
        return False

    def text_changed(self, joined: int, batch: int) -> None:
        """``joined`` of the ``batch`` requests of the coming steps are new: look every
        ``every`` plain steps again, or, where at least half the batch is new, at the
        next plain step and back off from there (class doc)."""
        if mostly_new(joined, batch):
            self.interval, self.plain_steps = 1, 0
        else:
            self.interval = min(self.interval, self.every)

    def correction(self) -> float:
        """Measured over predicted rate of recent chain steps, with ``prior_steps``
        more steps that measured what was predicted of the mean one (class doc; 1 before
        any)."""
        if (self.weight <= 0 or self.predicted_tokens <= 0 or self.measured_ms <= 0
                or self.predicted_ms <= 0):
            return 1.0
        prior = self.prior_steps / self.weight  # the prior steps' share of the sums
        tokens = (self.tokens + prior * self.predicted_tokens) \
            / (self.predicted_tokens * (1.0 + prior))
        ms = (self.predicted_ms * (1.0 + prior)) / (self.measured_ms + prior * self.predicted_ms)
        return tokens * ms

    def promising(self, expected_tokens: float, step_ms: float,
                  plain_rate: float | None) -> bool:
        """Whether a chain step predicted to emit ``expected_tokens`` in ``step_ms`` beats
        ``plain_rate`` (tokens per second, measured) by the margin once corrected. The
        prediction is counted as the guard will credit the step (the runner passes the
        guard's :meth:`ThroughputGuard.credited_tokens` of each request's prediction)."""
        if plain_rate is None or step_ms <= 0:
            self.promised = False
        else:
            rate = 1e3 * expected_tokens / step_ms * self.correction()
            self.promised = rate >= (1.0 + self.margin) * plain_rate
        self.unpromised_interval = min(2 * self.interval, self.max_every)
        self.interval = min(self.interval, self.every) if self.promised \
            else self.unpromised_interval
        return self.promised

    def fired_step(self, gained: bool) -> None:
        """The chain step the last look fired was measured: ``gained`` whether it
        emitted more than a plain step would have (the guard's credit over one token a
        request). One that gained nothing counts as a look that did not promise: the
        next look waits twice as long as the one before. Kept at ``every`` at most, a
        scout that fired on chat looked again within 8 steps and fired again (two chain
        steps a run on mtbench and gsm8k at batch 8, each emitting a token a request
        at 1.2-1.6 plain steps' time, on a 2-core CPU)."""
        if self.promised and not gained:
            self.promised = False
            self.interval = self.unpromised_interval

    def observe(self, expected_tokens: float, step_ms: float, tokens: float,
                seconds: float) -> None:
        """A chain step the sizer predicted (``expected_tokens``, counted as in
        :meth:`promising`, in ``step_ms``) emitted ``tokens`` in ``seconds``: the tokens
        the guard credits it with
        (:meth:`ThroughputGuard.credited_tokens`), so that a chain step the scout fires
        promises what the guard will measure."""
        if step_ms <= 0 or seconds <= 0 or expected_tokens <= 0:
            return
        keep = self.keep
        self.weight = self.weight * keep + 1.0
        self.predicted_tokens = self.predicted_tokens * keep + expected_tokens
        self.tokens = self.tokens * keep + tokens
        self.predicted_ms = self.predicted_ms * keep + step_ms
        self.measured_ms = self.measured_ms * keep + seconds * 1e3


# ---- per step ---------------------------------------------------------------------------
class TreeSizer:
    """Cuts each step's hybrid trees to the nodes worth verifying, and learns from what
    the target accepted. The builder's ``budget`` becomes the cap; whatever is cut,
    acceptance on the remaining tree is as lossless as on any tree."""

    def __init__(self, cost: CostModel, acceptance: AcceptanceModel | None = None,
                 chain_acceptance: AcceptanceModel | None = None):
        """``acceptance``: the model of tree steps' nodes; ``chain_acceptance``: of copy
        chains' (default: a fresh model with ``acceptance``'s settings). They are
        different populations: a chain's retrieved nodes are the successor matrix's
        top-1 walk, a tree's mostly lower-ranked siblings of its template, accepted far
        less often; one model taught by both would cut chains to what trees taught it
        (at batch 8 on gsm8k, chains kept 3.7 nodes a step and no retrieved one, where
        chains alone kept 10.4 and had 2.4 retrieved tokens a step accepted)."""
        self.cost = cost
        self.acceptance = acceptance or AcceptanceModel()
        self.chain_acceptance = chain_acceptance or replace(self.acceptance)

    def acceptance_for(self, mode: StepMode) -> AcceptanceModel:
        """The acceptance model of ``mode``'s nodes."""
        return self.chain_acceptance if mode is StepMode.CHAIN else self.acceptance

    def _score(self, tree: HybridTree, score: torch.Tensor | None) -> np.ndarray:
        """``score``, else the tree's own (:attr:`HybridTree.score`), else unknown; on
        the host."""
        if score is None:
            score = tree.score
        if score is None:
            return np.full(tuple(tree.tokens.shape), UNKNOWN_SCORE)
        return host_array(score)

    def choose(self, tree: HybridTree, score: torch.Tensor | None = None,
               mode: StepMode = StepMode.TREE) -> Choice:
        """``mode``: the kind of step the tree is verified in (its costs apply). A copy-chain
        step cuts its host chains with :meth:`trim_chains`, which makes the same choice."""
        valid = host_array(tree.valid)
        model = self.acceptance_for(mode)
        conditional = model._optimistic_at(model._bucket(tree.source, tree.depths,
                                                         self._score(tree, score)))
        prob = _path_probability(host_array(tree.parents), host_array(tree.depths), valid,
                                 conditional)
        return _choose_nodes(prob, valid, self.cost, None, mode, tree.tokens.device)

    def trim_chains(self, chains: HostChains, mode: StepMode = StepMode.CHAIN
                    ) -> tuple[HostChains, Choice]:
        """:meth:`trim` of host chains (:class:`vllm_graft.core.chain.HostChains`): the
        same choice, its arithmetic over Python lists. Path probabilities fall along a
        chain, so the best nodes of the batch are a prefix of each chain; among equal
        probabilities the earlier request and the parent come first, as in
        :func:`choose_nodes`. The choice's ``keep`` is None: each chain keeps its first
        ``nodes_per_request`` nodes."""
        model = self.acceptance_for(mode)
        optimistic = model.optimistic_lookup()
        odds: dict[tuple, float] = {}  # a batch's chains share a few classes of nodes
        candidates = []  # (path probability, request), request-major, parents first
        for request, (tags, scores) in enumerate(zip(chains.source, chains.score)):
            prob = 1.0
            for depth in range(1, len(tags)):
                node = (tags[depth], depth, scores[depth])
                factor = odds.get(node)
                if factor is None:
                    factor = odds[node] = optimistic(model.class_of(*node))
                prob *= factor
                candidates.append((prob, request))
        candidates.sort(key=lambda candidate: -candidate[0])  # stable
        batch = len(chains.tokens)
        best, expected, step_ms = _best_count([prob for prob, _ in candidates], batch,
                                              self.cost, mode)
        nodes, tokens = [0] * batch, [1.0] * batch
        for prob, request in candidates[:best]:
            nodes[request] += 1
            tokens[request] += prob
        return chains.cut(nodes), Choice(keep=None, nodes_per_request=torch.tensor(nodes),
                                         expected_tokens=expected, step_ms=step_ms,
                                         request_tokens=tokens)

    def trim(self, tree: HybridTree, score: torch.Tensor | None = None,
             mode: StepMode = StepMode.TREE) -> tuple[HybridTree, Choice]:
        """The tree cut to :meth:`choose`'s nodes (a chain to its first ones; a chain
        step's own chains are cut by :meth:`trim_chains`)."""
        choice = self.choose(tree, score, mode)
        return trim_tree(tree, choice.keep), choice

    def observe_chains(self, chains, mode: StepMode = StepMode.CHAIN) -> None:
        """:meth:`observe` for verified chains as host lists
        (:meth:`AcceptanceModel.observe_chains`); ``mode``: the kind of step that
        verified them."""
        self.acceptance_for(mode).observe_chains(chains)

    def observe(self, tree: HybridTree, result: AcceptanceResult,
                score: torch.Tensor | None = None, mode: StepMode = StepMode.TREE) -> None:
        """Every verified node whose parent lay on the accepted path was a trial;
        ``mode``: the kind of step that verified the tree."""
        batch, rows = tree.tokens.shape
        on_path = np.zeros((batch, rows + 1), dtype=bool)
        on_path[:, 0] = True
        accepted_rows = host_array(result.accepted_rows)
        # fancy indexing, not numpy's *_along_axis helpers: their Python wrappers cost
        # more than the indexing on trees this small
        request = np.arange(batch)[:, None]
        on_path[request, np.where(accepted_rows >= 0, accepted_rows, rows)] = True
        on_path = on_path[:, :rows]
        parents = host_array(tree.parents)
        parent_on_path = on_path[request, np.maximum(parents, 0)]
        trial = host_array(tree.valid) & parent_on_path & (parents >= 0)
        self.acceptance_for(mode).observe(tree.source, tree.depths, self._score(tree, score),
                                          trial, on_path)
