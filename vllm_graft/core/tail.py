"""Graft-TAIL: a drafted chain whose unsure tail is replaced by retrieval.

Trees are not always the best shape: where chain verification is cheaper (the fastest
attention kernels at high batch, backends without tree attention) a drafter proposes a
chain. Graft-TAIL keeps the chain's confident prefix and fills the rest of the same
number of slots from the successor matrix.

* **Drafting.** The drafter proposes its top-1 token at each step. After step ``s`` the
  chain's cumulative confidence ``c_s`` (the product of its top-1 probabilities, the
  best-path confidence the tree's checkpoints gate) is compared with the threshold in
  force at ``s``: the calibrated threshold of the latest checkpoint at or before ``s``
  (:func:`step_thresholds`). At the first step below it the request stops drafting and
  that step's token is dropped: it starts the unsure tail. A stopped request costs no
  further drafter forwards.
* **Grafting.** From the last kept token (the root when step 0 was already unsure), the
  successor matrix's top-1 walk continues the chain up to ``length`` tokens
  (:func:`vllm_graft.core.chain.build_chains`); a matrix miss ends the chain early.
* **Verification.** A chain needs no tree attention: the backend's causal attention
  verifies it, and Graft's lossless acceptance (a chain is a tree with one path) decides
  what is accepted, greedy or sampled.

Fixed shapes (CUDA graphs) pad a short chain to ``length`` with ``SOURCE_PAD`` tokens,
each the child of the row before it, so every request verifies the same number of rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_graft.core.chain import build_chains
from vllm_graft.core.draft_tree import DraftPool, DraftStep, Drafter
from vllm_graft.core.hybrid import SOURCE_DRAFT, SOURCE_PAD, HybridTree
from vllm_graft.core.successor import BatchView, SuccessorMatrix


def step_thresholds(checkpoints: tuple[int, ...], thresholds: tuple[float, ...],
                    length: int) -> tuple[float, ...]:
    """The threshold in force at each of ``length`` draft steps: that of the latest
    checkpoint at or before the step, 0 (never stop) before the first checkpoint."""
    if len(checkpoints) != len(thresholds):
        raise ValueError(f"one threshold per checkpoint: {len(checkpoints)} checkpoints, "
                         f"{len(thresholds)} thresholds")
    per_step, current, index = [], 0.0, 0
    for step in range(length):
        while index < len(checkpoints) and checkpoints[index] <= step:
            current, index = float(thresholds[index]), index + 1
        per_step.append(current)
    return tuple(per_step)


@dataclass
class TailDraft:
    """The drafted part of each request's chain.

    tokens: [B, length] the confident prefix, -1 after it
    steps: [B] drafter forwards each request took
    stop_step: [B] the step whose confidence fell below its threshold (``length`` = none)
    confidence: [B, length] cumulative confidence after each step taken, NaN elsewhere
    """

    tokens: torch.Tensor
    steps: torch.Tensor
    stop_step: torch.Tensor
    confidence: torch.Tensor

    @property
    def kept(self) -> torch.Tensor:
        """[B] drafted tokens kept."""
        return (self.tokens >= 0).sum(1)


class TailChainDrafter:
    """Drives a tree drafter (the :data:`~vllm_graft.core.draft_tree.Drafter` callback)
    one node per request per step, in the pool layout of a ``top_k = 1`` draft tree:
    slot ``s`` holds the token of step ``s``, whose parent is slot ``s - 1``."""

    def __init__(self, length: int, thresholds: tuple[float, ...],
                 device: torch.device | str = "cpu"):
        if length < 1 or len(thresholds) != length:
            raise ValueError(f"need length >= 1 and one threshold per step, got {length} "
                             f"and {len(thresholds)}")
        self.length = length
        self.device = torch.device(device)
        self.thresholds = torch.tensor(thresholds, dtype=torch.float32, device=self.device)

    def draft(self, roots: torch.Tensor, drafter: Drafter, *, prune: bool = True) -> TailDraft:
        batch, length, dev = roots.shape[0], self.length, self.device
        pool = DraftPool(
            tokens=torch.full((batch, length), -1, dtype=torch.long, device=dev),
            parents=(torch.arange(length, device=dev) - 1).expand(batch, -1).contiguous(),
            scores=torch.full((batch, length), float("-inf"), device=dev),
            depths=(torch.arange(length, device=dev) + 1).expand(batch, -1).contiguous(),
        )
        steps = torch.zeros(batch, dtype=torch.long, device=dev)
        stop_step = torch.full((batch,), length, dtype=torch.long, device=dev)
        confidence = torch.full((batch, length), float("nan"), device=dev)
        active = torch.arange(batch, device=dev)
        tokens = roots.long().view(batch, 1)
        scores = torch.zeros(batch, device=dev)
        for step in range(length):
            node_ids = torch.full((active.numel(), 1), step - 1, dtype=torch.long, device=dev)
            logprobs, ids = drafter(DraftStep(step=step, active=active, node_ids=node_ids,
                                              tokens=tokens, pool=pool))
            if logprobs.dim() != 3 or logprobs.shape[:2] != (active.numel(), 1) \
                    or ids.shape != logprobs.shape:
                raise ValueError(f"drafter returned {tuple(logprobs.shape)} / "
                                 f"{tuple(ids.shape)} at step {step}, expected "
                                 f"({active.numel()}, 1, k)")
            best, pick = logprobs[:, 0].float().max(dim=-1)
            token = ids[:, 0].gather(1, pick.unsqueeze(1)).squeeze(1).long()
            scores = scores + best.nan_to_num(nan=float("-inf"))
            steps[active] += 1
            confidence[active, step] = scores.exp()
            sure = scores.exp() >= self.thresholds[step] if prune \
                else torch.ones_like(scores, dtype=torch.bool)
            pool.tokens[active[sure], step] = token[sure]
            pool.scores[active[sure], step] = scores[sure]
            stop_step[active[~sure]] = step
            active, tokens, scores = active[sure], token[sure].view(-1, 1), scores[sure]
            if active.numel() == 0:
                break
        return TailDraft(tokens=pool.tokens, steps=steps, stop_step=stop_step,
                         confidence=confidence)

    def from_block(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> TailDraft:
        """The confident prefix of blocks a block drafter (DFlash) proposed in one
        forward: ``tokens`` / ``logprobs`` ``[B, length]``, each position's token and its
        log-probability. The cumulative confidence gates each step as in :meth:`draft`;
        the whole block was drafted, so it costs one forward whatever is kept."""
        batch, length = tokens.shape
        if length != self.length or logprobs.shape != tokens.shape:
            raise ValueError(f"blocks of {self.length} tokens expected, got "
                             f"{tuple(tokens.shape)} tokens and {tuple(logprobs.shape)} "
                             f"log-probabilities")
        confidence = logprobs.float().cumsum(1).nan_to_num(nan=float("-inf")).exp()
        sure = (confidence >= self.thresholds.to(confidence.device)).long().cumprod(1).bool()
        stop_step = torch.where(sure.all(1), length, (~sure).long().argmax(1))
        return TailDraft(tokens=torch.where(sure, tokens.long(), -1),
                         steps=torch.ones(batch, dtype=torch.long, device=tokens.device),
                         stop_step=stop_step, confidence=confidence)


def graft_tail(roots: torch.Tensor, draft: TailDraft, matrix: SuccessorMatrix | BatchView,
               length: int, *, fixed_shape: bool = False, vocab_size: int = 0) -> HybridTree:
    """The chain of each request: its confident drafted prefix, then the matrix's top-1
    walk up to ``length`` tokens; ``fixed_shape`` pads it to exactly ``length``."""
    chain = build_chains(roots, draft.tokens, matrix, length, prefix_source=SOURCE_DRAFT)
    if fixed_shape:
        chain = pad_chain(chain, vocab_size)
    return chain


def pad_chain(chain: HybridTree, vocab_size: int) -> HybridTree:
    """Fill the empty rows after each chain with ``SOURCE_PAD`` tokens, each the child of
    the row before it: token ``(last + 1 + i) mod vocab_size`` for the ``i``-th pad row
    after the chain's last token ``last``. A pad row is an ordinary candidate for
    lossless acceptance (any token may be proposed) and is not learnt from."""
    tokens, valid = chain.tokens, chain.valid
    batch, rows = tokens.shape
    device = tokens.device
    count = valid.sum(1)
    last = tokens.gather(1, (count - 1).clamp(min=0).unsqueeze(1))
    row = torch.arange(rows, device=device).expand(batch, -1)
    pad = ~valid
    offset = (row - count.unsqueeze(1) + 1).clamp(min=1)
    tokens = torch.where(pad, (last + offset) % vocab_size, tokens)
    source = torch.where(pad, SOURCE_PAD, chain.source.long()).to(torch.uint8)
    all_rows = torch.ones_like(valid)
    return HybridTree(
        tokens=tokens, parents=(row - 1).contiguous(), depths=row.contiguous(),
        valid=all_rows, source=source,
        num_nodes=torch.full((batch,), rows, dtype=torch.long, device=device))


__all__ = ["TailChainDrafter", "TailDraft", "graft_tail", "pad_chain", "step_thresholds"]
