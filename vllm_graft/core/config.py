"""Typed, validated configuration of the Graft algorithm.

Everything the algorithm needs to build a hybrid tree lives here; nothing in this
module knows about vLLM. Invalid values fail at construction with a message that names
the key (``graft.budget: ...``), so a bad ``graft.json`` is rejected at start-up and
never reaches the engine loop.
"""

from __future__ import annotations

import os
from enum import Enum
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from vllm_graft.core.guard_config import GuardConfig


class GraftConfigError(ValueError):
    """A Graft setting (or a file it names) is invalid; the message names the key."""


class Variant(str, Enum):
    """Which parts of Graft are switched on (the ablations of the paper)."""

    GRAFT = "graft"  # calibrated pruning + retrieval fill (the product)
    DENSE_TREE = "dense_tree"  # EAGLE-3 dynamic tree, no pruning, no retrieval
    PRUNE_ONLY = "prune_only"  # ECHO-like: pruning, freed slots stay empty
    RETRIEVAL_ONLY = "retrieval_only"  # Token-Recycling-like: no drafter at all
    TAIL = "tail"  # Graft-TAIL: a drafted chain, its unsure tail retrieved

    @property
    def drafts(self) -> bool:
        return self is not Variant.RETRIEVAL_ONLY

    @property
    def prunes(self) -> bool:
        return self in (Variant.GRAFT, Variant.PRUNE_ONLY, Variant.TAIL)

    @property
    def retrieves(self) -> bool:
        return self in (Variant.GRAFT, Variant.RETRIEVAL_ONLY, Variant.TAIL)

    @property
    def chains(self) -> bool:
        """Whether the drafts are chains (:mod:`vllm_graft.core.tail`), not trees."""
        return self is Variant.TAIL


class TreeShape(str, Enum):
    """How many verification slots a request's tree uses (``graft.tree_shape``).

    ``dynamic``: a tree holds up to ``budget`` nodes; retrieval misses, merges and
    ``prune_only`` leave slots empty, so requests differ in how many draft tokens they
    schedule. ``fixed``: every tree holds exactly ``budget`` nodes (see
    :class:`vllm_graft.core.graft.GraftTreeBuilder`), so every request schedules the
    same number of draft tokens and verification (and the drafting that produced the
    tree) has one shape per batch size, as full CUDA graphs need. ``auto``: ``fixed``
    when the engine captures full CUDA graphs over the verification, ``dynamic``
    otherwise (eager mode, CPU, and the piecewise graphs Graft runs on GPUs, where tree
    attention runs between the captured pieces and shapes may vary); the engine adapter
    decides that with :func:`resolve_tree_shape`.
    """

    AUTO = "auto"
    FIXED = "fixed"
    DYNAMIC = "dynamic"


class StepMode(str, Enum):
    """What a decoding step costs and what it may gain (``graft.guard_modes``), dearest
    first.

    ``tree``: the drafter's hybrid tree (drafted, retrieved and copied nodes), verified
    with tree attention. ``chain``: no drafter forward; a copy chain (copied context
    continued by the successor matrix, :mod:`vllm_graft.core.chain`), verified with the
    backend's own causal attention, at prompt lookup's cost. ``plain``: plain decoding.
    With ``budget: "auto"`` the throughput guard runs each step in the listed mode
    measured fastest."""

    TREE = "tree"
    CHAIN = "chain"
    PLAIN = "plain"


def resolve_tree_shape(setting: TreeShape | str, cuda_graphs_enabled: bool) -> TreeShape:
    """The shape in force: ``FIXED`` or ``DYNAMIC``, never ``AUTO``.

    ``setting``: ``GraftConfig.tree_shape`` (or its string); ``cuda_graphs_enabled``:
    whether the engine captures full CUDA graphs over the verification. The core itself knows
    nothing about CUDA graphs: the adapter passes that fact in.
    """
    try:
        setting = TreeShape(setting)
    except ValueError:
        raise GraftConfigError(
            f"graft.tree_shape: must be one of 'auto', 'fixed', 'dynamic', got {setting!r}"
        ) from None
    if setting is TreeShape.AUTO:
        return TreeShape.FIXED if cuda_graphs_enabled else TreeShape.DYNAMIC
    return setting


PAPER_BUDGET = 60
PAPER_CHECKPOINTS = (0, 1, 5)
PAPER_DRAFT_KEEP = (8, 24, 40)

#: Thresholds used when neither ``thresholds`` nor a calibration file is given.
#: Chosen so that a weak drafter stops early at the root (top-1 draft probability
#: below 0.35) while a confident one drafts on; ``vllm-graft calibrate`` replaces them.
DEFAULT_THRESHOLDS = (0.35, 0.25, 0.15)

#: Draft tokens of a Graft-TAIL chain under ``budget: "auto"`` (the cap the per-step
#: sizing works under), the chain length vLLM's EAGLE-3 examples use.
DEFAULT_TAIL_LENGTH = 5
MAX_TAIL_LENGTH = 32

#: Prior acceptance probability of the successor at each rank of the matrix (rank 0 =
#: the target's most likely next token). Retrieval templates are the best-first
#: expansion under these priors, which makes them asymmetric: high ranks get deep
#: chains and many children, low ranks stay shallow. Roughly Token Recycling's
#: per-rank acceptance; calibration may refit them.
DEFAULT_RANK_PRIOR = (0.62, 0.17, 0.08, 0.05, 0.035, 0.025, 0.02, 0.015)


def default_rank_prior(width: int) -> tuple[float, ...]:
    """The default prior, continued geometrically (x0.75 per rank) past rank 8 so that
    wider templates work without spelling out a prior."""
    prior = list(DEFAULT_RANK_PRIOR)
    while len(prior) < width:
        prior.append(round(prior[-1] * 0.75, 6))
    return tuple(prior)


class ContextRetrievalConfig(BaseModel):
    """The ``graft.context`` section: copy continuations of the current suffix from the
    request's own prompt and output (prompt lookup as a tree, see
    :mod:`vllm_graft.core.context`). ``"context": false`` is short for
    ``{"enabled": false}``.

    The copied nodes enter the tree first, so a tree always holds the prompt-lookup
    candidates when the context has a match; the budget cut then falls on the
    lowest-priority retrieved nodes, and with ``budget: "auto"`` every node, copied or
    not, is kept only while its learned acceptance pays for its verification.
    ``cross_request`` also matches the outputs of *other* requests (SuffixDecoding-style),
    within what ``graft.isolation`` lets requests share: those that read the same
    successor matrix (every request in ``global`` mode, a tenant's requests in
    ``tenant`` mode, none for a private matrix), their outputs as they grow, and in
    ``global`` mode also recent finished outputs (``cross_request_tokens`` of them).
    Text shared this way only changes what is proposed, never the output, and it
    reaches only requests that already share what the matrix learns from them.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="copy continuations of the request's own "
                          "context into its trees (prompt lookup as a tree)")
    max_nodes: int = Field(16, ge=0, le=256, description="copied nodes per tree")
    max_depth: int = Field(16, ge=1, le=64, description="longest copied continuation")
    max_matches: int = Field(8, ge=1, le=64, description="earlier occurrences followed")
    lead_nodes: int = Field(
        8, ge=0, le=64, description="tokens of the best match's continuation kept before "
        "any other branch (prompt lookup's chain stays whole)")
    min_ngram: int = Field(2, ge=1, le=32, description="shortest suffix matched")
    max_ngram: int = Field(8, ge=1, le=32, description="longest suffix matched")
    cross_request: bool = Field(True, description="also match the outputs of other "
                                "requests that share the request's successor matrix "
                                "(graft.isolation): running ones, and in global mode "
                                "recent finished ones")
    cross_request_tokens: int = Field(
        65536, ge=1, le=1 << 24, description="recent finished output tokens the shared "
        "index holds (isolation global)")

    @model_validator(mode="after")
    def _check_ngrams(self) -> ContextRetrievalConfig:
        if self.max_ngram < self.min_ngram:
            raise ValueError(f"max_ngram ({self.max_ngram}) must be >= min_ngram "
                             f"({self.min_ngram})")
        return self


class SuccessorStateConfig(BaseModel):
    """The ``graft.successor_state`` section: the successor matrix the engine learns
    online survives restarts. At start-up the file at ``path`` is loaded when it exists
    (it wins over ``warmup``); the matrix is written there every ``save_every_s`` seconds
    of serving (0: never periodically) and when the engine shuts down, atomically, with a
    checksum, the format version and the tokenizer's fingerprint, private to its owner
    (0600 whatever the umask). Only the first tensor-parallel rank writes (the ranks hold
    identical matrices); at start-up it removes the temporary files a killed save left
    beside ``path``. A failed save is logged (once per kind of error until a save
    succeeds), counted in ``vllm:graft_successor_state_save_failures_total`` and tried
    again at the next period; serving goes on.

    ``on_corrupt``: what start-up does with a state file it cannot use (unreadable,
    truncated, corrupt, or for another tokenizer, vocabulary or ``successor_k``):
    ``"move_aside"`` (default) renames it to ``<path>.corrupt-<UTC time>`` (kept, never
    deleted), warns naming both paths and starts from ``warmup`` (or empty);
    ``"refuse"`` stops start-up with an error naming the file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(min_length=1, description="the state file (created when missing)")
    save_every_s: float = Field(
        300.0, ge=0.0, description="seconds between periodic saves (0: only at shutdown)")
    on_corrupt: Literal["move_aside", "refuse"] = Field(
        "move_aside", description="a state file start-up cannot use: moved aside (the "
        "engine starts from the warm-up file) or refused (start-up stops)")


class IsolationConfig(BaseModel):
    """The ``graft.isolation`` section: who shares a successor matrix (see
    :mod:`vllm_graft.core.isolation`). ``"isolation": "request"`` is short for
    ``{"mode": "request"}``.

    A shared matrix that learns online lets one tenant's text change another tenant's
    latency (a timing side channel), so the default is ``tenant``: each tenant gets its
    own matrix, and a request that names none a private one (``unnamed``). The operator
    names where a request's tenant comes from (``tenant_source``): the OpenAI ``user``
    field, the request's ``cache_salt``, the Graft extra argument ``tenant_field``
    (``vllm_xargs`` in the OpenAI API, ``SamplingParams(extra_args=...)`` offline), or an
    HTTP header a trusted gateway sets; the other fields never name a tenant. ``global``
    shares one matrix among all, and is the only mode whose matrix ``successor_state``
    saves."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["global", "tenant", "request"] = Field(
        "tenant", description="global: one matrix for all; tenant: one per tenant named "
        "by tenant_source, a private one for a request naming none; request: one per "
        "request")
    max_matrices: int | None = Field(
        None, ge=1, le=4096, description="matrices allocated at start-up on every rank "
        "(tenant, request modes; default: the engine's max_num_seqs + 16, so every running "
        "request can hold a private one beside 16 tenants, but no more than fit in 1 GiB "
        "and at least 17; the start-up log says their memory); a request with a private "
        "matrix holds one while it runs; beyond, the least recently used idle one is "
        "reset for the newcomer, and a request finding every one held runs without "
        "retrieval")
    tenant_field: str = Field(
        "graft_tenant", min_length=1, max_length=64, pattern="^graft_[a-z0-9_]+$",
        description="the request's extra argument that names its tenant (read with "
        "tenant_source 'extra'; the engine receives every request's tenant there)")
    tenant_source: str = Field(
        "user", description="where a request's tenant comes from: 'user' (the OpenAI "
        "user field), 'cache_salt', 'extra' (the tenant_field extra argument) or "
        "'header:<Name>' (an HTTP header a trusted gateway sets); the other fields are "
        "ignored")
    unnamed: Literal["private", "shared"] = Field(
        "private", description="tenant mode, a request naming no tenant: its own matrix "
        "(a copy of the warm-up state, freed when it ends) or the one matrix all such "
        "requests share")

    @field_validator("tenant_source")
    @classmethod
    def _known_source(cls, source: str) -> str:
        kind, sep, header = source.partition(":")
        if kind in TENANT_SOURCES and not sep:
            return source
        if kind == "header" and is_header_name(header):
            return source
        raise ValueError(f"must be one of {', '.join(map(repr, TENANT_SOURCES))} or "
                         f"'header:<Name>' (a header name of letters, digits and '-', at "
                         f"most 64 characters), got {source!r}")


#: the tenant sources besides ``header:<Name>`` (``graft.isolation.tenant_source``)
TENANT_SOURCES = ("user", "cache_salt", "extra")


def is_header_name(name: str) -> bool:
    """A header that may name tenants: 1 to 64 ASCII letters, digits and dashes, not
    starting with a dash."""
    return 0 < len(name) <= 64 and name[0] != "-" and all(
        c.isascii() and (c.isalnum() or c == "-") for c in name)


def _refuse_auto_dflash_budget(data: Any) -> Any:
    """A DFlash drafter proposes a block of a fixed size in one forward: its budget is
    that size, never sized per step."""
    if isinstance(data, dict) and data.get("drafter") == "dflash" \
            and data.get("budget", "auto") == "auto":
        raise ValueError("budget: drafter 'dflash' drafts blocks of a fixed size: set budget "
                         "to the number of draft tokens per block (e.g. 16)")
    return data


def _expand_auto_budget(data: Any) -> Any:
    """``budget: "auto"`` (the default) is the paper's budget as a cap (a Graft-TAIL
    chain's: :data:`DEFAULT_TAIL_LENGTH`), with per-step sizing and the throughput guard
    on; a number is a fixed budget. An explicit ``auto_size`` is kept (a config dumped
    with its every key reads back the same)."""
    if not isinstance(data, dict):
        return data
    _refuse_auto_dflash_budget(data)
    if data.get("budget", "auto") == "auto":
        cap = DEFAULT_TAIL_LENGTH if data.get("variant") == Variant.TAIL.value else PAPER_BUDGET
        return {**data, "budget": cap, "auto_size": data.get("auto_size", True)}
    return data


class GraftConfig(BaseModel):
    """The ``graft`` section of the speculative config.

    ``budget`` counts candidate nodes, excluding the root (the last accepted token,
    which is verified anyway), so one verification step processes ``budget + 1``
    rows per request. For ``variant: "tail"`` it is the chain's number of draft tokens
    (drafted prefix plus retrieved tail); the tree-only keys (``top_k``, ``max_depth``,
    ``draft_keep``, the retrieval template) do not apply there. Checkpoint ``d`` is the
    ``d``-th draft step (0 = the root's children, at tree depth ``d + 1``).

    ``tree_shape`` (``"auto"`` | ``"fixed"`` | ``"dynamic"``, default ``"auto"``): with
    ``fixed`` every request's tree has exactly ``budget`` nodes besides the root
    (further retrieved nodes, spare drafted candidates, then harmless padding fill what
    misses and merges leave empty; low-confidence drafted nodes of unpruned trees make
    room for retrieved ones), so every request schedules the same number of draft tokens
    and the shapes suit CUDA graphs. ``dynamic`` is the plain Graft tree (at most
    ``budget`` nodes). ``auto`` means ``fixed`` under full CUDA graphs over the
    verification and ``dynamic`` otherwise; see :class:`TreeShape` and
    :func:`resolve_tree_shape`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    variant: Variant = Field(Variant.GRAFT, description="graft (hybrid trees), dense_tree "
                             "(EAGLE-3 tree), prune_only, retrieval_only, or tail "
                             "(Graft-TAIL chains)")
    drafter: str = Field("eagle3", pattern="^(eagle3|draft_model|dflash)$",
                         description="an EAGLE-3 head, an ordinary draft model, or a "
                         "DFlash block drafter (variant tail only)")
    budget: int = Field(60, ge=1, le=256, description="candidate nodes per tree, or "
                        "\"auto\": 60 as a cap, sized per step by measured cost "
                        "and acceptance, each step's mode chosen by the throughput guard",
                        json_schema_extra={"shown_default": "\"auto\""})
    top_k: int = Field(10, ge=1, le=64, description="drafter branching factor")
    max_depth: int = Field(7, ge=1, le=32, description="draft steps without pruning")
    checkpoints: tuple[int, ...] = Field(PAPER_CHECKPOINTS, description="draft depths at "
                                         "which drafting may stop early")
    draft_keep: tuple[int, ...] = Field(PAPER_DRAFT_KEEP, description="drafted nodes kept "
                                        "when drafting stops at each checkpoint")
    thresholds: tuple[float, ...] | None = Field(
        None, description="best-path confidence below which drafting stops, one per "
        "checkpoint; wins over the calibration file's (default: the calibrated ones, else "
        "0.35, 0.25, 0.15)")
    calibration: str | None = Field(None, description="calibration file (`vllm-graft "
                                     "calibrate`): thresholds and acceptance odds")
    successor_k: int = Field(8, ge=1, le=64, description="successors stored per token")
    warmup: str | None = Field(None, description="successor matrix file to start from")
    retrieval_depth: int = Field(8, ge=1, le=32, description="deepest level of the "
                                 "retrieval template")
    retrieval_width: int = Field(8, ge=1, le=64, description="widest level of the "
                                 "retrieval template")
    retrieval_slack: int = Field(
        8, ge=0, le=256, description="extra template nodes that refill merged duplicates"
    )
    rank_prior: tuple[float, ...] = Field(DEFAULT_RANK_PRIOR, description="prior "
                                          "acceptance of a retrieved node by its "
                                          "successor rank")
    ops_backend: str = Field("compiled", pattern="^(compiled|reference)$",
                             description="compiled: the fused step ops; reference: the "
                             "plain torch path they are tested against")
    tree_shape: TreeShape = Field(
        TreeShape.AUTO, description="fixed: exactly budget nodes per tree; dynamic: up to "
        "budget; auto: fixed under full CUDA graphs over the verification, else dynamic")
    auto_size: bool = Field(
        False, description="size each step's trees by measured cost and learned acceptance "
        "(budget is the cap); budget \"auto\", the default, means budget 60 with this on")
    auto_guard: bool = Field(
        True, description="with budget \"auto\": run each step as a Graft tree, a copy "
        "chain or plain decoding, whichever measures fastest (the throughput guard)")
    guard_modes: tuple[StepMode, ...] = Field(
        (StepMode.TREE, StepMode.CHAIN, StepMode.PLAIN), min_length=1,
        description="the modes the throughput guard chooses among, each step the one "
        "measured fastest (a single mode: always that one)")
    chain_tokens: int = Field(
        16, ge=1, le=64, description="longest copy chain of the guard's chain mode "
        "(copied context continued by the successor matrix, no drafter forward)")
    chain_walk: int = Field(
        3, ge=0, le=64, description="successor-matrix tokens a copy chain may add after its "
        "copied part (all of it when the context has no match)")
    chain_scout_every: int = Field(
        8, ge=0, le=1024, description="while the throughput guard decodes plainly or "
        "verifies trees, such steps between two looks at the copy chains the batch's "
        "contexts offer; a chain step runs when they promise to beat the guard's choice; "
        "each look that finds nothing doubles the steps to the next, up to 8 times this, "
        "until a request joins the batch; a batch at least half new is looked at on its "
        "steps 1, 3, 7, ... (0: never look)")
    guard: GuardConfig = Field(
        default_factory=GuardConfig, description="the throughput guard's tuning: how it "
        "measures the modes and chooses among them")
    successor_state: SuccessorStateConfig | None = Field(
        None, description="file the learned successor matrix is loaded from at start-up and "
        "saved to periodically and at shutdown; unset: it lives in memory only")
    isolation: IsolationConfig = Field(
        default_factory=IsolationConfig, description="who shares a successor matrix: "
        "global, tenant (the default) or request")
    context: ContextRetrievalConfig | None = Field(
        None, description="copy continuations from the request's own context (prompt "
        "lookup); unset: on for the graft variant, off for the ablations")
    cuda_graphs: bool = Field(
        True, description="on GPUs, run the target under vLLM's piecewise CUDA graphs "
        "(tree attention runs eagerly between the captured pieces; the first tree steps "
        "are checked against eager forwards, and any difference, or a capture that fails "
        "at start-up, turns the graphs off with one log line) "
        "and the drafter's draft loop as one CUDA graph per batch size (its first replays "
        "checked the same way); false: eager mode")
    max_consecutive_errors: int = Field(
        16, ge=1, le=1_000_000, description="steps in a row with a failure in Graft's hooks "
        "(each decoded plainly) after which Graft turns itself off for the engine")
    heap_trim_s: float = Field(
        10.0, ge=0, le=3600, description="seconds of engine steps between two hand-backs "
        "of the memory the C allocator keeps after frees (glibc malloc_trim), so a "
        "long-running server's resident size follows what is live; 0: never")

    @field_validator("guard_modes")
    @classmethod
    def _distinct_modes(cls, modes: tuple[StepMode, ...]) -> tuple[StepMode, ...]:
        if len(set(modes)) != len(modes):
            raise ValueError(f"each mode at most once, got {[m.value for m in modes]}")
        return modes

    @field_validator("context", mode="before")
    @classmethod
    def _context_switch(cls, value: Any) -> Any:
        return {"enabled": value} if isinstance(value, bool) else value

    @field_validator("isolation", mode="before")
    @classmethod
    def _isolation_shorthand(cls, value: Any) -> Any:
        return {"mode": value} if isinstance(value, str) else value

    @model_validator(mode="before")
    @classmethod
    def _widen_default_rank_prior(cls, data: Any) -> Any:
        data = _expand_auto_budget(data)
        if not isinstance(data, dict) or "rank_prior" in data:
            return data
        width = data.get("retrieval_width", len(DEFAULT_RANK_PRIOR))
        if isinstance(width, int) and len(DEFAULT_RANK_PRIOR) < width <= 64:
            return {**data, "rank_prior": default_rank_prior(width)}
        return data

    @model_validator(mode="before")
    @classmethod
    def _scale_default_draft_keep(cls, data: Any) -> Any:
        """Without an explicit ``draft_keep``, the paper's 8 / 24 / 40 of 60 slots are
        scaled to the budget (budget 8 keeps 1 / 3 / 5). Other checkpoint layouts must
        say how many draft nodes each keeps."""
        data = _expand_auto_budget(data)
        if not isinstance(data, dict) or "draft_keep" in data:
            return data
        checkpoints = tuple(data.get("checkpoints", PAPER_CHECKPOINTS))
        if checkpoints != PAPER_CHECKPOINTS:
            if checkpoints:
                raise ValueError("draft_keep is required when checkpoints differ from (0, 1, 5)")
            return {**data, "draft_keep": ()}
        budget = data.get("budget", PAPER_BUDGET)
        top_k = data.get("top_k", 10)
        if not isinstance(budget, int) or not isinstance(top_k, int) or budget < 1 or top_k < 1:
            return data  # field validation reports it
        keep, floor = [], 1
        for cp, paper in zip(checkpoints, PAPER_DRAFT_KEEP):
            ceiling = min(budget, num_draft_candidates(top_k, cp + 1))
            floor = min(max(floor, round(budget * paper / PAPER_BUDGET)), ceiling)
            keep.append(floor)
        return {**data, "draft_keep": tuple(keep)}

    @model_validator(mode="after")
    def _check_cross_fields(self) -> GraftConfig:
        cps = self.checkpoints
        if any(b <= a for a, b in zip(cps, cps[1:])) or (cps and cps[0] < 0):
            raise ValueError(f"checkpoints must be strictly increasing and >= 0, got {list(cps)}")
        if cps and cps[-1] >= self.max_depth:
            raise ValueError(
                f"checkpoints must be < max_depth ({self.max_depth}), got {list(cps)}")
        if len(self.draft_keep) != len(cps):
            raise ValueError(
                f"draft_keep needs one entry per checkpoint ({len(cps)}), "
                f"got {list(self.draft_keep)}")
        for cp, keep in zip(cps, self.draft_keep):
            available = num_draft_candidates(self.top_k, cp + 1)
            if not 1 <= keep <= min(self.budget, available):
                raise ValueError(
                    f"draft_keep {keep} at checkpoint {cp} must be in "
                    f"[1, min(budget={self.budget}, {available} drafted candidates)]")
        if self.thresholds is not None:
            if len(self.thresholds) != len(cps):
                raise ValueError(
                    f"thresholds needs one entry per checkpoint ({len(cps)}), "
                    f"got {list(self.thresholds)}")
            if any(not 0.0 <= t <= 1.0 for t in self.thresholds):
                raise ValueError(f"thresholds must lie in [0, 1], got {list(self.thresholds)}")
        if self.retrieval_width > self.successor_k:
            raise ValueError(
                f"retrieval_width ({self.retrieval_width}) cannot exceed successor_k "
                f"({self.successor_k}): a template rank must exist in the matrix")
        if len(self.rank_prior) < self.retrieval_width:
            raise ValueError(
                f"rank_prior needs at least retrieval_width ({self.retrieval_width}) "
                f"entries, got {len(self.rank_prior)}")
        if any(not 0.0 < p < 1.0 for p in self.rank_prior):
            raise ValueError(f"rank_prior entries must lie in (0, 1), got {list(self.rank_prior)}")
        if self.drafter == "dflash" and not self.variant.chains:
            raise ValueError(f"drafter 'dflash' drafts blocks, which Graft grafts as "
                             f"chains: it needs variant 'tail' (variant is "
                             f"{self.variant.value!r})")
        if self.drafter == "dflash" and self.auto_size:
            raise ValueError("drafter 'dflash': auto_size is not available (one drafter "
                             "forward proposes the whole block)")
        if self.variant.chains and self.uses_context:
            raise ValueError("variant 'tail' drafts chains without context copies: "
                             "remove the context section (or set it to false)")
        if self.variant.chains and self.budget > MAX_TAIL_LENGTH:
            raise ValueError(f"variant 'tail': budget is the chain length, at most "
                             f"{MAX_TAIL_LENGTH} (one drafter forward per token), got "
                             f"{self.budget}")
        if self.successor_state is not None and self.isolation.mode != "global":
            raise ValueError(f"successor_state saves one shared matrix: it needs isolation "
                             f"'global' (isolation is {self.isolation.mode!r})")
        fields = type(self).model_fields
        guard_keys = [key for key in ("chain_tokens", "chain_walk", "chain_scout_every",
                                      "guard_modes", "guard")
                      if getattr(self, key) != fields[key].get_default(
                          call_default_factory=True)]
        if guard_keys and not (self.auto_size and self.auto_guard):
            raise ValueError(f"{', '.join(sorted(guard_keys))} configure the throughput "
                             f"guard, which runs with budget \"auto\" (and auto_guard on)")
        return self

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, *, where: str = "graft") -> GraftConfig:
        """Build from user input; errors name the offending key as ``where.key``."""
        try:
            return cls.model_validate(data or {})
        except ValidationError as err:
            raise GraftConfigError(format_validation_error(err, where)) from None

    def effective_thresholds(self, calibrated: tuple[float, ...] | None = None) -> tuple[float, ...]:
        """Explicit thresholds win over the calibration file, which wins over defaults."""
        if self.thresholds is not None:
            return self.thresholds
        if calibrated is not None:
            return calibrated
        if len(self.checkpoints) == len(DEFAULT_THRESHOLDS):
            return DEFAULT_THRESHOLDS
        return tuple(DEFAULT_THRESHOLDS[-1] for _ in self.checkpoints)

    @property
    def context_settings(self) -> ContextRetrievalConfig:
        """The context section in force (its defaults when unset)."""
        return self.context if self.context is not None else ContextRetrievalConfig()

    @property
    def successor_state_file(self) -> str | None:
        """The successor state file, when one is configured and exists already."""
        state = self.successor_state
        return state.path if state is not None and os.path.isfile(state.path) else None

    @property
    def uses_context(self) -> bool:
        """Whether trees get context-copied nodes: by default for the product variant
        only, so the ablation variants keep their published meaning (no copying) unless
        their config has a ``context`` section."""
        if self.context is None:
            return self.variant is Variant.GRAFT
        return self.context.enabled

    @property
    def draft_top_k(self) -> int:
        """Tokens the drafter ranks per node: ``top_k`` for trees, 1 for chains."""
        return 1 if self.variant.chains else self.top_k

    @property
    def draft_candidates(self) -> int:
        """Capacity of the drafted-candidate pool of a full-depth tree."""
        return num_draft_candidates(self.top_k, self.max_depth)


def num_draft_candidates(top_k: int, steps: int) -> int:
    """Candidates after ``steps`` draft steps: top_k at the root, top_k**2 per step after."""
    if steps <= 0:
        return 0
    return top_k + (steps - 1) * top_k * top_k


def format_validation_error(err: ValidationError, where: str) -> str:
    """One line per problem, each naming the full key path."""
    lines = []
    for item in err.errors():
        loc = ".".join(str(p) for p in (where, *item["loc"]))
        msg = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"{loc}: {msg}")
    return "; ".join(lines)
