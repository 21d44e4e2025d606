"""``graft_tree_finalize`` on a GPU: every request's hybrid tree in one Triton launch.

Same inputs, outputs and rules as the op's CPU kernel (``csrc/graft_step.cpp``, which
documents them): the best drafted pool slots by score, low-confidence replacement,
template expansion from the successor matrix, the trie merge of the context, drafted,
retrieved and spare candidates, fixed-shape padding, source tags, node scores,
ancestor bits, the matrix rows each row teaches and the build stats.
:func:`graft_tree_finalize_cuda` takes the schema's arguments in the schema's order.

Work split: one program per request (grid ``(B,)``) holds all of that request in its
registers, as vectors over pool slots, ranks, template nodes, candidates or rows;
values move between positions with ``tl.gather`` (the compiler's own shared memory
and barriers), never through a workspace, so a program's threads cannot race.

1. Selection: each pool slot's score and slot packed into one unique int64 key
   (order-preserving score bits above, the slot's complement below: ties go to the
   lower slot, -0.0 ties with 0.0, -inf comes last); ``tl.topk`` of the keys gives the
   ``draft_capacity`` best in rank order. Parent ranks come from a [capacity, capacity]
   comparison of slots; kept, local probabilities and replacement are elementwise.
2. Template expansion: depths by pointer doubling, then one successor-matrix lookup
   per template level (the kernel's only chain of dependent global reads).
3. Candidates (root | context | drafted | retrieved | spare), gathered from the parts.
   A valid candidate merges into the earliest valid one with the same token and depth
   under the same canonical parent. Pointer doubling up each candidate's parents gives
   its validity and a 64-bit hash of its path's (token, depth) pairs, which a merge
   group always shares; one [candidates, block] comparison per block of the hashes
   gives each candidate the first of its hash group, the group's OR-ed source tags
   and max-ed score. That grouping is the rule's unique fixed point when every
   candidate has the token, depth and canonical parent of its group's first (checked
   with three gathers); only a hash collision fails the check, and then the exact
   rule is iterated to its fixed point (a comparison pass per tree level). Ranks of
   the distinct candidates are a prefix sum.
4. Rows: each row's candidate by counting ranks, padding, ancestor bits by pointer
   doubling over the row parents (rows are parents-first), learn rows, the 8 stats.

Steps 1 and 2 and the grouping of step 3 are device functions of
:mod:`vllm_graft.kernels.tree_candidates_triton`.

Rules: the launcher checks shapes, dtypes and devices only (``ValueError`` naming the
op and the argument) and never reads a tensor's values, so it is capturable in a CUDA
graph; the kernel trusts the values as the op's contract says (ids in range, trees
parents-first, a node one deeper than its parent) and reads no memory outside the
tensors whatever they hold (for bad values the result is unspecified). ``stage``,
``tree_tokens``, ``num_nodes`` and ``stats`` may be column slices of a wider buffer
(unit stride along a row). Scores equal the CPU kernel's up to the rounding of ``exp``,
everything else exactly.

Under Triton's interpreter (``TRITON_INTERPRET=1``, the CPU tests) a reduction with a
custom combine runs element by element in Python, so the tags are OR-ed as a max per
bit, ``tl.topk`` (whose sort is such a reduction) dominates the time of a paper-sized
pool, and ``exp`` is ``tl.exp`` (libdevice's elsewhere).
"""

from __future__ import annotations

import math
import os
import struct

import torch
import triton
import triton.language as tl

from vllm_graft.kernels.tree_candidates_triton import (TAG_CONTEXT, TAG_DRAFT, TAG_PAD,
                                                       TAG_RETRIEVED, expand_template,
                                                       merge_groups, select_drafts)

__all__ = ["graft_tree_finalize_cuda"]

OP = "graft_tree_finalize"
#: the multiplier of the path hash (odd) and the mask applied to hashes (tests narrow it
#: to force collisions, which the kernel must resolve exactly)
_HASH_BASE = tl.constexpr(0x5BD1E9955BD1E995)
_HASH_MASK = -1

_STATS_COLUMNS = 8


@triton.jit
def _tree_finalize_kernel(
    roots, pool_tokens, pool_parents, pool_scores, stage, keep_by_stage, retrieval_keep,
    successors, partitions, template_parents, template_ranks, template_scores,
    context_tokens, context_parents, context_depths,
    tree_tokens, tree_parents, tree_depths, tree_valid, tree_source, tree_score,
    num_nodes, ancestor_bits, learn_rows, stats,
    stride_stage, stride_tokens, stride_nodes, stride_stats,
    pool, cap, template_size, context_width, num_candidates, rows, words, full_stage,
    draft_top_k, replace_keep, replace_log, vocab_size, table_rows, succ_k, hash_mask,
    POOL_PAD: tl.constexpr, CAP_PAD: tl.constexpr, T_PAD: tl.constexpr,
    LOG_T: tl.constexpr, N_PAD: tl.constexpr, LOG_N: tl.constexpr, BLOCK: tl.constexpr,
    R_PAD: tl.constexpr, LOG_R: tl.constexpr, W_PAD: tl.constexpr,
    DRAFTS: tl.constexpr, RETRIEVES: tl.constexpr, SPARE: tl.constexpr,
    REPLACES: tl.constexpr, FIXED: tl.constexpr, PARTITIONED: tl.constexpr,
    PRECISE_EXP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    root = tl.load(roots + b)
    if PARTITIONED:
        partition = tl.load(partitions + b)
    else:
        partition = tl.zeros([], tl.int64)
    draft_offset = 1 + context_width
    retrieved_offset = draft_offset + cap  # cap is 0 without a drafter
    spare_offset = retrieved_offset + template_size  # template_size 0 without retrieval

    # ---- the candidate list, as vectors over candidates ----------------------------
    i = tl.arange(0, N_PAD)
    token = tl.where(i == 0, root, -1)
    parent = tl.zeros([N_PAD], tl.int32)
    depth = tl.zeros([N_PAD], tl.int64)
    flag = tl.zeros([N_PAD], tl.int32)
    score = tl.zeros([N_PAD], tl.float32)

    in_context = (i >= 1) & (i < draft_offset)
    at = b * context_width + (i - 1)
    c_token = tl.load(context_tokens + at, mask=in_context, other=-1)
    c_parent = tl.load(context_parents + at, mask=in_context, other=-1)
    c_depth = tl.load(context_depths + at, mask=in_context, other=0)
    token = tl.where(in_context, c_token, token)
    parent = tl.where(in_context, tl.where(c_parent >= 0, c_parent + 1, 0).to(tl.int32),
                      parent)
    depth = tl.where(in_context, c_depth, depth)
    flag = tl.where(in_context, TAG_CONTEXT, flag)
    score = tl.where(in_context, 0.5, score)

    replaced = tl.zeros([], tl.int64)
    row_stage = tl.zeros([], tl.int64)
    if DRAFTS:
        row_stage = tl.load(stage + b * stride_stage)
        (d_token, d_parent, d_depth, d_score, s_token, s_parent, s_depth,
         replaced) = select_drafts(
            pool_tokens, pool_parents, pool_scores, keep_by_stage, row_stage, b, pool, cap,
            full_stage, draft_top_k, replace_keep, replace_log, draft_offset, spare_offset,
            POOL_PAD, CAP_PAD, REPLACES, PRECISE_EXP)
        in_draft = (i >= draft_offset) & (i < retrieved_offset)
        at = tl.minimum(tl.maximum(i - draft_offset, 0), CAP_PAD - 1)
        token = tl.where(in_draft, tl.gather(d_token, at, 0), token)
        parent = tl.where(in_draft, tl.gather(d_parent, at, 0), parent)
        depth = tl.where(in_draft, tl.gather(d_depth, at, 0), depth)
        flag = tl.where(in_draft, TAG_DRAFT, flag)
        score = tl.where(in_draft, tl.gather(d_score, at, 0), score)
        if SPARE:
            in_spare = (i >= spare_offset) & (i < num_candidates)
            at = tl.minimum(tl.maximum(i - spare_offset, 0), CAP_PAD - 1)
            token = tl.where(in_spare, tl.gather(s_token, at, 0), token)
            parent = tl.where(in_spare, tl.gather(s_parent, at, 0), parent)
            depth = tl.where(in_spare, tl.gather(s_depth, at, 0), depth)
            flag = tl.where(in_spare, TAG_DRAFT, flag)
            score = tl.where(in_spare, 0.5, score)

    lookups = tl.zeros([], tl.int64)
    hits = tl.zeros([], tl.int64)
    if RETRIEVES:
        keep = tl.load(retrieval_keep + tl.minimum(tl.maximum(row_stage, 0), full_stage))
        r_token, r_depth = expand_template(
            successors, template_parents, template_ranks, root, partition, template_size,
            vocab_size, table_rows, succ_k, T_PAD, LOG_T)
        t = tl.arange(0, T_PAD)
        r_token = tl.where(t < keep, r_token, -1)
        hits = tl.sum((r_token >= 0).to(tl.int64), axis=0)
        lookups = tl.minimum(keep, template_size)
        in_retrieved = (i >= retrieved_offset) & (i < spare_offset)
        node = i - retrieved_offset
        at = tl.minimum(tl.maximum(node, 0), T_PAD - 1)
        t_parent = tl.load(template_parents + node, mask=in_retrieved, other=-1)
        t_score = tl.load(template_scores + node, mask=in_retrieved, other=0.0)
        token = tl.where(in_retrieved, tl.gather(r_token, at, 0), token)
        t_parent = tl.where(t_parent >= 0, t_parent + retrieved_offset, 0).to(tl.int32)
        parent = tl.where(in_retrieved, t_parent, parent)
        depth = tl.where(in_retrieved, tl.gather(r_depth, at, 0), depth)
        flag = tl.where(in_retrieved, TAG_RETRIEVED, flag)
        score = tl.where(in_retrieved, t_score, score)

    # ---- trie merge ------------------------------------------------------------------
    parent = tl.minimum(tl.maximum(parent, 0), N_PAD - 1)  # in range whatever the input
    present = ((token >= 0) & (i < num_candidates)).to(tl.int32)
    # pointer doubling up each candidate's path (the root excluded): validity (every node
    # on it present) and a hash of the path's (token, depth) pairs, hash = f(node) +
    # X * hash(parent), so that candidates that merge always hash alike
    up = tl.where((i > 0) & (parent > 0), parent, -1)
    ok = present
    path = token * 0x2545F4914F6CDD1D + depth * 0x1B873593 + 0x5851F42D4C957F2D
    power = tl.full([N_PAD], _HASH_BASE, tl.int64)
    steps = tl.zeros([], tl.int32)
    while (tl.max(up, axis=0) >= 0) & (steps < LOG_N):
        has = up >= 0
        above = tl.maximum(up, 0)
        path = tl.where(has, path + power * tl.gather(path, above, 0), path)
        power = tl.where(has, power * tl.gather(power, above, 0), power)
        ok = tl.where(has, ok & tl.gather(ok, above, 0), ok)
        up = tl.where(has, tl.gather(up, above, 0), -1)
        steps += 1
    valid = (ok != 0) & (root >= 0)
    valid = tl.where(i == 0, root >= 0, valid)
    # canonical candidate: the first valid one of the same hash (the root stays alone);
    # source tags OR-ed and scores max-ed over each group
    key = tl.where(valid & (i > 0), path & hash_mask & 0x7FFFFFFFFFFFFFFF, -1 - i)
    count = tl.where(flag == TAG_DRAFT, 1, 0) \
        + tl.where(flag == TAG_RETRIEVED, 1 << 10, 0) \
        + tl.where(flag == TAG_CONTEXT, 1 << 20, 0)
    packed = (score.to(tl.int32, bitcast=True).to(tl.int64) << 32) | count
    canon, merged_flag, merged_score = merge_groups(key, key, key, key, packed, N_PAD,
                                                    BLOCK, False)
    # the hash groups are the merge groups if every candidate has the token, depth and
    # canonical parent of its group's first one (hashes never split a merge group, only
    # a collision may join two); else the exact rule to its fixed point, a pass per
    # tree level from here
    canonical_parent = tl.gather(canon, parent, 0)
    agree = (tl.gather(token, canon, 0) == token) & (tl.gather(depth, canon, 0) == depth) \
        & (tl.gather(canonical_parent, canon, 0) == canonical_parent)
    changed = tl.max((valid & ~agree).to(tl.int32), axis=0) > 0
    passes = tl.zeros([], tl.int32)
    while changed & (passes < N_PAD):
        under = tl.where(valid & (i > 0), tl.gather(canon, parent, 0), -1 - i)
        new_canon, merged_flag, merged_score = merge_groups(
            token, depth, under, key, packed, N_PAD, BLOCK, True)
        changed = tl.max((new_canon != canon).to(tl.int32), axis=0) > 0
        canon = new_canon
        passes += 1
    distinct = (i == 0) | (valid & (canon == i))
    ranks = tl.cumsum(distinct.to(tl.int32), axis=0)  # inclusive: rank + 1
    count = tl.sum(distinct.to(tl.int32), axis=0)
    kept_count = tl.minimum(count, rows)

    # ---- rows ------------------------------------------------------------------------
    r = tl.arange(0, R_PAD)
    in_rows = r < rows
    # the candidate of row r: the (r + 1)-th distinct one
    of_row = tl.zeros([R_PAD], tl.int32)
    for block in range(0, N_PAD // BLOCK):
        j = block * BLOCK + tl.arange(0, BLOCK)
        of_row += tl.sum((tl.gather(ranks, j, 0)[:, None] <= r[None, :]).to(tl.int32),
                         axis=0)
    of_row = tl.minimum(of_row, N_PAD - 1)
    real = r < kept_count
    row_token = tl.gather(token, of_row, 0)
    row_depth = tl.gather(depth, of_row, 0)
    row_parent = tl.gather(ranks, tl.gather(canon, tl.gather(parent, of_row, 0), 0), 0) - 1
    row_parent = tl.where(of_row == 0, -1, row_parent)
    row_source = tl.where(of_row == 0, 0, tl.gather(merged_flag, of_row, 0))
    row_score = tl.gather(merged_score, of_row, 0)
    if FIXED:
        # padding: distinct tokens under the last row (hybrid.pad_to_budget)
        leaf = kept_count - 1
        leaf_token = tl.sum(tl.where(r == leaf, row_token, 0), axis=0)
        leaf_depth = tl.sum(tl.where(r == leaf, row_depth, 0), axis=0)
        pad = in_rows & ~real
        row_token = tl.where(pad, (leaf_token + 1 + (r - kept_count)) % vocab_size,
                             row_token)
        row_parent = tl.where(pad, leaf, row_parent)
        row_depth = tl.where(pad, leaf_depth + 1, row_depth)
        row_source = tl.where(pad, TAG_PAD, row_source)
        row_score = tl.where(pad, 0.0, row_score)
        row_valid = real | pad
        nodes = tl.zeros([], tl.int64) + rows
    else:
        row_valid = real
        nodes = kept_count.to(tl.int64)
    row_token = tl.where(row_valid, row_token, -1)
    row_parent = tl.where(row_valid, row_parent, -1)
    row_depth = tl.where(row_valid, row_depth, 0)
    row_source = tl.where(row_valid, row_source, 0)
    row_score = tl.where(row_valid, row_score, 0.0)

    out = b * rows + r
    tl.store(tree_tokens + b * stride_tokens + r, row_token, mask=in_rows)
    tl.store(tree_parents + out, row_parent.to(tl.int64), mask=in_rows)
    tl.store(tree_depths + out, row_depth, mask=in_rows)
    tl.store(tree_valid + out, row_valid, mask=in_rows)
    tl.store(tree_source + out, row_source.to(tl.uint8), mask=in_rows)
    tl.store(tree_score + out, row_score, mask=in_rows)
    tl.store(num_nodes + b * stride_nodes, nodes)
    learn = tl.where(row_valid & (row_source != TAG_PAD) & (partition >= 0),
                     row_token + partition * vocab_size, -1)
    tl.store(learn_rows + out, learn, mask=in_rows)

    # ancestor bits: pointer doubling, bits(r) |= bits(the 2^s-th ancestor of r)
    w = tl.arange(0, W_PAD)
    own = tl.full([R_PAD], 1, tl.int64) << (r % 64).to(tl.int64)
    bits = tl.where((w[None, :] == (r // 64)[:, None]) & row_valid[:, None], own[:, None],
                    0)
    up = tl.where(row_valid, row_parent, -1).to(tl.int32)
    steps = tl.zeros([], tl.int32)
    while (tl.max(up, axis=0) >= 0) & (steps < LOG_R):
        has = up >= 0
        up_c = tl.minimum(tl.maximum(up, 0), R_PAD - 1)
        above = tl.gather(bits, tl.broadcast_to(up_c[:, None], [R_PAD, W_PAD]), 0)
        bits = bits | tl.where(has[:, None], above, 0)
        up = tl.where(has, tl.gather(up, up_c, 0), -1)
        steps += 1
    tl.store(ancestor_bits + (b * rows + r[:, None]) * words + w[None, :], bits,
             mask=in_rows[:, None] & (w < words)[None, :])

    # stats: drafted, retrieved, both, copied, padding, replaced, lookups, hits
    plain = (row_source | TAG_CONTEXT) ^ TAG_CONTEXT  # the tag without copying
    drafted = tl.sum((row_valid & ((row_source & TAG_DRAFT) != 0)).to(tl.int64), axis=0)
    retrieved = tl.sum((row_valid & (plain == TAG_RETRIEVED)).to(tl.int64), axis=0)
    both = tl.sum((row_valid & (plain == TAG_DRAFT + TAG_RETRIEVED)).to(tl.int64), axis=0)
    copied = tl.sum((row_valid & ((row_source & TAG_CONTEXT) != 0)).to(tl.int64), axis=0)
    padded = tl.sum((row_valid & (row_source == TAG_PAD)).to(tl.int64), axis=0)
    column = tl.arange(0, 8)
    values = tl.where(column == 0, drafted, tl.where(
        column == 1, retrieved, tl.where(column == 2, both, tl.where(
            column == 3, copied, tl.where(column == 4, padded, tl.where(
                column == 5, replaced, tl.where(column == 6, lookups, hits)))))))
    tl.store(stats + b * stride_stats + column, values)


def _fail(message: str):
    raise ValueError(f"{OP}: {message}")


def _check_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    if tensor.dtype != dtype:
        _fail(f"{name} must be {dtype}, got {tensor.dtype}")


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(shape):
        _fail(f"{name} must have shape {list(shape)}, got {list(tensor.shape)}")


def _check_on(name: str, tensor: torch.Tensor, device: torch.device,
              rows_only: bool = False) -> None:
    if tensor.device != device:
        _fail(f"{name} is on {tensor.device} but the batch is on {device}")
    if rows_only:  # [B] or [B, X], rows may be column slices of a wider buffer
        if tensor.dim() == 2 and tensor.shape[1] > 1 and tensor.stride(1) != 1:
            _fail(f"{name} must have unit stride along its rows, got strides "
                  f"{list(tensor.stride())}")
    elif not tensor.is_contiguous():
        _fail(f"{name} must be contiguous")


def _pad(n: int) -> int:
    return max(1, triton.next_power_of_2(n))


def graft_tree_finalize_cuda(
    roots: torch.Tensor, pool_tokens: torch.Tensor, pool_parents: torch.Tensor,
    pool_scores: torch.Tensor, stage: torch.Tensor, keep_by_stage: torch.Tensor,
    retrieval_keep: torch.Tensor, successors: torch.Tensor, partitions: torch.Tensor,
    template_parents: torch.Tensor, template_ranks: torch.Tensor,
    template_scores: torch.Tensor, context_tokens: torch.Tensor,
    context_parents: torch.Tensor, context_depths: torch.Tensor, draft_top_k: int,
    draft_capacity: int, replace_below: float, replace_keep: int, spare: bool,
    fixed_shape: bool, vocab_size: int, tree_tokens: torch.Tensor,
    tree_parents: torch.Tensor, tree_depths: torch.Tensor, tree_valid: torch.Tensor,
    tree_source: torch.Tensor, tree_score: torch.Tensor, num_nodes: torch.Tensor,
    ancestor_bits: torch.Tensor, learn_rows: torch.Tensor, stats: torch.Tensor,
    num_warps: int = 8, block: int = 16,
) -> None:
    """``graft_tree_finalize`` (the schema's arguments, in its order; every output
    written in place) in one launch of one program per request.

    ``num_warps`` / ``block`` (candidates compared per step of the merge, a power of
    two, held by every thread) tune the kernel; the result does not depend on them.

    Raises:
        ValueError: a dtype, shape, layout or device the op does not take, naming it.
    """
    _check_dtype("roots", roots, torch.long)
    if roots.dim() != 1:
        _fail(f"roots must be [B], got {list(roots.shape)}")
    batch = roots.shape[0]
    device = roots.device
    if tree_tokens.dim() != 2 or tree_tokens.shape[0] != batch:
        _fail(f"tree_tokens must be [B, budget + 1], got {list(tree_tokens.shape)}")
    rows = tree_tokens.shape[1]
    budget = rows - 1
    if rows < 1:
        _fail("a tree needs its root row")
    pool = pool_tokens.shape[1] if pool_tokens.dim() == 2 else 0
    drafts = pool > 0
    retrieves = retrieval_keep.numel() > 0
    template_size = template_parents.numel()
    context_width = context_tokens.shape[1] if context_tokens.dim() == 2 else 0
    words = ancestor_bits.shape[2] if ancestor_bits.dim() == 3 else 0
    table_rows = successors.shape[0] if successors.dim() == 2 else 0
    succ_k = successors.shape[1] if successors.dim() == 2 else 0

    _check_dtype("pool_tokens", pool_tokens, torch.long)
    _check_dtype("pool_parents", pool_parents, torch.long)
    _check_dtype("pool_scores", pool_scores, torch.float32)
    if pool_tokens.dim() != 2 or pool_tokens.shape[0] != batch:
        _fail(f"pool_tokens must be [B, pool], got {list(pool_tokens.shape)}")
    _check_shape("pool_parents", pool_parents, pool_tokens.shape)
    _check_shape("pool_scores", pool_scores, pool_tokens.shape)
    _check_dtype("stage", stage, torch.long)
    _check_shape("stage", stage, (batch,))
    _check_dtype("keep_by_stage", keep_by_stage, torch.long)
    _check_dtype("retrieval_keep", retrieval_keep, torch.long)
    if drafts:
        if keep_by_stage.numel() < 1:
            _fail("keep_by_stage is empty")
        if draft_top_k < 1 or draft_top_k > pool:
            _fail(f"draft_top_k {draft_top_k} does not fit a pool of {pool}")
        if not 0 <= draft_capacity <= pool:
            _fail(f"draft_capacity {draft_capacity} outside [0, {pool}]")
    if retrieves:
        if drafts and retrieval_keep.numel() != keep_by_stage.numel():
            _fail(f"retrieval_keep needs one entry per stage ({keep_by_stage.numel()}), "
                  f"got {retrieval_keep.numel()}")
        _check_dtype("successors", successors, torch.int32)
        if successors.dim() != 2 or not successors.is_contiguous():
            _fail("successors must be a contiguous [P * V, k] table")
        if vocab_size < 1 or table_rows % vocab_size:
            _fail(f"{table_rows} table rows are not a whole number of vocabularies of "
                  f"{vocab_size}")
        _check_dtype("template_parents", template_parents, torch.long)
        _check_dtype("template_ranks", template_ranks, torch.long)
        _check_dtype("template_scores", template_scores, torch.float32)
        _check_shape("template_ranks", template_ranks, (template_size,))
        _check_shape("template_scores", template_scores, (template_size,))
    _check_dtype("partitions", partitions, torch.long)
    if partitions.numel() and tuple(partitions.shape) != (batch,):
        _fail(f"partitions must be [B] or empty, got {list(partitions.shape)}")
    for name, tensor in (("context_tokens", context_tokens),
                         ("context_parents", context_parents),
                         ("context_depths", context_depths)):
        _check_dtype(name, tensor, torch.long)
        if context_width > 0:
            _check_shape(name, tensor, (batch, context_width))
    if fixed_shape and budget > vocab_size:
        _fail(f"a fixed-shape tree of {budget} nodes cannot be padded with distinct "
              f"tokens of a vocabulary of {vocab_size}")
    for name, tensor, dtype in (
            ("tree_tokens", tree_tokens, torch.long),
            ("tree_parents", tree_parents, torch.long),
            ("tree_depths", tree_depths, torch.long),
            ("tree_valid", tree_valid, torch.bool),
            ("tree_source", tree_source, torch.uint8),
            ("tree_score", tree_score, torch.float32), ("num_nodes", num_nodes, torch.long),
            ("ancestor_bits", ancestor_bits, torch.long),
            ("learn_rows", learn_rows, torch.long), ("stats", stats, torch.long)):
        _check_dtype(name, tensor, dtype)
    for name, tensor in (("tree_parents", tree_parents), ("tree_depths", tree_depths),
                         ("tree_valid", tree_valid), ("tree_source", tree_source),
                         ("tree_score", tree_score), ("learn_rows", learn_rows)):
        _check_shape(name, tensor, tree_tokens.shape)
    _check_shape("num_nodes", num_nodes, (batch,))
    if words * 64 < rows:
        _fail(f"ancestor_bits must be [B, rows, {(rows + 63) // 64}] int64, got "
              f"{list(ancestor_bits.shape)}")
    _check_shape("ancestor_bits", ancestor_bits, (batch, rows, words))
    _check_shape("stats", stats, (batch, _STATS_COLUMNS))
    for name, tensor in (
            ("pool_tokens", pool_tokens), ("pool_parents", pool_parents),
            ("pool_scores", pool_scores), ("keep_by_stage", keep_by_stage),
            ("retrieval_keep", retrieval_keep), ("successors", successors),
            ("partitions", partitions), ("template_parents", template_parents),
            ("template_ranks", template_ranks), ("template_scores", template_scores),
            ("context_tokens", context_tokens), ("context_parents", context_parents),
            ("context_depths", context_depths), ("tree_parents", tree_parents),
            ("tree_depths", tree_depths), ("tree_valid", tree_valid),
            ("tree_source", tree_source), ("tree_score", tree_score),
            ("ancestor_bits", ancestor_bits), ("learn_rows", learn_rows)):
        _check_on(name, tensor, device)
    for name, tensor in (("stage", stage), ("tree_tokens", tree_tokens),
                         ("num_nodes", num_nodes), ("stats", stats)):
        _check_on(name, tensor, device, rows_only=True)
    if block < 1 or block & (block - 1):
        _fail(f"block must be a power of two, got {block}")
    if batch == 0:
        return

    cap = draft_capacity if drafts else 0
    template_size = template_size if retrieves else 0
    with_spare = bool(spare) and drafts
    num_candidates = 1 + context_width + cap + template_size + (cap if with_spare else 0)
    replaces = drafts and replace_below > 0.0
    # log(replace_below) rounded to float32 once, as the CPU kernel does
    replace_log = struct.unpack("f", struct.pack("f", math.log(replace_below)))[0] \
        if replaces else 0.0
    rows_pad = _pad(rows)
    template_pad = _pad(template_size)
    candidates_pad = _pad(num_candidates)
    block = min(block, candidates_pad)
    _tree_finalize_kernel[(batch,)](
        roots, pool_tokens, pool_parents, pool_scores, stage, keep_by_stage, retrieval_keep,
        successors, partitions, template_parents, template_ranks, template_scores,
        context_tokens, context_parents, context_depths,
        tree_tokens, tree_parents, tree_depths, tree_valid, tree_source, tree_score,
        num_nodes, ancestor_bits, learn_rows, stats,
        stage.stride(0), tree_tokens.stride(0), num_nodes.stride(0), stats.stride(0),
        pool, cap, template_size, context_width, num_candidates, rows, words,
        keep_by_stage.numel() - 1 if drafts else 0, draft_top_k, replace_keep, replace_log,
        vocab_size, table_rows, succ_k, _HASH_MASK,
        POOL_PAD=max(2, _pad(pool)), CAP_PAD=max(2, _pad(cap)),  # tl.topk: k >= 2
        T_PAD=template_pad,
        LOG_T=template_pad.bit_length() - 1, N_PAD=candidates_pad,
        LOG_N=candidates_pad.bit_length() - 1, BLOCK=block,
        R_PAD=rows_pad, LOG_R=rows_pad.bit_length() - 1, W_PAD=_pad(words),
        DRAFTS=drafts, RETRIEVES=retrieves, SPARE=with_spare, REPLACES=replaces,
        FIXED=bool(fixed_shape), PARTITIONED=partitions.numel() > 0,
        PRECISE_EXP=os.environ.get("TRITON_INTERPRET", "0") != "1", num_warps=num_warps,
    )
