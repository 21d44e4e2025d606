"""One Graft step for a batch: draft (with pruning), retrieve, merge; then learn.

:class:`GraftTreeBuilder` is the whole algorithm minus the models: the caller brings a
drafter callback and the target's logits at every tree row, and gets back a tree per
request (tensors padded to ``budget + 1`` rows) to verify and, after verification, an
updated successor matrix. The variant switches parts off for the ablations
(``dense_tree``, ``prune_only``, ``retrieval_only``); ``tail`` builds Graft-TAIL chains
instead of trees (:mod:`vllm_graft.core.tail`).

Tree shapes (``GraftConfig.tree_shape``, resolved by
:func:`vllm_graft.core.config.resolve_tree_shape`):

* **dynamic**: the paper's tree: the drafted nodes kept at the stage where drafting
  stopped, then ``budget - draft_keep + retrieval_slack`` retrieved candidates; the
  first ``budget`` distinct nodes are kept, so retrieval misses and merges (and
  ``prune_only``) leave slots empty and requests verify different numbers of rows.
* **fixed** (the SGLang batch variant of the paper): every request's tree has exactly
  ``budget`` nodes besides the root, so every request schedules the same number of
  draft tokens. Candidates, in priority order (the trie merge keeps the first
  ``budget`` distinct ones):

  1. the drafted nodes kept at the request's stage. For a request that drafted to full
     depth (no checkpoint stopped it), drafted nodes whose path confidence
     ``exp(score)`` is below the last calibrated threshold ``tau_last`` are *replaced*
     by retrieved ones, but the best ``draft_keep[-1]`` drafted nodes always stay: an
     unpruned tree then has the layout of the last prune point (e.g. 40 drafted + 20
     retrieved of 60) unless the drafter is confident about more nodes. Scores never
     increase along a path, so the replacement removes whole subtrees and the kept
     drafted set stays prefix-closed. Only the ``graft`` variant replaces (the others
     have no retrieval, or no calibrated gate); thresholds of 0 replace nothing.
  2. the whole retrieval template (``budget + retrieval_slack`` nodes) for every
     request, in template order: the nodes the dynamic tree would use come first, the
     rest refill what misses and merges freed;
  3. the drafter's spare candidates (``graft`` only): the best ``budget`` drafted
     candidates regardless of the stage's keep (those already in the tree merge into
     themselves), i.e. nodes the drafter proposed before it stopped, or the
     low-confidence nodes of step 1. ``prune_only`` does not use them, so its freed
     slots hold padding and the ablation keeps its meaning;
  4. padding (:func:`vllm_graft.core.hybrid.pad_to_budget`): distinct tokens under the
     last leaf, tagged ``SOURCE_PAD``, harmless for lossless acceptance and not learnt
     from.

  All of it is batched tensor work (the only loops run over tree depth), deterministic
  and device-agnostic. Where retrieval and drafting fill the budget, the fixed tree of
  a pruned request is the dynamic one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_graft.core.acceptance import AcceptanceResult, tree_row_topk
from vllm_graft.core.config import GraftConfig, TreeShape, Variant, resolve_tree_shape
from vllm_graft.core.draft_tree import DraftTree, DraftTreeBuilder, Drafter
from vllm_graft.core.fused import STATS_COLUMNS, FusedTreeBuild, TreeRecipe
from vllm_graft.core.hybrid import (SOURCE_BOTH, SOURCE_CONTEXT, SOURCE_DRAFT, SOURCE_PAD,
                                    SOURCE_RETRIEVED, HybridTree, merge_and_flatten,
                                    pad_to_budget)
from vllm_graft.core.successor import SuccessorMatrix
from vllm_graft.core.tail import TailChainDrafter, graft_tail, step_thresholds
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
    context_nodes: [B] nodes copied from the request's context (whatever else proposed
           them too); draft_nodes, retrieved_nodes and both_nodes count nodes of any
           context tag
    padded_nodes: [B] padding nodes of a fixed-shape tree (0 for dynamic trees)
    replaced_nodes: [B] drafted nodes a fixed-shape tree moved behind retrieval for low
           confidence (some come back as spare candidates if retrieval falls short)
    """

    stage: torch.Tensor
    draft_steps: torch.Tensor
    draft_nodes: torch.Tensor
    retrieved_nodes: torch.Tensor
    both_nodes: torch.Tensor
    retrieval_lookups: torch.Tensor
    retrieval_hits: torch.Tensor
    confidence: torch.Tensor
    context_nodes: torch.Tensor
    padded_nodes: torch.Tensor
    replaced_nodes: torch.Tensor


class GraftTreeBuilder:
    """Builds one hybrid tree per request (see the module docstring).

    tree_shape: the *resolved* shape, ``resolve_tree_shape(config.tree_shape,
    cuda_graphs_enabled)``; ``None`` resolves ``config.tree_shape`` as if CUDA graphs
    were off (``auto`` -> dynamic). ``fixed_shape`` says which one is in force.

    wait_free: a build with no read of the device (the tree variants; on a GPU, what a
    CUDA graph can capture): the draft tree keeps every request to the full depth
    (:meth:`DraftTreeBuilder.build`) and the merge takes a depth bound known from the
    parts' shapes, not read from their depths. The same trees, for more drafter rows.

    fused: build with the fused ops (:mod:`vllm_graft.core.fused`: one op per draft
    depth and one for the rest) rather than the pure-torch path, which stays the
    reference; default: with the compiled ops backend, for tree variants. The trees
    are the same (``tests/core/test_fused.py``).
    """

    def __init__(self, config: GraftConfig, matrix: SuccessorMatrix,
                 thresholds: tuple[float, ...] | None = None,
                 device: torch.device | str = "cpu",
                 tree_shape: TreeShape | str | None = None, score_nodes: bool = False,
                 wait_free: bool = False, fused: bool | None = None):
        self.config = config
        self.wait_free = wait_free
        self.score_nodes = score_nodes
        self.matrix = matrix
        self.device = torch.device(device)
        variant = config.variant
        self.thresholds = thresholds if thresholds is not None else config.effective_thresholds()
        self.tree_shape = resolve_tree_shape(
            config.tree_shape if tree_shape is None else tree_shape, cuda_graphs_enabled=False)
        self.fixed_shape = self.tree_shape is TreeShape.FIXED
        if self.fixed_shape and matrix.vocab_size < config.budget:
            raise ValueError(
                f"graft.tree_shape 'fixed' needs budget ({config.budget}) <= vocabulary size "
                f"({matrix.vocab_size}) to pad trees with distinct tokens")
        # Fixed shape, unpruned trees: drafted nodes below the last threshold make room
        # for retrieved ones, down to the last prune point's draft_keep.
        self.replace_below = None
        if self.fixed_shape and variant is Variant.GRAFT and config.checkpoints:
            self.replace_below = float(self.thresholds[-1])
            self.replace_keep = int(config.draft_keep[-1])
        self.drafter_tree = None
        self.tail_drafter = None
        self.fused = None
        if variant.chains:  # Graft-TAIL: no tree drafting, no template
            self.tail_drafter = TailChainDrafter(
                config.budget, step_thresholds(config.checkpoints, tuple(self.thresholds),
                                               config.budget), self.device)
            self.expander = None
            return
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
            elif self.fixed_shape:  # every request may use the whole template
                per_stage = [config.budget] * (len(config.draft_keep) + 1)
            else:
                per_stage = [config.budget - keep for keep in config.draft_keep] + [0]
            self.retrieval_keep = torch.tensor(per_stage, dtype=torch.long,
                                               device=self.device) + config.retrieval_slack
            template = RetrievalTemplate.best_first(
                max(per_stage) + config.retrieval_slack, config.rank_prior,
                max_depth=config.retrieval_depth, max_width=config.retrieval_width)
            self.expander = TemplateExpander(template, self.device)
            self.retrieval_scores = rank_score(torch.tensor(template.ranks, device=self.device))
        if fused is None:
            fused = config.ops_backend == "compiled"
        self.fused = FusedTreeBuild(self._recipe(), self.device) if fused else None

    @property
    def context_width(self) -> int:
        """How wide the context parts the engine passes are (``graft.context.max_nodes``,
        0 without context): the depth bound of fused acceptance assumes no wider."""
        config = self.config
        return config.context_settings.max_nodes if config.uses_context else 0

    def _recipe(self) -> TreeRecipe:
        """This builder's settings as the fused ops take them."""
        config, device = self.config, self.device
        empty = torch.empty(0, dtype=torch.long, device=device)
        draft = self.drafter_tree
        template = self.expander.template if self.expander is not None else None
        return TreeRecipe(
            budget=config.budget,
            top_k=config.top_k if draft is not None else 0,
            max_depth=config.max_depth if draft is not None else 0,
            checkpoint_steps=tuple(draft.checkpoint_index) if draft is not None else (),
            thresholds=draft.thresholds if draft is not None
            else torch.empty(0, device=device),
            keep_by_stage=draft.keep_by_stage if draft is not None else empty,
            draft_capacity=draft.capacity if draft is not None else 0,
            retrieval_keep=self.retrieval_keep if template is not None else empty,
            template_parents=torch.tensor(template.parents, dtype=torch.long,
                                          device=device) if template else empty,
            template_ranks=torch.tensor(template.ranks, dtype=torch.long,
                                        device=device) if template else empty,
            template_scores=self.retrieval_scores.float() if template is not None
            else torch.empty(0, device=device),
            replace_below=self.replace_below or 0.0,
            replace_keep=self.replace_keep if self.replace_below is not None else 0,
            spare=self.fixed_shape and config.variant is Variant.GRAFT,
            fixed_shape=self.fixed_shape,
            vocab_size=self.matrix.vocab_size,
            successor_k=self.matrix.k,
            levels=self.depth_bound(self.context_width))

    @property
    def full_stage(self) -> int:
        """``BuildStats.stage`` of a request that drafted to full depth."""
        return len(self.config.checkpoints)

    @property
    def rows(self) -> int:
        """Rows per request in the verified tree: the root plus ``budget`` slots."""
        return self.config.budget + 1

    def build(self, root_tokens: torch.Tensor, drafter: Drafter | None = None,
              context: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
              partitions: torch.Tensor | None = None) -> tuple[HybridTree, BuildStats]:
        """root_tokens: [B] last accepted token of each request. context: nodes copied
        from each request's own context (:func:`vllm_graft.core.context.proposals_to_tensors`:
        tokens, parents, depths ``[B, n]``, -1 padded); they come first in the merge, so
        the budget cut falls on the lowest-priority retrieved nodes. partitions: [B] the
        matrix partition each request retrieves from (:mod:`vllm_graft.core.isolation`;
        ``None``: partition 0 for all)."""
        batch = root_tokens.shape[0]
        matrix = self.matrix.for_batch(partitions)
        root_tokens = root_tokens.to(self.device).long()
        if self.tail_drafter is not None:
            return self._build_tail(root_tokens, drafter, matrix)
        if self.fused is not None:
            return self._build_fused(root_tokens, drafter, context, partitions)
        parts = []
        if context is not None:
            tokens, parents, depths = (part.to(self.device) for part in context)
            parts.append((tokens, parents, depths, SOURCE_CONTEXT))
        replaced = torch.zeros(batch, dtype=torch.long, device=self.device)
        if self.drafter_tree is not None:
            if drafter is None:
                raise ValueError(f"variant {self.config.variant.value!r} needs a drafter")
            draft = self.drafter_tree.build(root_tokens, drafter,
                                            prune=self.config.variant.prunes,
                                            wait_free=self.wait_free)
            kept_tokens, kept_parents = draft.tokens, draft.parents
            if self.replace_below is not None:
                kept_tokens, kept_parents, replaced = self._replace_low_confidence(draft)
            parts.append((kept_tokens, kept_parents, draft.depths, SOURCE_DRAFT,
                          local_probability(draft) if self.score_nodes else None))
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
            retrieved = self.expander.expand(matrix, root_tokens, keep)
            parts.append((retrieved.tokens, retrieved.parents, retrieved.depths,
                          SOURCE_RETRIEVED, self.retrieval_scores.expand(batch, -1)
                          if self.score_nodes else None))
            lookups = keep.clamp(max=self.expander.size)
            hits = (retrieved.tokens >= 0).sum(1)
        if self.fixed_shape and self.config.variant is Variant.GRAFT:
            # spare drafted candidates (the kept ones merge into their first copies)
            parts.append((draft.candidate_tokens, draft.candidate_parents,
                          draft.candidate_depths, SOURCE_DRAFT))
        bound = self.depth_bound(0 if context is None else context[0].shape[1]) \
            if self.wait_free else None  # otherwise the merge reads the depth
        tree = merge_and_flatten(root_tokens, parts, self.config.budget, bound)
        if self.fixed_shape:
            tree = pad_to_budget(tree, self.matrix.vocab_size)
        return tree, self._stats(tree, stage, steps, lookups, hits, confidence, replaced)

    def _build_fused(self, roots: torch.Tensor, drafter: Drafter | None, context,
                     partitions: torch.Tensor | None) -> tuple[HybridTree, BuildStats]:
        """:meth:`build` with the fused ops; the tree and stats are copies of the
        step buffers, which the next build overwrites."""
        if self.drafter_tree is not None and drafter is None:
            raise ValueError(f"variant {self.config.variant.value!r} needs a drafter")
        if context is not None:
            context = tuple(part.to(self.device).long().contiguous() for part in context)
        if partitions is not None:
            partitions = partitions.to(self.device).long().contiguous()
        # on a CPU, reading who drafts on at each checkpoint costs nothing and spares
        # the drafter the stopped requests' rows; on a GPU it is a wait for the host
        compact = not self.wait_free and self.device.type == "cpu"
        buffers = self.fused.build(roots.contiguous(), drafter, context, partitions,
                                   self.matrix.table, compact=compact)
        tree = buffers.tree(with_score=self.score_nodes)
        tree = HybridTree(**{f: None if getattr(tree, f) is None else getattr(tree, f).clone()
                             for f in ("tokens", "parents", "depths", "valid", "source",
                                       "num_nodes", "score")})
        return tree, self._fused_stats(buffers)

    def _fused_stats(self, buffers) -> BuildStats:
        """The :class:`BuildStats` of a fused build (copies)."""
        batch = buffers.stats.shape[0]
        counts = dict(zip(STATS_COLUMNS, buffers.stats.clone().unbind(1)))
        if self.drafter_tree is not None:
            stage = buffers.stage.clone() if self.config.variant.prunes else \
                torch.full((batch,), self.full_stage, dtype=torch.long, device=self.device)
            steps, confidence = buffers.steps.clone(), buffers.confidence.clone()
        else:
            stage = torch.full((batch,), -1, dtype=torch.long, device=self.device)
            steps = torch.zeros(batch, dtype=torch.long, device=self.device)
            confidence = torch.full((batch, self.config.max_depth), float("nan"),
                                    device=self.device)
        return BuildStats(stage=stage, draft_steps=steps, confidence=confidence, **counts)

    def depth_bound(self, context_width: int = 0) -> int:
        """The deepest node a tree of this builder can hold, from what the host knows:
        the draft tree's depth, the template's, a context part's width (a chain of ``n``
        nodes is at most ``n`` deep), and one level of padding in a fixed-shape tree
        (:func:`pad_to_budget`); a Graft-TAIL chain's length. A bound for the wait-free
        merge and acceptance walk."""
        if self.tail_drafter is not None:
            return self.config.budget
        deepest = max(context_width,
                      self.config.max_depth if self.drafter_tree is not None else 0,
                      max(self.expander.template.depths, default=0)
                      if self.expander is not None else 0)
        return deepest + 1 if self.fixed_shape else deepest

    def _build_tail(self, roots: torch.Tensor, drafter: Drafter | None,
                    matrix) -> tuple[HybridTree, BuildStats]:
        """Graft-TAIL (:mod:`vllm_graft.core.tail`): one chain of ``budget`` tokens per
        request. ``stage`` is the checkpoint whose threshold stopped the drafting (the
        latest one at or before the stopping step), ``len(checkpoints)`` if none did."""
        if drafter is None:
            raise ValueError("variant 'tail' needs a drafter")
        return self._tail_chain(roots, self.tail_drafter.draft(roots, drafter), matrix)

    def build_from_block(self, root_tokens: torch.Tensor, block_tokens: torch.Tensor,
                         block_logprobs: torch.Tensor, partitions: torch.Tensor | None = None
                         ) -> tuple[HybridTree, BuildStats]:
        """Graft-TAIL on a block drafter (DFlash): each request's block of ``budget``
        tokens (``[B, budget]``, with each token's log-probability) keeps its confident
        prefix, and retrieval grafts the rest (:meth:`TailChainDrafter.from_block`).
        Chains are padded to exactly ``budget`` tokens whatever the tree shape: a block
        drafter's verification has one shape."""
        if self.tail_drafter is None:
            raise ValueError("blocks are grafted by variant 'tail' only")
        roots = root_tokens.to(self.device).long()
        draft = self.tail_drafter.from_block(block_tokens.to(self.device),
                                             block_logprobs.to(self.device))
        return self._tail_chain(roots, draft, self.matrix.for_batch(partitions),
                                fixed_shape=True)

    def _tail_chain(self, roots: torch.Tensor, draft, matrix, fixed_shape: bool | None = None
                    ) -> tuple[HybridTree, BuildStats]:
        length = self.config.budget
        fixed = self.fixed_shape if fixed_shape is None else fixed_shape
        chain = graft_tail(roots, draft, matrix, length, fixed_shape=fixed,
                           vocab_size=self.matrix.vocab_size)
        checkpoints = torch.tensor(self.config.checkpoints, dtype=torch.long,
                                   device=self.device)
        stopped = draft.stop_step < length
        stage = torch.where(
            stopped, torch.searchsorted(checkpoints, draft.stop_step, right=True) - 1,
            self.full_stage)
        # the walk looks up each retrieved token, and one more where a miss ended it
        walked = (chain.valid & (chain.source == SOURCE_RETRIEVED)).sum(1)
        lookups = torch.minimum(walked + 1, length - draft.kept)
        stats = self._stats(chain, stage, draft.steps, lookups, walked, draft.confidence,
                            torch.zeros_like(draft.steps))
        return chain, stats

    def _replace_low_confidence(self, draft: DraftTree
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Drop the drafted nodes of unpruned requests whose path confidence is below the
        last threshold, keeping at least the best ``draft_keep[-1]`` (module docstring).
        Returns (tokens, parents, number dropped per request)."""
        capacity = draft.tokens.shape[1]
        position = torch.arange(capacity, device=self.device)[None, :]
        unpruned = (draft.stage == self.full_stage)[:, None]
        low = draft.scores < math.log(self.replace_below) if self.replace_below > 0 \
            else torch.zeros_like(draft.valid)
        drop = draft.valid & unpruned & low & (position >= self.replace_keep)
        return (torch.where(drop, -1, draft.tokens), torch.where(drop, -1, draft.parents),
                drop.sum(1))

    @staticmethod
    def _stats(tree: HybridTree, stage: torch.Tensor, steps: torch.Tensor,
               lookups: torch.Tensor, hits: torch.Tensor,
               confidence: torch.Tensor, replaced: torch.Tensor) -> BuildStats:
        source = tree.source
        plain = source & (0xFF ^ SOURCE_CONTEXT)  # the tags besides context
        valid = tree.valid
        return BuildStats(
            stage=stage,
            draft_steps=steps,
            retrieval_lookups=lookups,
            retrieval_hits=hits,
            confidence=confidence,
            draft_nodes=(valid & (source & SOURCE_DRAFT).bool()).sum(1),
            retrieved_nodes=(valid & (plain == SOURCE_RETRIEVED)).sum(1),
            both_nodes=(valid & (plain == (SOURCE_DRAFT | SOURCE_RETRIEVED))).sum(1),
            context_nodes=(valid & (source & SOURCE_CONTEXT).bool()).sum(1),
            padded_nodes=(valid & (source == SOURCE_PAD)).sum(1),
            replaced_nodes=replaced,
        )

    def observe(self, tree: HybridTree, target_logits: torch.Tensor,
                row_topk: torch.Tensor | None = None) -> None:
        """Learn from a verification: every valid row writes the target's top-k at that
        row into its token's matrix row (accepted and rejected rows alike); padding rows
        of fixed-shape trees (``SOURCE_PAD``) are skipped.

        target_logits: [B, N+1, V]; row_topk: [B, N+1, k] the target's top-k at every
        valid row when the caller already has it (:func:`tree_row_topk`, also the source
        of greedy acceptance), so the vocabulary is read once per row. Rows are written
        in flat (request, row) order, so when one token occurs at several rows the last
        one wins, on every device.
        """
        tokens = learnable_tokens(tree).reshape(-1)
        next_tokens = None if row_topk is None else row_topk.reshape(tokens.numel(), -1)
        self.matrix.update_from_logits_(tokens, target_logits.reshape(tokens.numel(), -1),
                                        next_tokens=next_tokens)

    def target_topk(self, tree: HybridTree, target_logits: torch.Tensor) -> torch.Tensor:
        """[B, N+1, successor_k] the target's top-k at every valid row of ``tree``: what
        :meth:`observe` writes, and (column 0) what greedy acceptance follows."""
        return tree_row_topk(tree, target_logits, self.matrix.k, self.matrix.backend)


def local_probability(draft: DraftTree) -> torch.Tensor:
    """``[B, capacity]`` each drafted node's probability under the drafter given its
    parent (its cumulative score less its parent's), 0 where invalid: the score the
    acceptance model buckets drafted nodes by (:attr:`HybridTree.score`)."""
    parent = draft.scores.gather(1, draft.parents.clamp(min=0))
    parent = torch.where(draft.parents >= 0, parent, 0.0)
    return torch.where(draft.valid, (draft.scores - parent).exp(), 0.0).clamp(0.0, 1.0)


def rank_score(ranks: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + rank)``: the score of a retrieved node that is its parent's
    ``rank``-th successor in the matrix (the top successor scores 1)."""
    return 1.0 / (1.0 + ranks.float())


def learnable_tokens(tree: HybridTree) -> torch.Tensor:
    """[B, N+1] the tokens the successor matrix learns from, -1 elsewhere: valid rows
    that are not padding (``SuccessorMatrix.update_from_logits_`` skips -1)."""
    return torch.where(tree.valid & (tree.source != SOURCE_PAD), tree.tokens, -1)


#: the class :func:`accepted_by_source` counts a node of each tag value in (bits 1, 2, 4
#: and 8): a context-copied node is ``context`` whatever else proposed it too
_ACCEPTED_CLASS_OF_TAG = [
    "context" if tag & SOURCE_CONTEXT else
    {SOURCE_DRAFT: "draft", SOURCE_RETRIEVED: "retrieved", SOURCE_BOTH: "both",
     SOURCE_PAD: "padding"}.get(tag) for tag in range(2 * SOURCE_CONTEXT)]


def accepted_by_source(tree: HybridTree, result: AcceptanceResult) -> dict[str, int]:
    """How many accepted drafts came from the drafter, retrieval, both, the context or
    padding: one class per node, a context-copied node counting as ``context`` whatever
    else proposed it too. Counted on the host over Python lists: a step's accepted paths
    are a few dozen nodes, fewer than the tensor ops a batched count would take."""
    return count_accepted_sources(tree.source.tolist(), result.accepted_rows.tolist())


def count_accepted_sources(tags: list[list[int]], accepted_rows: list[list[int]]
                           ) -> dict[str, int]:
    """:func:`accepted_by_source` over host lists: each tree's node tags and its accepted
    rows (-1 after the last)."""
    counts = dict.fromkeys(("context", "draft", "retrieved", "both", "padding"), 0)
    for tree_tags, rows in zip(tags, accepted_rows):
        for row in rows:
            name = _ACCEPTED_CLASS_OF_TAG[tree_tags[row]] if row >= 0 else None
            if name is not None:
                counts[name] += 1
    return counts


__all__ = ["BuildStats", "DraftTree", "GraftTreeBuilder", "accepted_by_source",
           "count_accepted_sources",
           "learnable_tokens", "local_probability", "rank_score"]
