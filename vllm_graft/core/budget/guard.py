"""The throughput guard: each step runs in the mode measured fastest
(:class:`ThroughputGuard`)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace

from pydantic import ValidationError

from vllm_graft.core.budget.cost import batch_bucket, nearest_buckets
from vllm_graft.core.config import StepMode, format_validation_error
from vllm_graft.core.guard_config import GuardConfig


def mostly_new(joined: int, batch: int) -> bool:
    """Whether a batch whose ``joined`` of ``batch`` requests just arrived is new text
    (at least half of it): the chain scout looks at its first steps, and the guard
    leaves its chains to the scout."""
    return 2 * joined >= batch

#: the share of its weight below which a faded guard record is dropped
#: (:class:`ThroughputGuard`): far above where its sums lose precision or underflow
FORGOTTEN = 1e-30
#: the modes whose records belong to the text they ran on: copy chains' gain (does it
#: copy its context?) and plain decoding's step (its context's length), which change with
#: a new batch of requests; trees' rate depends more on the models
TEXT_MODES = (StepMode.CHAIN, StepMode.PLAIN)
#: the steps plain decoding's record of other text weighs once a batch at least half new
#: joins where the chain scout reads new batches: its next step, measured on the new
#: text, outweighs it four to one
STALE_PLAIN_WEIGHT = 0.25
#: the throughput guard's tuning defaults (graft.guard)
_TUNING = GuardConfig()


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

    Per batch bucket, each mode's steps are timed (steps with prefill are not) and their
    tokens and seconds summed, discounted by one ``window``-th per step. A bucket first
    runs ``probe_steps`` of each mode (a mode that lost at the nearest bucket once the
    steps since pay for it); then the mode of highest upper bound (rate plus
    ``confidence`` standard errors of its tokens per step, at least ``noise_floor`` of
    their mean), a slower mode only once the steps since its last run pay
    ``probe_share`` for its loss, and plain decoding whenever its last step is over
    ``plain_refresh`` steps old. A step counts at most ``outlier_steps`` mean steps, a
    speculative one at several requests ``batch_charge`` more, and as many tokens as
    :meth:`credited_tokens` says (``credit``). New text shrinks the records of
    chains and plain decoding to ``text_steps`` (or drops the chains' and has plain
    decoding measured again: ``scout_new_batches``); a record faded under
    :data:`FORGOTTEN` is dropped. Why: docs/design-log.md#throughput-guard.
    """

    modes: tuple[StepMode, ...] = (StepMode.TREE, StepMode.PLAIN)
    # the tuning knobs: meaning, default and bounds are graft.guard's (GuardConfig)
    probe_steps: int = _TUNING.probe_steps
    window: float = _TUNING.window
    confidence: float = _TUNING.confidence
    noise_floor: float = _TUNING.noise_floor
    plain_refresh: int = _TUNING.plain_refresh
    probe_share: float | None = _TUNING.probe_share
    outlier_steps: float | None = _TUNING.outlier_steps
    credit: str = _TUNING.credit
    batch_charge: float = _TUNING.batch_charge
    text_steps: float = _TUNING.text_steps
    scout_new_batches: bool = _TUNING.scout_new_batches
    stats: dict[tuple[int, StepMode], _ModeStats] = field(default_factory=dict)
    measured: dict[tuple[int, StepMode], int] = field(default_factory=dict)
    first_seen: dict[int, int] = field(default_factory=dict)  # bucket: guard step
    # per request of the last step, its speculative gain since it joined: tokens
    # emitted beyond one a step (credit "progress")
    gains: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    measuring: bool = False  # the last choice was a first probe or a plain refresh

    def __post_init__(self):
        try:
            GuardConfig(**{name: getattr(self, name) for name in GuardConfig.model_fields})
        except ValidationError as err:
            raise ValueError(format_validation_error(err, "ThroughputGuard")) from None
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
        the guard's modes, its upper bound is at least ``share`` of the fastest measured
        mode's rate, and, measured slower, its next probe is due within ``window`` steps.
        A bucket short of ``mode`` or of another measured mode is judged by a neighbour
        (half or twice) that has both; True where neither has. Why:
        docs/design-log.md#throughput-guard."""
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
        """``joined`` of the ``batch`` requests of the coming steps are new: the records
        of copy chains and of plain decoding, measured on text they replace, shrink by
        ``text_steps`` over their weight, to the power of the new share; their rates,
        mean steps and last steps stay. Where a :class:`ChainScout` looks at new batches
        (``scouted``, ``scout_new_batches``) and at least half of a batch of several
        requests is new, the chains' record is dropped instead, and plain decoding's
        shrinks to :data:`STALE_PLAIN_WEIGHT` and is measured again before the scout
        compares chains with it. Trees' record stays. Why:
        docs/design-log.md#throughput-guard."""
        if joined <= 0 or batch <= 0:
            return
        if scouted and self.scout_new_batches and batch >= 2 and mostly_new(joined, batch):
            for key in [key for key in self.stats if key[1] is StepMode.CHAIN]:
                del self.stats[key]
            for key in [key for key in self.stats if key[1] is StepMode.PLAIN]:
                self._shrink(key, STALE_PLAIN_WEIGHT)
                self.measured.pop(key, None)  # a first probe: measured on the new text
            return
        share = min(joined / batch, 1.0)
        for key in [key for key in self.stats if key[1] in TEXT_MODES]:
            weight = self._stats(*key).weight
            if weight > self.text_steps:
                self._shrink(key, weight * (self.text_steps / weight) ** share)

    def _shrink(self, key: tuple[int, StepMode], weight: float) -> None:
        """The record at ``key`` (bucket, mode) weighs at most ``weight`` steps now; its
        rate, mean step and last step stay."""
        stats = self.stats[key]
        current = self._stats(*key).weight
        if current > weight:
            keep = weight / current
            self.stats[key] = _ModeStats(stats.weight * keep, stats.tokens * keep,
                                         stats.tokens_sq * keep, stats.seconds * keep,
                                         stats.step)

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
        ``batch`` requests, to its record there (the drafter reading prompts and
        catching up, charged to trees): its rate falls, its steps,
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

    def credited_tokens(self, row_tokens: list[float],
                        req_ids: list[str] | None = None) -> float:
        """What a step whose requests (``req_ids``, None: requests with no gain yet)
        emitted ``row_tokens`` (one count per request) counts as, by ``credit``:
        ``progress``, one token a request plus what the step adds to the median
        request's speculative gain (:attr:`gains`, taken as :meth:`advance` will
        leave them) times the requests; ``median``, the step's median request's tokens
        times the requests; ``sum``, their sum. Why: docs/design-log.md#throughput-guard.
        """
        if self.credit == "sum" or len(row_tokens) < 2:
            return float(sum(row_tokens))
        if self.credit == "median":
            return float(statistics.median(row_tokens) * len(row_tokens))
        before = [0.0] * len(row_tokens) if req_ids is None \
            else [self.gains.get(req_id, 0.0) for req_id in req_ids]
        after = [gain + max(tokens - 1.0, 0.0) for gain, tokens in zip(before, row_tokens)]
        return len(row_tokens) * (1.0 + statistics.median(after) - statistics.median(before))

    def advance(self, req_ids: list[str], row_tokens: list[float]) -> None:
        """The step that just ran: ``req_ids`` emitted ``row_tokens`` (decoding
        tokens; a prompt chunk's row counts one). Their gains grow by the tokens beyond
        one; requests not in the step are forgotten (a request that returns after a
        preemption starts again from none)."""
        self.gains = {req_id: self.gains.get(req_id, 0.0) + max(tokens - 1.0, 0.0)
                      for req_id, tokens in zip(req_ids, row_tokens)}

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
