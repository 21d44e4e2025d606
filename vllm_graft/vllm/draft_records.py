"""The records a drafting round keeps and hands on: the trees waiting for verification
(:class:`PendingTree`), a host tree's sizes and tokens read once (:class:`HostRows`), a
request's whole copy chain kept until decoding passed it (:class:`ShadowChain`), and the
rows each request settled in a step (:class:`SettledRows`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_graft.core.budget import copied_prefix
from vllm_graft.core.hybrid import HybridTree


@dataclass
class PendingTree:
    """A tree sent to the scheduler, waiting for verification (CPU tensors, root first).

    stage / confidence: where drafting stopped and the best-path confidence after each
    draft step (for metrics and calibration). The tensors are rows of the step's batch
    tree (views: every build allocates its own). ``draft_tokens``: ``tokens[1:]`` as the
    scheduler got them, so recognising the tree next step reads no tensor."""

    tokens: torch.Tensor  # [n] int64
    parents: torch.Tensor  # [n]
    depths: torch.Tensor  # [n]
    source: torch.Tensor  # [n] uint8
    stage: int = -1
    confidence: torch.Tensor | None = None  # [max_depth]
    score: torch.Tensor | None = None  # [n] the acceptance model's (HybridTree.score)
    draft_tokens: list[int] | None = None  # None: read from ``tokens``
    chain: bool = False  # known to be a chain (row i's parent is row i - 1)

    def __post_init__(self):
        if self.draft_tokens is None:
            self.draft_tokens = self.tokens[1:].tolist()

    def truncated(self, rows: int) -> PendingTree:
        if rows == self.tokens.numel():
            return self
        return PendingTree(self.tokens[:rows], self.parents[:rows], self.depths[:rows],
                           self.source[:rows], self.stage, self.confidence,
                           None if self.score is None else self.score[:rows],
                           self.draft_tokens[:rows - 1], self.chain)


@dataclass
class HostRows:
    """A host tree's node counts and tokens as Python lists, read once per batch."""

    num_nodes: list[int]
    tokens: list[list[int]]

    @classmethod
    def of(cls, tree: HybridTree) -> HostRows:
        return cls(tree.num_nodes.tolist(), tree.tokens.tolist())


@dataclass
class ShadowChain:
    """A request's whole copy chain (before any cut), kept until decoding has emitted
    every position it proposed: its nodes after the root (tokens, source tags, scores),
    rooted at context position ``root``. ``verified``: its first nodes a chain step
    verified (they taught the acceptance model then)."""

    root: int
    tokens: list[int]
    source: list[int]
    score: list[float]
    verified: int = 0

    def outcome(self, emitted) -> tuple[list[int], list[float], int, int]:
        """What verifying the chain would have accepted, given the tokens decoding
        emitted at its positions (:func:`vllm_graft.core.budget.copied_prefix`), as
        :meth:`AcceptanceModel.observe_chains` takes it: past the ``verified`` nodes."""
        return self.source, self.score, copied_prefix(self.tokens, emitted), self.verified


@dataclass
class SettledRows:
    """Per request: the target rows whose positions became final this step.

    rows: flattened-batch rows in position order; next_tokens: the token at position
    + 1 of each row; first_position / first_token: position and token of rows[0];
    decoding: whether the rows are a decoding step's (one row, or a verified tree's or
    chain's accepted path) rather than a prompt's chunk; a request that does not draft
    next step keeps a decoding step's rows for its next tree, and a prompt's chunk is
    fed at once."""

    batch_row: int
    rows: list[int]
    next_tokens: list[int]
    first_position: int
    first_token: int
    drafts: bool  # whether this request gets a new tree
    decoding: bool = True
