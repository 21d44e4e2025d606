"""One Graft step for a batch: draft (with pruning), retrieve, merge; then learn.

:class:`GraftTreeBuilder` is the whole algorithm minus the models: the caller brings a
drafter callback and the target's logits at every tree row, and gets back a fixed-shape
tree to verify and, after verification, an updated successor matrix. The variant
switches parts off for the ablations (``dense_tree``, ``prune_only``,
``retrieval_only``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_graft.core.acceptance import AcceptanceResult
from vllm_graft.core.config import GraftConfig, Variant
from vllm_graft.core.draft_tree import DraftTree, DraftTreeBuilder, Drafter
from vllm_graft.core.hybrid import (SOURCE_DRAFT, SOURCE_RETRIEVED, HybridTree,
                                    merge_and_flatten)
from vllm_graft.core.successor import SuccessorMatrix
from vllm_graft.core.templates import RetrievalTemplate, TemplateExpander


@dataclass
class BuildStats:
    """Per-request facts about one built tree (for metrics).

    stage: [B] checkpoint index where drafting stopped; ``len(checkpoints)`` = drafted to
           full depth; -1 = no drafting (retrieval_only)
    draft_steps: [B] drafter forwards; draft_nodes / retrieved_nodes / both_nodes: [B]
    retrieval_lookups / retrieval_hits: [B] template nodes looked up in the matrix, and
           how many found a successor (the matrix hit rate)
    confidence: [B, max_depth] best-path confidence after each draft step (NaN = not
           reached; all NaN without a drafter)
    """

    stage: torch.Tensor
    draft_steps: torch.Tensor
    draft_nodes: torch.Tensor
    retrieved_nodes: torch.Tensor
    both_nodes: torch.Tensor
    retrieval_lookups: torch.Tensor
    retrieval_hits: torch.Tensor
    confidence: torch.Tensor


class GraftTreeBuilder:
    def __init__(self, config: GraftConfig, matrix: SuccessorMatrix,
                 thresholds: tuple[float, ...] | None = None,
                 device: torch.device | str = "cpu"):
        self.config = config
        self.matrix = matrix
        self.device = torch.device(device)
        variant = config.variant
        self.thresholds = thresholds if thresholds is not None else config.effective_thresholds()
        self.drafter_tree = None
        if variant.drafts:
            pruning = variant.prunes
            self.drafter_tree = DraftTreeBuilder(
                top_k=config.top_k, max_depth=config.max_depth,
                checkpoints=config.checkpoints if pruning else (),
                draft_keep=config.draft_keep if pruning else (),
                thresholds=tuple(self.thresholds) if pruning else (),
                full_keep=config.budget, device=self.device)
        # Retrieval budget per stage (index = DraftTree.stage; last = not pruned), plus
        # slack that refills slots freed when a retrieved node merges into a draft node.
        self.expander = None
        if variant.retrieves:
            if variant is Variant.RETRIEVAL_ONLY:
                per_stage = [config.budget]
            else:
                per_stage = [config.budget - keep for keep in config.draft_keep] + [0]
            self.retrieval_keep = torch.tensor(per_stage, dtype=torch.long,
                                               device=self.device) + config.retrieval_slack
            template = RetrievalTemplate.best_first(
                int(self.retrieval_keep.max()), config.rank_prior,
                max_depth=config.retrieval_depth, max_width=config.retrieval_width)
            self.expander = TemplateExpander(template, self.device)

    @property
    def full_stage(self) -> int:
        """``BuildStats.stage`` of a request that drafted to full depth."""
        return len(self.config.checkpoints)

    @property
    def rows(self) -> int:
        """Rows per request in the verified tree: the root plus ``budget`` slots."""
        return self.config.budget + 1

    def build(self, root_tokens: torch.Tensor,
              drafter: Drafter | None = None) -> tuple[HybridTree, BuildStats]:
        """root_tokens: [B] last accepted token of each request."""
        batch = root_tokens.shape[0]
        root_tokens = root_tokens.to(self.device).long()
        parts = []
        if self.drafter_tree is not None:
            if drafter is None:
                raise ValueError(f"variant {self.config.variant.value!r} needs a drafter")
            draft = self.drafter_tree.build(root_tokens, drafter,
                                            prune=self.config.variant.prunes)
            parts.append((draft.tokens, draft.parents, draft.depths, SOURCE_DRAFT))
            steps = draft.steps
            stage = draft.stage if self.config.variant.prunes else torch.full(
                (batch,), self.full_stage, dtype=torch.long, device=self.device)
            confidence = draft.confidence
        else:
            draft = None
            stage = torch.full((batch,), -1, dtype=torch.long, device=self.device)
            steps = torch.zeros(batch, dtype=torch.long, device=self.device)
            confidence = torch.full((batch, self.config.max_depth), float("nan"),
                                    device=self.device)
        lookups = hits = torch.zeros(batch, dtype=torch.long, device=self.device)
        if self.expander is not None:
            keep = self.retrieval_keep[draft.stage] if draft is not None \
                else self.retrieval_keep[:1].expand(batch)
            retrieved = self.expander.expand(self.matrix, root_tokens, keep)
            parts.append((retrieved.tokens, retrieved.parents, retrieved.depths,
                          SOURCE_RETRIEVED))
            lookups = keep.clamp(max=self.expander.size)
            hits = (retrieved.tokens >= 0).sum(1)
        tree = merge_and_flatten(root_tokens, parts, self.config.budget)
        return tree, self._stats(tree, stage, steps, lookups, hits, confidence)

    @staticmethod
    def _stats(tree: HybridTree, stage: torch.Tensor, steps: torch.Tensor,
               lookups: torch.Tensor, hits: torch.Tensor,
               confidence: torch.Tensor) -> BuildStats:
        source = tree.source
        valid = tree.valid
        return BuildStats(
            stage=stage,
            draft_steps=steps,
            retrieval_lookups=lookups,
            retrieval_hits=hits,
            confidence=confidence,
            draft_nodes=(valid & (source & SOURCE_DRAFT).bool()).sum(1),
            retrieved_nodes=(valid & (source == SOURCE_RETRIEVED)).sum(1),
            both_nodes=(valid & (source == (SOURCE_DRAFT | SOURCE_RETRIEVED))).sum(1),
        )

    def observe(self, tree: HybridTree, target_logits: torch.Tensor) -> None:
        """Learn from a verification: every valid row writes the target's top-k at that
        row into its token's matrix row (accepted and rejected rows alike).

        target_logits: [B, N+1, V]. Rows are written in flat (request, row) order, so
        when one token occurs at several rows the last one wins, on every device.
        """
        tokens = torch.where(tree.valid, tree.tokens, -1).reshape(-1)
        self.matrix.update_from_logits_(tokens, target_logits.reshape(tokens.numel(), -1))


def accepted_by_source(tree: HybridTree, result: AcceptanceResult) -> dict[str, int]:
    """How many accepted drafts came from the drafter, retrieval, or both."""
    rows = result.accepted_rows
    hit = rows >= 0
    source = tree.source.gather(1, rows.clamp(min=0))[hit]
    return {
        "draft": int((source == SOURCE_DRAFT).sum()),
        "retrieved": int((source == SOURCE_RETRIEVED).sum()),
        "both": int((source == (SOURCE_DRAFT | SOURCE_RETRIEVED)).sum()),
    }


__all__ = ["BuildStats", "DraftTree", "GraftTreeBuilder", "accepted_by_source"]
