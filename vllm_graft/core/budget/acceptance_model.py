"""The acceptance model: P(node accepted | parent accepted) per (source class, depth,
score bucket), learned online and seeded by a calibration; the helpers that put nodes
into those classes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, field_validator, model_validator

from vllm_graft.core.hybrid import SOURCE_CONTEXT, UNKNOWN_SCORE

#: the acceptance model's source classes; a context-copied node is ``context`` whatever
#: else proposed it
SOURCE_NAMES = ("draft", "retrieved", "both", "context")
#: the most trials a calibration's measurement of one (source, depth) counts as
CALIBRATION_EVIDENCE_TRIALS = 32.0


@dataclass
class AcceptanceModel:
    """P(node accepted | parent accepted) per (source, depth, score bucket), as Beta counts.

    ``score`` is what is known of a node when the tree is built, in [0, 1], split into
    even buckets: a copied node's match score, a drafted node's probability under the
    drafter, a retrieved node's successor rank score (a node of several sources keeps
    the highest; matrix-walked chain nodes are :data:`UNKNOWN_SCORE`).
    ``prior_accepts`` / ``prior_trials`` seed every bucket; :meth:`seed` adds what a
    calibration measured. Why: docs/design-log.md#acceptance-model.
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
        1): what the sizer chooses by, so a class never verified is still tried; the
        margin shrinks as the class is (why: docs/design-log.md#acceptance-model)."""
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
        return (int(_SOURCE_CLASS_OF_TAG[tag]) * self.max_depth + depth) \
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
        :class:`AcceptanceTally`, trials and accepts per
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
        (:class:`AcceptanceTally`) that :meth:`seed` reads:
        per source, the depths up to its deepest tried one. Only for a model that was
        not seeded itself (its counts above the prior are whole trials), so that a
        calibration run can hand what serving's online model learned to the next
        engine's, e.g. the copy chains' odds, which no recorded tree holds."""
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


# ---- what a calibration file records of the model's classes ----------------------------
class SourceAcceptance(BaseModel):
    """What a calibration run measured of one source's nodes, per depth (item 0: depth
    1) and score bucket: how many were tried (their parent lay on the accepted path)
    and how many of those were accepted."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    trials: tuple[tuple[NonNegativeInt, ...], ...]
    accepts: tuple[tuple[NonNegativeInt, ...], ...]

    @model_validator(mode="after")
    def _counts(self) -> SourceAcceptance:
        if [len(row) for row in self.trials] != [len(row) for row in self.accepts]:
            raise ValueError("trials and accepts must have the same shape (depths x score "
                             "buckets)")
        for depth, (tried, accepted) in enumerate(zip(self.trials, self.accepts), 1):
            for bucket, (t, a) in enumerate(zip(tried, accepted)):
                if a > t:
                    raise ValueError(f"at depth {depth}, score bucket {bucket}, {a} accepts "
                                     f"exceed {t} trials")
        return self


#: the node sources a calibration measures (the acceptance model's classes)
AcceptanceSource = Literal["draft", "retrieved", "both", "context"]


class AcceptanceTally(BaseModel):
    """Per node source, depth and score bucket (``score_buckets`` even buckets of [0, 1]),
    the nodes a calibration run tried and accepted
    (:func:`vllm_graft.core.calibration.tally_acceptance`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    score_buckets: int = Field(ge=1)
    sources: dict[AcceptanceSource, SourceAcceptance]

    @field_validator("score_buckets")
    @classmethod
    def _model_buckets(cls, v: int) -> int:
        if v != AcceptanceModel.score_buckets:
            raise ValueError(f"{v} score buckets, but the acceptance model has "
                             f"{AcceptanceModel.score_buckets}; recalibrate")
        return v

    @classmethod
    def of_counts(cls, trials: np.ndarray, accepts: np.ndarray) -> AcceptanceTally:
        """The tally of integer counts shaped as the acceptance model's (source class,
        depth, score bucket): per source, the depths up to its deepest tried one."""
        sources = {}
        for name, tried, accepted in zip(SOURCE_NAMES, trials, accepts):
            measured = np.flatnonzero(tried.sum(1))
            if measured.size:
                depths = int(measured[-1]) + 1
                sources[name] = SourceAcceptance(
                    trials=tuple(map(tuple, tried[:depths].tolist())),
                    accepts=tuple(map(tuple, accepted[:depths].tolist())))
        return cls(score_buckets=trials.shape[-1], sources=sources)

    @model_validator(mode="after")
    def _buckets(self) -> AcceptanceTally:
        for name, counts in self.sources.items():
            if any(len(row) != self.score_buckets for row in counts.trials):
                raise ValueError(f"every depth of source {name!r} needs {self.score_buckets} "
                                 f"score buckets")
        return self
