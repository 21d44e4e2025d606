"""The throughput guard: each step runs in the mode measured fastest
(:class:`ThroughputGuard`)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace

from vllm_graft.core.budget.cost import batch_bucket, nearest_buckets
from vllm_graft.core.config import StepMode


def mostly_new(joined: int, batch: int) -> bool:
    """Whether a batch whose ``joined`` of ``batch`` requests just arrived is new text
    (at least half of it): the chain scout looks at its first steps, and the guard
    leaves its chains to the scout."""
    return 2 * joined >= batch

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
