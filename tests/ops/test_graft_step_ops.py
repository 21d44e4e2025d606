"""The fused Graft step ops as torch custom ops: ``torch.library.opcheck`` on real
inputs (schema and its mutation annotations, fake tensors, autograd registration, AOT
dispatch), and clear errors for bad input that name the op and the argument.
Their results are compared with the pure-torch path in tests/core/test_fused.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from vllm_graft import ops
from vllm_graft.core import fused
from vllm_graft.core.config import GraftConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_core  # noqa: E402

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="no CUDA device")),
]
VOCAB = 700


def _step(device: str, batch: int = 3, tree_shape: str = "fixed"):
    cfg = GraftConfig(budget=24, tree_shape=tree_shape, checkpoints=(0, 1, 5),
                      draft_keep=(4, 8, 16))
    builder, drafter, roots = bench_core.build_inputs(batch, VOCAB, "compiled", cfg, device,
                                                      fused_ops=True)
    buffers = builder.fused.build(roots, drafter, successors=builder.matrix.table)
    logits = bench_core.steer_logits(buffers.tree(), VOCAB, batch, seed=1)
    return builder, drafter, roots, buffers, logits


def _draft_args(builder, drafter, roots, buffers, step: int):
    from vllm_graft.core.draft_tree import DraftPool, DraftStep

    batch = roots.shape[0]
    ids, tokens = (torch.full((batch, 1), -1, device=roots.device), roots.view(batch, 1)) \
        if step == 0 else (buffers.frontier_ids, buffers.frontier_tokens)
    pool = DraftPool(buffers.pool_tokens, buffers.pool_parents, buffers.pool_scores,
                     builder.fused.slot_depths.expand(batch, -1))
    logprobs, child_tokens = drafter(DraftStep(step, torch.arange(batch), ids, tokens, pool))
    recipe = builder.fused.recipe
    return (logprobs, child_tokens, recipe.thresholds, step,
            builder.fused.checkpoint_of_step.get(step, -1), buffers.pool_tokens,
            buffers.pool_parents, buffers.pool_scores, buffers.frontier_ids,
            buffers.frontier_tokens, buffers.frontier_scores, buffers.lineage, buffers.going,
            buffers.stage, buffers.steps, buffers.confidence)


def _finalize_args(builder, roots, buffers, **overrides):
    recipe = builder.fused.recipe
    empty = torch.empty((roots.shape[0], 0), dtype=torch.long, device=roots.device)
    args = dict(roots=roots, pool_tokens=buffers.pool_tokens, pool_parents=buffers.pool_parents,
                pool_scores=buffers.pool_scores, stage=buffers.stage,
                keep_by_stage=recipe.keep_by_stage, retrieval_keep=recipe.retrieval_keep,
                successors=builder.matrix.table,
                partitions=torch.empty(0, dtype=torch.long, device=roots.device),
                template_parents=recipe.template_parents, template_ranks=recipe.template_ranks,
                template_scores=recipe.template_scores, context_tokens=empty,
                context_parents=empty, context_depths=empty, draft_top_k=recipe.top_k,
                draft_capacity=recipe.draft_capacity, replace_below=recipe.replace_below,
                replace_keep=recipe.replace_keep, spare=recipe.spare,
                fixed_shape=recipe.fixed_shape, vocab_size=recipe.vocab_size)
    args.update({name: getattr(buffers, name) for name in ops.TREE_OUTPUTS})
    args.update(overrides)
    return tuple(args.values())


def _accept_args(builder, buffers, logits, sampled: bool):
    batch, rows = buffers.tree_valid.shape
    flat = logits.view(-1, VOCAB)
    row_topk = ops.logits_topk(flat, builder.matrix.k, buffers.row_index.reshape(-1))
    outs = tuple(getattr(buffers, name) for name in ops.ACCEPT_OUTPUTS)
    tree = (buffers.tree_tokens, buffers.tree_parents, buffers.tree_valid, buffers.tree_source)
    if not sampled:
        return (*tree, row_topk, buffers.learn_rows, VOCAB, builder.matrix.table, *outs)
    device = flat.device
    buffers.uniforms.uniform_()
    return (flat, buffers.row_index, *tree, torch.full((batch,), 0.9, device=device),
            torch.full((batch,), 5, dtype=torch.long, device=device),
            torch.full((batch,), 0.95, device=device), buffers.uniforms, row_topk,
            buffers.learn_rows, VOCAB, builder.matrix.table, *outs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("step", [0, 1, 5])
def test_opcheck_draft_step(device, step):
    builder, drafter, roots, buffers, _ = _step(device)
    for earlier in range(step):  # the state a real build has at this step
        ops.graft_draft_step(*_draft_args(builder, drafter, roots, buffers, earlier))
    torch.library.opcheck(torch.ops.vllm_graft.graft_draft_step.default,
                          _draft_args(builder, drafter, roots, buffers, step))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tree_shape", ["dynamic", "fixed"])
def test_opcheck_tree_finalize(device, tree_shape):
    builder, _, roots, buffers, _ = _step(device, tree_shape=tree_shape)
    torch.library.opcheck(torch.ops.vllm_graft.graft_tree_finalize.default,
                          _finalize_args(builder, roots, buffers))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_opcheck_acceptance(device, sampled):
    builder, _, _, buffers, logits = _step(device)
    op = torch.ops.vllm_graft.graft_accept_sampled.default if sampled \
        else torch.ops.vllm_graft.graft_accept_greedy.default
    torch.library.opcheck(op, _accept_args(builder, buffers, logits, sampled))


def test_bad_inputs_are_refused_naming_the_op_and_the_argument():
    builder, drafter, roots, buffers, logits = _step("cpu")
    args = list(_draft_args(builder, drafter, roots, buffers, 1))
    args[1] = args[1][:, :2]  # tokens of another shape
    with pytest.raises(RuntimeError, match="graft_draft_step: tokens must have shape"):
        ops.graft_draft_step(*args)
    args = list(_draft_args(builder, drafter, roots, buffers, 0))
    args[0] = args[0].expand(-1, 2, -1)
    with pytest.raises(RuntimeError, match="graft_draft_step: step 0 expands 1 nodes"):
        ops.graft_draft_step(*args)
    with pytest.raises(RuntimeError, match="graft_tree_finalize: tree_valid must be"):
        torch.ops.vllm_graft.graft_tree_finalize.default(*_finalize_args(
            builder, roots, buffers, tree_valid=buffers.tree_valid.long()))
    with pytest.raises(RuntimeError, match="graft_tree_finalize: ancestor_bits must be"):
        torch.ops.vllm_graft.graft_tree_finalize.default(*_finalize_args(
            builder, roots, buffers, ancestor_bits=buffers.ancestor_bits[:, :, :0]))
    with pytest.raises(RuntimeError, match="graft_tree_finalize: context node 1 of request 0 "
                                           "has parent 3 after it"):
        context = torch.tensor([[5, 6], [-1, -1], [-1, -1]])
        torch.ops.vllm_graft.graft_tree_finalize.default(*_finalize_args(
            builder, roots, buffers, context_tokens=context,
            context_parents=torch.tensor([[-1, 3], [-1, -1], [-1, -1]]),
            context_depths=torch.tensor([[1, 2], [0, 0], [0, 0]])))
    args = list(_accept_args(builder, buffers, logits, sampled=False))
    args[4] = args[4][:, :3]  # row_topk with another k than the matrix
    with pytest.raises(RuntimeError, match="graft_accept_greedy: successors has k = 8, "
                                           "row_topk 3"):
        torch.ops.vllm_graft.graft_accept_greedy.default(*args)
    args = list(_accept_args(builder, buffers, logits, sampled=True))
    args[9] = args[9][:, :1]  # uniforms for too few levels
    with pytest.raises(RuntimeError, match="graft_accept_sampled: uniforms must have shape"):
        torch.ops.vllm_graft.graft_accept_sampled.default(*args)


def test_a_bad_learned_id_leaves_the_matrix_untouched():
    builder, _, _, buffers, logits = _step("cpu")
    args = list(_accept_args(builder, buffers, logits, sampled=False))
    before = builder.matrix.table.clone()
    args[4] = args[4].clone()
    args[4][-1, 0] = VOCAB + 5  # the last learned row names a token past the vocabulary
    buffers.learn_rows[-1, -1] = 3
    with pytest.raises(ValueError, match=r"graft_accept_greedy: row_topk\[\d+, 0\] = 705 is "
                                         r"out of range \[0, 700\)"):
        torch.ops.vllm_graft.graft_accept_greedy.default(*args)
    assert torch.equal(builder.matrix.table, before)


def test_a_tree_deeper_than_the_walk_bound_is_an_error():
    builder, _, _, buffers, logits = _step("cpu")
    # a target that accepts every first child: the walk reaches the trees' full depth
    top = torch.zeros(buffers.tree_valid.numel(), builder.matrix.k, dtype=torch.long)
    tokens, parents = buffers.tree_tokens, buffers.tree_parents
    for b in range(tokens.shape[0]):
        for row in range(tokens.shape[1] - 1, 0, -1):
            top[b * tokens.shape[1] + int(parents[b, row]), 0] = int(tokens[b, row])
    out = {name: getattr(buffers, name) for name in ops.ACCEPT_OUTPUTS}
    out["accepted_rows"] = out["accepted_rows"][:, :1]
    out["output_tokens"] = out["output_tokens"][:, :2]
    with pytest.raises(RuntimeError, match="deeper than the 1 levels of accepted_rows"):
        ops.graft_accept_greedy(tokens, parents, buffers.tree_valid, buffers.tree_source, top,
                                buffers.learn_rows, VOCAB, builder.matrix.table, out)


def test_step_buffers_refuse_a_batch_they_do_not_hold():
    builder, _, _, buffers, _ = _step("cpu")
    with pytest.raises(ValueError, match="a step of 9 requests does not fit buffers for 3"):
        builder.fused.buffers.view(9)
    assert isinstance(buffers, fused.StepBuffers)
