"""GraftProposer: vLLM's EAGLE proposer, drafting Graft hybrid trees.

One drafting round per engine step, for the whole batch:

1. **Catch-up.** The EAGLE-3 head runs once, causally, over every position the target
   settled this step (a prefill chunk, or the root plus the accepted tree path), with
   inputs shifted by one token as EAGLE does (row at position ``p`` holds token
   ``p + 1`` and the target's fused hidden state at ``p``). This writes the head's KV
   for those positions and yields, at each request's last row, the distribution of the
   root's children.
2. **Tree steps.** :class:`vllm_graft.core.graft.GraftTreeBuilder` drives the head
   through :meth:`_expand`: each step feeds the frontier nodes of all still-active
   requests as one batch; a node at depth ``d`` is fed at position ``root + d - 1``
   with its parent row's pre-norm hidden state, and attends to the cached prefix plus
   its ancestors' rows (tree attention; those rows' K/V stay in a
   :class:`~vllm_graft.vllm.tree_attention.TreeKVStore`, not in the paged cache).
   Calibrated pruning stops unsure requests early; retrieval fills the freed slots.
3. The flattened trees go to the scheduler as each request's draft tokens, and are
   kept (by request id) for the next step's verification.

The same rounds drive an ordinary draft model (:class:`GraftDraftModelProposer`, e.g.
Qwen2.5-Coder-0.5B for the 1.5B): it reads token ``p`` at position ``p`` instead of
EAGLE's shifted input, and has no hidden-state input.
"""

from __future__ import annotations

import logging

import torch

from vllm.v1.spec_decode.dflash import DFlashProposer
from vllm.v1.spec_decode.draft_model import DraftModelProposer
from vllm.v1.spec_decode.eagle import EagleProposer

from vllm_graft.core.graft import BuildStats
from vllm_graft.vllm.draft_records import HostRows, PendingTree, SettledRows
from vllm_graft.vllm.drafter_forwards import DeferredRows
from vllm_graft.vllm.sampling import plain_decoding_reason
from vllm_graft.vllm.tp_agreement import agree
from vllm_graft.vllm.tree_drafting import GraftTreeDrafting, check_compiled_ops

logger = logging.getLogger(__name__)

__all__ = ["DeferredRows", "GraftDFlashProposer", "GraftDraftModelProposer", "GraftProposer",
           "GraftTreeDrafting", "PendingTree", "SettledRows", "check_compiled_ops"]


class GraftProposer(GraftTreeDrafting, EagleProposer):
    """EAGLE-3 head + successor matrix -> one hybrid tree per request per step.

    EAGLE reads token ``p + 1`` with the target's hidden state at ``p``: the catch-up
    row of position ``p`` carries the next token, and a tree node of depth ``d`` is fed
    at ``root + d - 1`` with its parent row's pre-norm output."""

    EXPANSION_OFFSET = -1
    PREFIX_EXTRA = 0
    USES_HIDDEN = True

    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner)
        self._init_graft(vllm_config, device)

    def _catch_up_inputs(self, settled: SettledRows) -> tuple[list[int], list[int]]:
        first = settled.first_position
        return settled.next_tokens, list(range(first, first + len(settled.rows)))

    def _forward(self, input_ids, positions, hidden):
        return self.model(input_ids=input_ids, positions=positions, hidden_states=hidden,
                          inputs_embeds=None)

    def _top_k(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k over the head's (reduced) vocabulary, ids mapped to the target's."""
        values, ids = self._top_k_of_logits(
            self.model.logits_processor(self.model.lm_head, hidden))
        offsets = getattr(self.model, "draft_id_to_target_id", None)
        if offsets is not None:
            ids = ids + offsets[ids]
        return values, ids


class GraftDraftModelProposer(GraftTreeDrafting, DraftModelProposer):
    """An ordinary draft model (same tokenizer as the target) drafting Graft trees.

    It reads token ``p`` at position ``p``: the catch-up feeds the tokens of the settled
    positions shifted by one (the new root included, the very first position added for
    a fresh prompt), and a tree node of depth ``d`` is fed at ``root + d``."""

    EXPANSION_OFFSET = 0
    PREFIX_EXTRA = 1
    USES_HIDDEN = False

    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner)
        if self.use_heterogeneous_vocab:
            raise ValueError("Graft's draft model must share the target's vocabulary")
        self._init_graft(vllm_config, device)

    def _catch_up_inputs(self, settled: SettledRows) -> tuple[list[int], list[int]]:
        # The first settled position is fed again: after a fresh prompt, a prefix-cache
        # hit or a resume the drafter has not seen it; otherwise it rewrites equal KV.
        first = settled.first_position
        tokens = [settled.first_token, *settled.next_tokens]
        return tokens, list(range(first, first + 1 + len(settled.rows)))

    def _forward(self, input_ids, positions, hidden):
        return self.model(input_ids=input_ids, positions=positions, inputs_embeds=None), None

    def _top_k(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._top_k_of_logits(self.model.compute_logits(hidden))


class GraftDFlashProposer(GraftTreeDrafting, DFlashProposer):
    """vLLM's DFlash block drafter under Graft-TAIL (``"drafter": "dflash"``, variant
    ``tail``).

    vLLM prepares and runs DFlash as usual: one forward proposes a block of ``budget``
    tokens per request. Its sampling keeps each block token's log-probability, and
    :meth:`graft_blocks` keeps each block's confident prefix (cumulative confidence
    against the calibrated thresholds) and continues it with the successor matrix's
    top-1 walk, padded to the block's length. The chains are verified with the
    target's causal attention and Graft's lossless acceptance, and every verified row
    teaches the matrix, as for Graft's own chains."""

    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner)
        if self.use_heterogeneous_vocab:
            raise ValueError("Graft's DFlash drafter must share the target's vocabulary")
        self._init_graft(vllm_config, device)
        self.block_logprobs: torch.Tensor | None = None

    def dummy_run(self, *args, **kwargs) -> None:
        """DFlash's own: its one forward already covers the whole block."""
        return DFlashProposer.dummy_run(self, *args, **kwargs)

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        """Greedy block tokens, and each one's log-probability (what Graft-TAIL gates);
        drafts are deterministic, so Graft's acceptance is exact for sampled requests."""
        logprobs = self.model.compute_logits(hidden_states).float().log_softmax(dim=-1)
        values, ids = logprobs.max(dim=-1)
        self.block_logprobs = values
        return ids, None

    @torch.inference_mode()
    def graft_blocks(self, runner, blocks: torch.Tensor, sampled_token_ids: torch.Tensor
                     ) -> tuple[list[list[int]], BuildStats | None]:
        """Graft-TAIL chains from this step's DFlash blocks: drafts in persistent-batch
        order (none for requests that decode plainly), and the build's facts (None: no
        chain built)."""
        req_ids = runner.input_batch.req_ids
        drafts: list[list[int]] = [[] for _ in req_ids]
        batch, length = blocks.shape
        if length != self.settings.config.budget:  # vLLM asked for another block size
            logger.warning("Graft: DFlash proposed blocks of %d tokens, not %d: decoding "
                           "plainly this step", length, self.settings.config.budget)
            return drafts, None
        sampled = sampled_token_ids[:batch].cpu()
        valid = (sampled >= 0).sum(1)
        rows = []
        for row in range(batch):
            req_state = runner.requests[req_ids[row]]
            if valid[row] == 0 or runner.discard_request_mask.np[row] or plain_decoding_reason(
                    req_state.sampling_params, len(req_state.output_token_ids)) is not None:
                continue
            rows.append(row)
        if not rows:
            return drafts, None
        index = torch.tensor(rows, dtype=torch.long)
        roots = sampled[index, valid[index] - 1].long()
        device_index = index.to(blocks.device)
        logprobs = self.block_logprobs.view(batch, length)[device_index]
        chain, stats = self.tree_builder.build_from_block(
            roots.to(self.device), blocks[device_index], logprobs,
            self.partitions(runner, [req_ids[row] for row in rows]))
        chain = agree(chain.to("cpu"))  # the ranks of a tensor-parallel engine verify one
        stages, confidence = stats.stage.tolist(), stats.confidence.cpu()
        host_rows = HostRows.of(chain)
        for t, row in enumerate(rows):
            self._schedule(chain, host_rows, t, req_ids[row], row, drafts, stages[t],
                           confidence[t], chain=True)
        return drafts, stats
