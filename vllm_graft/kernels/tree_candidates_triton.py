"""The candidates of ``graft_tree_finalize``'s Triton kernel, as device functions (the
kernel and its launcher: :mod:`vllm_graft.kernels.tree_finalize_triton`, whose docstring
gives the steps in order).

* :func:`select_drafts` (step 1): the best drafted pool slots in rank order, their
  parents' ranks, local probabilities and low-confidence replacement, as the drafted
  and spare parts of the candidate list.
* :func:`expand_template` (step 2): the retrieved part, the template's tokens looked up
  in the successor matrix level by level.
* :func:`merge_groups` (step 3): for every candidate the first of its merge group, the
  group's OR-ed source tags (``TAG_*``, as :mod:`vllm_graft.core.hybrid` tags nodes) and
  max-ed score.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = ["TAG_CONTEXT", "TAG_DRAFT", "TAG_PAD", "TAG_RETRIEVED", "expand_template",
           "merge_groups", "select_drafts"]

# source tags (vllm_graft.core.hybrid)
TAG_DRAFT = tl.constexpr(1)
TAG_RETRIEVED = tl.constexpr(2)
TAG_PAD = tl.constexpr(4)
TAG_CONTEXT = tl.constexpr(8)


@triton.jit
def merge_groups(token, depth, under, key, packed, N_PAD: tl.constexpr,
                 BLOCK: tl.constexpr, EXACT: tl.constexpr):
    # For every candidate, the first candidate of its group and the group's tags OR-ed
    # and scores max-ed (at least 0, as the CPU kernel starts from 0). A group: the same
    # key, or (EXACT) the same token, depth and canonical parent (``under``, unique
    # negative for an invalid candidate). One [BLOCK, N_PAD] comparison per block.
    # packed: a candidate's score bits above, below its tag as a count in one of three
    # 10-bit fields (drafted, retrieved, copied), so that one sum per block counts the
    # members of each kind (a block has fewer than 1024 members).
    i = tl.arange(0, N_PAD)
    first = i
    tags = tl.zeros([N_PAD], tl.int32)
    best = tl.zeros([N_PAD], tl.float32)
    for block in range(0, N_PAD // BLOCK):
        # [BLOCK, N_PAD] tiles: a thread holds a whole block column, so the reductions
        # over the block stay in its registers
        j = block * BLOCK + tl.arange(0, BLOCK)
        if EXACT:
            same = (tl.gather(token, j, 0)[:, None] == token[None, :]) \
                & (tl.gather(depth, j, 0)[:, None] == depth[None, :]) \
                & (tl.gather(under, j, 0)[:, None] == under[None, :])
        else:
            same = tl.gather(key, j, 0)[:, None] == key[None, :]
        first = tl.minimum(first, tl.min(tl.where(same, j[:, None], N_PAD), axis=0))
        value = tl.gather(packed, j, 0)
        count = (value & 0x3FFFFFFF).to(tl.int32)
        count = tl.sum(tl.where(same, count[:, None], 0), axis=0)
        tags = tags | tl.where((count & 0x3FF) != 0, TAG_DRAFT, 0) \
            | tl.where((count & 0xFFC00) != 0, TAG_RETRIEVED, 0) \
            | tl.where(count >= 0x100000, TAG_CONTEXT, 0)
        value_score = (value >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        best = tl.maximum(best, tl.max(tl.where(same, value_score[:, None], 0.0), axis=0))
    return first, tags, best


@triton.jit
def select_drafts(pool_tokens, pool_parents, pool_scores, keep_by_stage, row_stage, b,
                  pool, cap, full_stage, draft_top_k, replace_keep, replace_log,
                  draft_offset, spare_offset, POOL_PAD: tl.constexpr,
                  CAP_PAD: tl.constexpr, REPLACES: tl.constexpr,
                  PRECISE_EXP: tl.constexpr):
    # The cap best slots in rank order and what the drafted and spare parts make of
    # them (vectors over ranks), and the number of replaced nodes.
    stage = tl.minimum(tl.maximum(row_stage, 0), full_stage)
    keep = tl.load(keep_by_stage + stage)
    base = b * pool
    s = tl.arange(0, POOL_PAD)
    in_pool = s < pool
    score = tl.load(pool_scores + base + s, mask=in_pool, other=float("-inf"))
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 ties with 0.0, as on the CPU
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # monotonic in the score
    key = (ordered.to(tl.int64) << 32) + (0x7FFFFFFF - s).to(tl.int64)
    key = tl.where(in_pool, key, -9223372036854775807 - 1)
    best = tl.topk(key, CAP_PAD)  # descending: rank order
    low = best - ((best >> 32) << 32)
    r = tl.arange(0, CAP_PAD)
    in_cap = r < cap
    slot = tl.where(in_cap, 0x7FFFFFFF - low, 0).to(tl.int32)
    token = tl.load(pool_tokens + base + slot, mask=in_cap, other=-1)
    parent_slot = tl.load(pool_parents + base + slot, mask=in_cap, other=-1)
    slot_score = tl.load(pool_scores + base + slot, mask=in_cap, other=float("-inf"))
    candidate = in_cap & (tl.abs(slot_score) < float("inf"))
    # the rank of each slot's parent among the finite selected slots (-1: none)
    match = (slot[None, :] == parent_slot[:, None]) & candidate[None, :]
    parent = tl.max(tl.where(match, r[None, :], -1), axis=1)
    kept = candidate & (r < keep)
    ranked_score = tl.where(kept, slot_score, float("-inf"))
    parent_score = tl.where(parent >= 0,
                            tl.gather(ranked_score, tl.maximum(parent, 0), 0), 0.0)
    if PRECISE_EXP:  # libdevice's expf, as the CPU kernel's std::exp
        local = libdevice.exp(slot_score - parent_score)
    else:  # the interpreter has no libdevice
        local = tl.exp(slot_score - parent_score)
    local = tl.minimum(tl.maximum(local, 0.0), 1.0)
    local = tl.where(kept, local, 0.0)
    if REPLACES:
        unpruned = row_stage == full_stage
        drop = kept & unpruned & (r >= replace_keep) & (ranked_score < replace_log)
    else:
        drop = r < 0
    replaced = tl.sum(drop.to(tl.int64), axis=0)
    depth = tl.where(slot < draft_top_k, 1,
                     2 + (slot - draft_top_k) // (draft_top_k * draft_top_k)).to(tl.int64)
    draft_token = tl.where(kept & ~drop, token, -1)
    draft_parent = tl.where(kept & (parent >= 0), parent + draft_offset, 0)
    draft_depth = tl.where(kept, depth, 0)
    spare_token = tl.where(candidate, token, -1)
    spare_parent = tl.where(candidate & (parent >= 0), parent + spare_offset, 0)
    spare_depth = tl.where(candidate, depth, 0)
    return (draft_token, draft_parent, draft_depth, local, spare_token, spare_parent,
            spare_depth, replaced)


@triton.jit
def expand_template(successors, template_parents, template_ranks, root, partition,
                    template_size, vocab_size, table_rows, succ_k,
                    T_PAD: tl.constexpr, LOG_T: tl.constexpr):
    # Template tokens (-1: none) and depths, vectors over template nodes.
    t = tl.arange(0, T_PAD)
    in_t = t < template_size
    parent = tl.load(template_parents + t, mask=in_t, other=-1).to(tl.int32)
    rank = tl.load(template_ranks + t, mask=in_t, other=0)
    parent_c = tl.minimum(tl.maximum(parent, 0), T_PAD - 1)
    # depths: pointer doubling over the parents
    depth = tl.where(in_t, 1, 0)
    up = tl.where(in_t, parent, -1)
    steps = tl.zeros([], tl.int32)
    while (tl.max(up, axis=0) >= 0) & (steps < LOG_T):
        has = up >= 0
        up_c = tl.minimum(tl.maximum(up, 0), T_PAD - 1)
        depth = depth + tl.where(has, tl.gather(depth, up_c, 0), 0)
        up = tl.where(has, tl.gather(up, up_c, 0), -1)
        steps += 1
    # tokens: one level of lookups at a time
    token = tl.full([T_PAD], -1, tl.int64)
    row_offset = partition * vocab_size
    deepest = tl.max(depth, axis=0)
    level = tl.full([], 1, tl.int32)
    while level <= deepest:
        parent_token = tl.where(parent < 0, root, tl.gather(token, parent_c, 0))
        row = parent_token + row_offset
        lookup = (depth == level) & (parent_token >= 0) & (partition >= 0) \
            & (parent_token < vocab_size) & (row < table_rows) & (rank >= 0) \
            & (rank < succ_k)
        found = tl.load(successors + row * succ_k + rank, mask=lookup, other=-1)
        token = tl.where(depth == level, found.to(tl.int64), token)
        level += 1
    return token, depth.to(tl.int64)
