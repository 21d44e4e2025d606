"""The chain scout: while the guard decodes plainly or verifies trees, a look now and
then at the copy chains the batch's contexts offer (:class:`ChainScout`)."""

from __future__ import annotations

from vllm_graft.core.budget.guard import ThroughputGuard, mostly_new
from vllm_graft.core.config import StepMode


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


def fired_step_gained(guard: ThroughputGuard, replaced: StepMode, batch: int, credited: float,
                      seconds: float) -> bool:
    """Whether a chain step the scout fired in place of a ``replaced`` step gained: one
    replacing a tree step beat the trees' measured rate at ``batch`` (they emit several
    tokens a request too, so more than one token a request is no gain over them); one
    replacing a plain step emitted more than plain decoding would have, one token a
    request (``credited``: the guard's credit of the step, ``seconds``: as it counts
    them)."""
    if replaced is StepMode.TREE and seconds > 0:
        rate = guard.rate_of(batch, StepMode.TREE)
        if rate is not None:
            return credited / seconds > rate
    return credited > batch


class ChainScout:
    """While the throughput guard decodes plainly or verifies trees, a look now and then
    at the copy chains the batch's contexts offer, and a chain step when they promise to
    beat the mode the guard chose.

    A look builds and sizes the chains the step could verify; they promise when their
    predicted rate (the sizer's tokens over the cost model's ms, times
    :meth:`correction`) beats the chosen mode's measured rate by ``margin``. Looks come
    at the plain and tree steps the guard prefers (never at one it chose to measure),
    every ``every`` of them; each look that does not promise doubles the wait, up to
    ``max_every``; a promising look or a joining request brings it back to ``every``,
    and a batch at least half new is looked at from its first such step (steps 1, 3,
    7, ...). Why: docs/design-log.md#chain-scout.
    """

    #: the guard's modes a chain step may replace: those dearer than a chain
    REPLACES = (StepMode.PLAIN, StepMode.TREE)

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
        self.steps_since_look = 0  # plain and tree steps since the last look
        self.interval = every  # plain and tree steps from one look to the next
        self.promised = False  # the last look found chains worth a step
        self.unpromised_interval = every  # where that look would have left the interval

    def looks_at(self, guard: ThroughputGuard, mode: StepMode) -> bool:
        """Whether to look at this step, which ``guard`` chose to run in ``mode``: a
        plain or tree step it prefers (not one it measures) when a look is :meth:`due`.
        The look compares the chains with ``guard.rate_of(batch, mode)``."""
        return mode in self.REPLACES and not guard.measuring and self.due()

    def due(self) -> bool:
        """Called once per plain or tree step the guard prefers: whether to look this
        step."""
        self.steps_since_look += 1
        if self.promised or self.steps_since_look >= self.interval:
            self.steps_since_look = 0
            return True
        return False

    def text_changed(self, joined: int, batch: int) -> None:
        """``joined`` of the ``batch`` requests of the coming steps are new: look every
        ``every`` plain or tree steps again, or, where at least half the batch is new,
        at the next such step and back off from there."""
        if mostly_new(joined, batch):
            self.interval, self.steps_since_look = 1, 0
        else:
            self.interval = min(self.interval, self.every)

    def correction(self) -> float:
        """Measured over predicted rate of recent chain steps, with ``prior_steps``
        more steps that measured what was predicted of the mean one, so a chain step or
        two cannot silence the scout (1 before any)."""
        if (self.weight <= 0 or self.predicted_tokens <= 0 or self.measured_ms <= 0
                or self.predicted_ms <= 0):
            return 1.0
        prior = self.prior_steps / self.weight  # the prior steps' share of the sums
        tokens = (self.tokens + prior * self.predicted_tokens) \
            / (self.predicted_tokens * (1.0 + prior))
        ms = (self.predicted_ms * (1.0 + prior)) / (self.measured_ms + prior * self.predicted_ms)
        return tokens * ms

    def promising(self, expected_tokens: float, step_ms: float,
                  rate: float | None) -> bool:
        """Whether a chain step predicted to emit ``expected_tokens`` in ``step_ms`` beats
        ``rate`` (tokens per second, measured of the mode the guard chose) by the margin
        once corrected. The
        prediction is counted as the guard will credit the step (the runner passes the
        guard's :meth:`ThroughputGuard.credited_tokens` of each request's prediction)."""
        if rate is None or step_ms <= 0:
            self.promised = False
        else:
            chain_rate = 1e3 * expected_tokens / step_ms * self.correction()
            self.promised = chain_rate >= (1.0 + self.margin) * rate
        self.unpromised_interval = min(2 * self.interval, self.max_every)
        self.interval = min(self.interval, self.every) if self.promised \
            else self.unpromised_interval
        return self.promised

    def fired_step(self, gained: bool) -> None:
        """The chain step the last look fired was measured: ``gained`` whether it
        emitted more than a plain step would have (the guard's credit over one token a
        request). One that gained nothing counts as a look that did not promise: the
        next look waits twice as long as the one before (why:
        docs/design-log.md#chain-scout)."""
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
