"""EAGLE-2/3 style dynamic draft tree with calibrated early stopping, batched.

Each draft step expands the ``top_k`` best frontier nodes of every active request by
``top_k`` children each; a candidate's score is the cumulative draft log-probability of
its path. All candidates are kept in a pool with a fixed layout (step 0 fills slots
``[0, top_k)``, step ``s >= 1`` fills ``top_k**2`` slots after that), and at the end the
best ``keep`` candidates of each request are selected. Scores never increase along a
path and ties are broken by pool index (parents precede children), so the selection is
prefix-closed without any repair.

Pruning (ECHO / Graft): after a checkpoint step ``d`` the best path's confidence
``c_d = exp(max score at step d)`` is compared with ``tau_d``; a request below it stops
drafting and keeps its best ``draft_keep[i]`` candidates. Stopped requests are dropped
from later drafter calls, which is where the draft compute is saved.

Learning which requests go on is a wait for the host at each checkpoint on a GPU, and
a build that waits cannot be captured in a CUDA graph. ``build(..., wait_free=True)``
keeps every request in every drafter call to the full depth instead and masks what a
stopped request drafts after its stop: the same tree for a drafter that answers each
request on its own, more drafter rows, and no host read.

The drafter is a callback, so an EAGLE-3 head, a draft model or a test double can
drive the same builder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from vllm_graft.core.config import num_draft_candidates


@dataclass
class DraftPool:
    """Every drafted candidate so far. Slot ``c`` of request ``b``:

    tokens[b, c]  proposed token id (-1 = empty)
    parents[b, c] pool slot of the parent (-1 = the root)
    scores[b, c]  cumulative draft log-prob (-inf = empty)
    depths[b, c]  tree depth (root's children = 1)
    """

    tokens: torch.Tensor  # [B, C] int64
    parents: torch.Tensor  # [B, C] int64
    scores: torch.Tensor  # [B, C] float32
    depths: torch.Tensor  # [B, C] int64


@dataclass
class DraftStep:
    """What the drafter is asked to expand at one step.

    step:     0-based draft step; the nodes it proposes sit at tree depth step + 1
    active:   [A] batch indices of the requests still drafting
    node_ids: [A, W] pool slots of the nodes to expand (-1 = the root, at step 0)
    tokens:   [A, W] their tokens; -1 marks an empty frontier slot (a request whose
              previous step had fewer than top_k finite candidates): its children are
              discarded, so the drafter may return anything for it
    pool:     the whole pool, for the drafter's tree attention over ancestors
    """

    step: int
    active: torch.Tensor
    node_ids: torch.Tensor
    tokens: torch.Tensor
    pool: DraftPool


#: ``drafter(step) -> (logprobs [A, W, top_k], token_ids [A, W, top_k])``: the drafter's
#: top_k next-token log-probs (target vocabulary ids) for each node it was asked about.
Drafter = Callable[[DraftStep], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class DraftTree:
    """Selected draft nodes per request, parents-first, padded to ``capacity``.

    tokens / parents (index into this tree, -1 = root) / depths / scores: [B, capacity]
    valid:  [B, capacity] bool
    stage:  [B] index of the checkpoint where drafting stopped, len(checkpoints) = never
    steps:  [B] draft steps (drafter forwards) each request took
    confidence: [B, max_depth] ``exp(best path score)`` after each draft step, NaN for
            steps a request did not take (what the pruning gate compares, recorded for
            calibration)
    candidate_tokens / candidate_parents / candidate_depths: [B, capacity] the same
            ranking before the stage's ``keep`` cut: the best ``capacity`` drafted
            candidates whatever the stage (-1 / -1 / 0 where none). The kept nodes are
            its first ``valid.sum(1)`` entries; fixed-shape trees use the rest as
            spare candidates.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    valid: torch.Tensor
    stage: torch.Tensor
    steps: torch.Tensor
    confidence: torch.Tensor
    candidate_tokens: torch.Tensor | None = None
    candidate_parents: torch.Tensor | None = None
    candidate_depths: torch.Tensor | None = None


class DraftTreeBuilder:
    def __init__(self, *, top_k: int, max_depth: int, checkpoints: tuple[int, ...] = (),
                 draft_keep: tuple[int, ...] = (), thresholds: tuple[float, ...] = (),
                 full_keep: int, device: torch.device | str = "cpu"):
        if not (len(checkpoints) == len(draft_keep) == len(thresholds)):
            raise ValueError("checkpoints, draft_keep and thresholds must have equal lengths")
        self.top_k = top_k
        self.max_depth = max_depth
        self.checkpoint_index = {cp: i for i, cp in enumerate(checkpoints)}
        self.device = torch.device(device)
        # keep_by_stage[stage]: nodes kept by a request that stopped at that stage
        self.keep_by_stage = torch.tensor([*draft_keep, full_keep], dtype=torch.long,
                                          device=self.device)
        self.thresholds = torch.tensor(thresholds, dtype=torch.float32, device=self.device)
        self.pool_size = num_draft_candidates(top_k, max_depth)
        # a request never keeps more nodes than it can draft (e.g. top_k 1: a chain)
        self.capacity = min(max((*draft_keep, full_keep)), self.pool_size)

    def _step_slots(self, step: int) -> tuple[int, int]:
        start = num_draft_candidates(self.top_k, step)  # candidates of steps < step
        return start, start + (self.top_k if step == 0 else self.top_k * self.top_k)

    def build(self, root_tokens: torch.Tensor, drafter: Drafter, *,
              prune: bool = True, wait_free: bool = False) -> DraftTree:
        """``wait_free``: the build of the module docstring without host reads (every
        request stays in ``DraftStep.active``; a stopped one's frontier tokens are -1)."""
        if wait_free:
            return self._build_wait_free(root_tokens, drafter, prune)
        batch, k = root_tokens.shape[0], self.top_k
        pool, stage, steps, active, node_ids, node_tokens, node_scores, confidence = \
            self._start(root_tokens)

        for step in range(self.max_depth):
            if active.numel() == 0:
                break
            child_tokens, scores = self._expand(drafter, DraftStep(
                step=step, active=active, node_ids=node_ids, tokens=node_tokens, pool=pool),
                node_scores)
            steps[active] += 1
            start, end = self._step_slots(step)
            pool.tokens[active, start:end] = child_tokens
            pool.parents[active, start:end] = node_ids.repeat_interleave(k, dim=1)
            pool.scores[active, start:end] = scores
            pool.depths[active, start:end] = step + 1
            best_path = scores.max(dim=1).values.exp()  # confidence of the best path
            confidence[active, step] = best_path

            if prune and step in self.checkpoint_index:
                index = self.checkpoint_index[step]
                stops = best_path < self.thresholds[index]
                stage[active] = torch.where(stops, index, stage[active])
                # the checkpoint's one wait for the host: which requests go on
                going = torch.nonzero(~stops).squeeze(1)
                active, scores = active[going], scores[going]
            if active.numel() == 0 or step + 1 == self.max_depth:
                break
            # frontier of the next step: the top_k best candidates of this step
            node_scores, best = scores.topk(min(k, scores.shape[1]), dim=1)
            node_ids = best + start
            node_tokens = pool.tokens[active].gather(1, node_ids)

        return self._select(pool, stage, steps, confidence)

    def _expand(self, drafter: Drafter, step: DraftStep, node_scores: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter call on ``step``'s frontier: its children's tokens and their
        path scores (``node_scores`` plus the child's log-prob, NaN as -inf), both
        ``[rows, width * top_k]``, in the pool's slot order."""
        logprobs, child_tokens = drafter(step)
        rows, width = step.node_ids.shape
        if logprobs.shape != (rows, width, self.top_k) or child_tokens.shape != logprobs.shape:
            raise ValueError(
                f"drafter returned {tuple(logprobs.shape)} / {tuple(child_tokens.shape)} "
                f"at step {step.step}, expected ({rows}, {width}, {self.top_k})")
        scores = (node_scores.unsqueeze(-1) + logprobs.float()).reshape(rows, -1)
        return (child_tokens.reshape(rows, -1).long(),
                scores.nan_to_num(nan=float("-inf"), neginf=float("-inf")))

    def _start(self, root_tokens: torch.Tensor) -> tuple:
        """A build's state before its first step: an empty pool, every request at the
        full stage with no steps, all of them active, the roots as the frontier."""
        batch, dev = root_tokens.shape[0], self.device
        pool = DraftPool(
            tokens=torch.full((batch, self.pool_size), -1, dtype=torch.long, device=dev),
            parents=torch.full((batch, self.pool_size), -1, dtype=torch.long, device=dev),
            scores=torch.full((batch, self.pool_size), float("-inf"), device=dev),
            depths=torch.zeros((batch, self.pool_size), dtype=torch.long, device=dev))
        return (pool,
                torch.full((batch,), len(self.keep_by_stage) - 1, dtype=torch.long, device=dev),
                torch.zeros(batch, dtype=torch.long, device=dev),
                torch.arange(batch, device=dev),
                torch.full((batch, 1), -1, dtype=torch.long, device=dev),
                root_tokens.long().view(batch, 1),
                torch.zeros((batch, 1), device=dev),
                torch.full((batch, self.max_depth), float("nan"), device=dev))

    def _build_wait_free(self, root_tokens: torch.Tensor, drafter: Drafter,
                         prune: bool) -> DraftTree:
        """:meth:`build` with every request in every step: ``going`` masks what a
        stopped request drafts, in place of dropping it from the batch."""
        batch, k = root_tokens.shape[0], self.top_k
        pool, stage, steps, active, node_ids, node_tokens, node_scores, confidence = \
            self._start(root_tokens)
        going = torch.ones(batch, dtype=torch.bool, device=self.device)

        for step in range(self.max_depth):
            child_tokens, scores = self._expand(drafter, DraftStep(
                step=step, active=active, node_ids=node_ids, tokens=node_tokens, pool=pool),
                node_scores)
            steps += going
            kept = going.unsqueeze(1)
            scores = scores.masked_fill(~kept, float("-inf"))
            start, end = self._step_slots(step)
            pool.tokens[:, start:end] = torch.where(kept, child_tokens, -1)
            pool.parents[:, start:end] = torch.where(
                kept, node_ids.repeat_interleave(k, dim=1), -1)
            pool.scores[:, start:end] = scores
            pool.depths[:, start:end] = torch.where(kept, step + 1, 0)
            best_path = scores.max(dim=1).values.exp()
            confidence[:, step] = torch.where(going, best_path, float("nan"))
            if prune and step in self.checkpoint_index:
                index = self.checkpoint_index[step]
                stops = going & (best_path < self.thresholds[index])
                stage = torch.where(stops, index, stage)
                going = going & ~stops
            if step + 1 == self.max_depth:
                break
            node_scores, best = scores.topk(min(k, scores.shape[1]), dim=1)
            node_ids = best + start
            node_tokens = torch.where(going.unsqueeze(1), pool.tokens.gather(1, node_ids), -1)

        return self._select(pool, stage, steps, confidence)

    def _select(self, pool: DraftPool, stage: torch.Tensor, steps: torch.Tensor,
                confidence: torch.Tensor) -> DraftTree:
        """Best ``keep_by_stage[stage]`` candidates of each request, parents-first."""
        batch, cap = pool.tokens.shape[0], self.capacity
        order = torch.sort(pool.scores, dim=1, descending=True, stable=True).indices[:, :cap]
        scores = pool.scores.gather(1, order)
        keep = self.keep_by_stage[stage]
        # The ranking is prefix-closed (a parent's score is >= its child's and ties go
        # to the lower pool slot), so both the first ``cap`` finite candidates and the
        # first ``keep`` of them contain the parents of their members.
        candidate = torch.isfinite(scores)
        valid = (torch.arange(cap, device=self.device)[None, :] < keep[:, None]) & candidate
        # position of each pool slot in the ranking (-1 = not ranked)
        position = torch.full_like(pool.parents, -1)
        position.scatter_(1, order, torch.where(
            candidate, torch.arange(cap, device=self.device).expand(batch, -1), -1))
        parent_slots = pool.parents.gather(1, order)
        parents = torch.where(parent_slots >= 0,
                              position.gather(1, parent_slots.clamp(min=0)), -1)
        ranked_tokens = pool.tokens.gather(1, order)
        ranked_depths = pool.depths.gather(1, order)
        return DraftTree(
            tokens=torch.where(valid, ranked_tokens, -1),
            parents=torch.where(valid, parents, -1),
            depths=torch.where(valid, ranked_depths, 0),
            scores=torch.where(valid, scores, float("-inf")),
            valid=valid,
            stage=stage,
            steps=steps,
            confidence=confidence,
            candidate_tokens=torch.where(candidate, ranked_tokens, -1),
            candidate_parents=torch.where(candidate, parents, -1),
            candidate_depths=torch.where(candidate, ranked_depths, 0),
        )
