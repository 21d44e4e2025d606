"""Tree verification inside vLLM's V1 model runner: the hooks the patches call.

The patches in :mod:`vllm_graft.vllm.patches` call into this module at four points of
a runner step:

* after ``_prepare_inputs``: :func:`prepare_tree_verification` recognises the requests
  whose scheduled drafts are the tree Graft proposed last step, gives each tree row its
  position and builds the tree attention plan (:mod:`~vllm_graft.vllm.tree_verification`);
* around the target forward (the ``_model_forward`` patch): the plan is active;
* instead of the rejection sampler: :func:`sample_contained` runs lossless tree
  acceptance, moves the accepted rows' KV into contiguous slots in every layer, and
  lets every verified row teach the successor matrix
  (:mod:`~vllm_graft.vllm.tree_sampling`, :mod:`~vllm_graft.vllm.matrix_learning`);
* instead of the EAGLE drafting call: :func:`propose_with_trees`
  (:mod:`~vllm_graft.vllm.step_drafting`).

Start-up's profile run verifies one full step of trees here
(:func:`profile_tree_step`).
"""

from __future__ import annotations

import logging
import math

import torch

from vllm_graft.vllm.proposer import GraftProposer
from vllm_graft.vllm.step_drafting import (propose_nothing, propose_with_blocks,
                                           propose_with_trees, settled_rows)
from vllm_graft.vllm.tree_sampling import sample_contained, sample_with_trees
from vllm_graft.vllm.tree_verification import (TREE_OBSERVERS, GraftStats, GraftStep,
                                               VerifiedTree, is_chain,
                                               prepare_tree_verification)

logger = logging.getLogger(__name__)

__all__ = ["TREE_OBSERVERS", "GraftStats", "GraftStep", "VerifiedTree", "is_chain",
           "prepare_tree_verification", "profile_tree_step", "propose_nothing",
           "propose_with_blocks", "propose_with_trees", "sample_contained",
           "sample_with_trees", "settled_rows"]


def profile_tree_step(runner, hidden_states: torch.Tensor) -> dict[str, int]:
    """A full verification step of trees in vLLM's start-up profile run, so the KV cache
    is sized around what serving trees needs besides it: the target's logits at every
    row a step of trees can verify (``max_num_seqs`` trees of ``budget + 1`` rows, at
    most ``max_num_batched_tokens``), their top-k, and the fused step's buffers for
    ``max_num_seqs`` requests (allocated here and kept). Returns, and keeps as
    ``runner._graft_profile``, the rows and bytes it allocated."""
    drafter: GraftProposer = runner.drafter
    config = drafter.settings.config
    max_seqs = runner.scheduler_config.max_num_seqs
    rows = min(runner.scheduler_config.max_num_batched_tokens, max_seqs * (config.budget + 1))
    hidden = torch.rand((rows, hidden_states.shape[-1]), dtype=hidden_states.dtype,
                        device=hidden_states.device)
    logits = runner.model.compute_logits(hidden)
    top = drafter.matrix.target_topk(logits)
    buffer_bytes = 0
    fused = drafter.tree_builder.fused
    if fused is not None:
        buffers = fused.reserve(max_seqs)
        buffer_bytes = sum(value.numel() * value.element_size()
                           for value in vars(buffers).values()
                           if isinstance(value, torch.Tensor))
        _run_fused_ops_once(drafter, max_seqs, logits)
    profile = {"rows": rows, "logits_bytes": logits.numel() * logits.element_size(),
               "topk_bytes": top.numel() * top.element_size(), "buffer_bytes": buffer_bytes}
    runner._graft_profile = profile
    logger.info("Graft: profiled a step of trees at %d requests: %d verified rows, logits "
                "%.1f MiB, top-k %.1f MiB, step buffers %.1f MiB", max_seqs, rows,
                profile["logits_bytes"] / 2**20, profile["topk_bytes"] / 2**20,
                buffer_bytes / 2**20)
    del hidden, logits, top
    return profile


def _run_fused_ops_once(drafter: GraftProposer, batch: int, logits: torch.Tensor) -> None:
    """Every fused op once, on the engine's device at ``batch`` requests, within the
    start-up profile: an op that refuses this engine's shapes, dtypes or device stops
    start-up naming itself, and GPU kernels compile now rather than in a served step.
    The drafter's answers are uniform over the first ``top_k`` tokens; the matrix learns
    nothing (the learned rows are cleared)."""
    from vllm_graft.core import fused as fused_step

    fused = drafter.tree_builder.fused
    recipe = fused.recipe
    device = logits.device
    k = max(recipe.top_k, 1)

    def uniform(step):
        shape = (step.tokens.shape[0], step.tokens.shape[1], k)
        return (torch.full(shape, -math.log(k), device=device),
                torch.arange(k, device=device).expand(shape).contiguous())

    context = None
    if drafter.uses_context:
        width = drafter.context_config.max_nodes
        empty = torch.full((batch, width), -1, dtype=torch.long, device=device)
        context = (empty, empty, torch.zeros_like(empty))
    matrix = drafter.matrix
    buffers = fused.build(torch.zeros(batch, dtype=torch.long, device=device),
                          uniform if recipe.max_depth else None, context,
                          successors=matrix.table)
    buffers.learn_rows.fill_(-1)
    rows = buffers.row_index.clamp(max=logits.shape[0] - 1)
    fused_step.accept_greedy(buffers, logits, matrix.table, matrix.vocab_size, rows)
    sampling = fused_step.SamplingTensors(
        temperature=torch.ones(batch, device=device),
        top_k=torch.zeros(batch, dtype=torch.long, device=device),
        top_p=torch.full((batch,), 0.9, device=device))
    fused_step.accept_sampled(buffers, logits, sampling, matrix.table, matrix.vocab_size, rows)
