"""One node of ``graft_accept_sampled``'s walk, as Triton device functions (the
kernel and its launcher: :mod:`vllm_graft.kernels.graft_step_triton`).

:func:`sample_node` returns the token a sampled request emits at a tree node. First
the distribution of plain sampling (``logits / max(temperature, 1e-6)``, top-k keeping
values >= the k-th largest, top-p dropping the smallest tokens whose ascending
cumulative mass is <= 1 - p but never the largest (the highest index among equal
largest values: the last of the ascending order, as the CPU's), softmax) from passes
over the logits row, never sorted: values are compared as order-preserving int32 keys
(-0.0 read as +0.0, as float comparison does); the k-th largest key and the top-p cut
key are found by a ``SPLITS``-way search over the key range (``SPLITS`` counts or
masses per pass, about 8 passes for a full range); the tie group at the top-p cut is
dropped lowest index first (ranks from a cumulative sum within tiles). Then the
multi-draft rule exactly as the CPU's: children in row order, child ``r`` accepted
when ``uniforms[b, level, r] < r(x) / (residual + children from r on)``, else the first
token whose cumulative residual mass exceeds ``uniforms[b, level, R] * residual``
(``V - 1`` if none): tile sums first, then the one tile where they cross, token by
token. A node costs about 20 passes over its logits row with both filters on, 2 with
none (plus 2 for the residual sample, once per walk). :func:`precise_exp` is the
``exp`` of both this and the draft step.

Precision: logits math in float32 as the CPU's (division rounded to nearest, so the
scaled values and their ties are the CPU's); every mass (totals, masses below a cut,
child and residual masses, acceptance ratios) in float64, the CPU's type, and compared
with the top-p floor after rounding to float32, as the CPU does. Sums run in another
order than the CPU's, so a token within float64 rounding of a cut may fall the other
way: paths match the CPU op's on random inputs, not bit for bit on adversarial ones.
``exp`` is libdevice's on a GPU (Triton's fast ``exp`` is a few ulps off the C
library's; the interpreter has only NumPy's).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

__all__ = ["precise_exp", "sample_node"]


@triton.jit
def precise_exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _scaled_logits(row, offs, mask, scale):
    # A tile of logits / scale (float32, rounded to nearest as the CPU's division) and
    # its order-preserving int32 keys; -0.0 becomes +0.0 so equal values share a key.
    x = tl.load(row + offs, mask=mask, other=float("-inf")).to(tl.float32)
    x = tl.math.div_rn(x, scale)
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    return x, bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _weight(x, top, PRECISE: tl.constexpr):
    # exp(x - max) as the CPU's float32 exps (0 for -inf), widened for the sums
    return tl.where(x == float("-inf"), 0.0, precise_exp(x - top, PRECISE)).to(tl.float64)


@triton.jit
def _kept(key, index, cut, cut_index, top_index):
    # what top-k and top-p keep: keys above the cut, at the cut the indices past the
    # highest dropped one, and the largest token whatever its place
    return (key > cut) | ((key == cut) & (index > cut_index)) | (index == top_index)


@triton.jit
def _pivots(lo, hi, SPLITS: tl.constexpr):
    # SPLITS keys in (lo, hi], cutting it into SPLITS + 1 nearly equal parts (int64
    # arithmetic: the range spans up to 2^32 keys)
    parts = tl.arange(0, SPLITS).to(tl.int64) + 1
    return lo + ((hi - lo) * parts + SPLITS) // (SPLITS + 1)


@triton.jit
def _kth_key(row, vocab, scale, k, lo_key, hi_key, BLOCK_V: tl.constexpr,
             SPLITS: tl.constexpr):
    # The largest key t with count(key >= t) >= k: the k-th largest value's key (true at
    # the smallest key, so the search keeps it true at lo and false past hi).
    cols = tl.arange(0, BLOCK_V)
    lo = lo_key.to(tl.int64)
    hi = hi_key.to(tl.int64)
    while lo < hi:
        pivots = _pivots(lo, hi, SPLITS)
        narrow = pivots.to(tl.int32)
        counts = tl.zeros([SPLITS], dtype=tl.int32)
        for start in range(0, vocab, BLOCK_V):
            offs = start + cols
            inside = offs < vocab
            x, key = _scaled_logits(row, offs, inside, scale)
            above = (key[None, :] >= narrow[:, None]) & inside[None, :]
            counts += tl.sum(above.to(tl.int32), 1)
        ok = counts >= k
        lo_next = tl.max(tl.where(ok, pivots, lo), 0)
        hi = tl.min(tl.where(ok, hi, pivots - 1), 0)
        lo = lo_next
    return lo.to(tl.int32)


@triton.jit
def _top_p_key(row, vocab, scale, top, kth, lo_key, hi_key, total, floor,
               BLOCK_V: tl.constexpr, SPLITS: tl.constexpr, PRECISE: tl.constexpr):
    # The largest key t whose mass below (kept values with key < t), over the total,
    # rounds to <= floor: the smallest value whose tie group top-p does not drop whole.
    # Returns it and that mass below it.
    cols = tl.arange(0, BLOCK_V)
    lo = lo_key.to(tl.int64)
    hi = hi_key.to(tl.int64)
    below = tl.zeros([], dtype=tl.float64)
    while lo < hi:
        pivots = _pivots(lo, hi, SPLITS)
        narrow = pivots.to(tl.int32)
        mass = tl.zeros([SPLITS], dtype=tl.float64)
        for start in range(0, vocab, BLOCK_V):
            offs = start + cols
            inside = offs < vocab
            x, key = _scaled_logits(row, offs, inside, scale)
            kept = inside & (key >= kth)
            weight = _weight(x, top, PRECISE)
            under = (key[None, :] < narrow[:, None]) & kept[None, :]
            mass += tl.sum(tl.where(under, weight[None, :], 0.0), 1)
        ok = (mass / total).to(tl.float32) <= floor
        lo_next = tl.max(tl.where(ok, pivots, lo), 0)
        below = tl.max(tl.where(ok, mass, below), 0)  # masses grow with the pivot
        hi = tl.min(tl.where(ok, hi, pivots - 1), 0)
        lo = lo_next
    return lo.to(tl.int32), below


@triton.jit
def _top_p_ties(row, vocab, scale, top, top_index, kth, cut, below, total, floor,
                BLOCK_V: tl.constexpr, PRECISE: tl.constexpr):
    # Within the tie group at the cut key, ascending order is index order: a member is
    # dropped while the mass below plus the group's members up to it rounds to <= floor
    # (never the largest token, top_index). Returns the highest dropped index (-1: none)
    # and the mass top-k and top-p keep.
    cols = tl.arange(0, BLOCK_V)
    seen = tl.zeros([], dtype=tl.int32)
    cut_index = tl.full([], -1, dtype=tl.int32)
    kept_total = tl.zeros([], dtype=tl.float64)
    for start in range(0, vocab, BLOCK_V):
        offs = start + cols
        inside = offs < vocab
        x, key = _scaled_logits(row, offs, inside, scale)
        kept = inside & (key >= kth)
        weight = _weight(x, top, PRECISE)
        group = kept & (key == cut)
        member = group.to(tl.int32)
        rank = seen + tl.cumsum(member, 0) - member
        upto = below + (rank + 1).to(tl.float64) * weight
        drop = group & ((upto / total).to(tl.float32) <= floor) & (offs != top_index)
        cut_index = tl.maximum(cut_index, tl.max(tl.where(drop, offs, -1), 0))
        keep = kept & ((key > cut) | (group & ~drop))  # (top_index is never dropped)
        kept_total += tl.sum(tl.where(keep, weight, 0.0), 0)
        seen += tl.sum(member, 0)
    return cut_index, kept_total


@triton.jit
def _children_of(tree_tokens, tree_parents, tree_valid, current, first,
                 CHUNK: tl.constexpr, ROWS: tl.constexpr):
    # Rows [first, first + CHUNK) of a tree: their tokens and which are current's children
    rows = first + tl.arange(0, CHUNK)
    inside = rows < ROWS
    tokens = tl.load(tree_tokens + rows, mask=inside, other=-1)
    parents = tl.load(tree_parents + rows, mask=inside, other=-1)
    valid = tl.load(tree_valid + rows, mask=inside, other=0) != 0
    return tokens, valid & (rows >= 1) & (parents == current), rows


@triton.jit
def _residual_sample(row, vocab, scale, top, cut, cut_index, top_index, child_tokens,
                     child_weight, distinct, u_residual, tree_tokens, tree_parents,
                     tree_valid, current,
                     ROWS: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK: tl.constexpr,
                     PRECISE: tl.constexpr):
    # The first token whose cumulative residual mass exceeds u * residual mass (V - 1 if
    # none). Tile sums subtract the children in the tile; the tile where the sum crosses
    # the target is searched exactly, token by token.
    cols = tl.arange(0, BLOCK_V)
    residual = tl.zeros([], dtype=tl.float64)
    for start in range(0, vocab, BLOCK_V):
        offs = start + cols
        inside = offs < vocab
        x, key = _scaled_logits(row, offs, inside, scale)
        keep = inside & _kept(key, offs, cut, cut_index, top_index)
        in_tile = distinct & (child_tokens >= start) & (child_tokens < start + BLOCK_V)
        tile = tl.sum(tl.where(keep, _weight(x, top, PRECISE), 0.0), 0) \
            - tl.sum(tl.where(in_tile, child_weight, 0.0), 0)
        residual += tl.maximum(tile, 0.0)
    target = u_residual.to(tl.float64) * residual
    running = tl.zeros([], dtype=tl.float64)
    chosen = (vocab - 1) + tl.zeros([], dtype=tl.int64)
    searching = residual > 0.0
    for start in range(0, vocab, BLOCK_V):
        offs = start + cols
        inside = offs < vocab
        x, key = _scaled_logits(row, offs, inside, scale)
        keep = inside & _kept(key, offs, cut, cut_index, top_index)
        weight = tl.where(keep, _weight(x, top, PRECISE), 0.0)
        in_tile = distinct & (child_tokens >= start) & (child_tokens < start + BLOCK_V)
        tile = tl.maximum(tl.sum(weight, 0) - tl.sum(tl.where(in_tile, child_weight, 0.0), 0),
                          0.0)
        if searching & (running + tile > target):
            is_child = offs < 0
            for first in range(0, ROWS, CHUNK):
                tokens, child, rows = _children_of(tree_tokens, tree_parents, tree_valid,
                                                   current, first, CHUNK, ROWS)
                same = (tokens[:, None] == offs[None, :]) & child[:, None]
                is_child = is_child | (tl.max(same.to(tl.int32), 0) > 0)
            weight = tl.where(is_child, 0.0, weight)
            cdf = running + tl.cumsum(weight, 0)
            pick = tl.min(tl.where(inside & (cdf > target), offs, vocab), 0)
            # rounding between tile sums and the running sum: the tile's last token
            pick = tl.where(pick < vocab, pick, tl.max(tl.where(weight > 0.0, offs, -1), 0))
            if pick >= 0:
                chosen = pick.to(tl.int64)
                searching = pick < 0
        running += tile
    return chosen


@triton.jit
def sample_node(row, vocab, scale, top_k, top_p, tokens, child, u_child, u_residual, r,
                tree_tokens, tree_parents, tree_valid, current,
                ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
                SPLITS: tl.constexpr, CHUNK: tl.constexpr, PRECISE: tl.constexpr):
    # The token a sampled request emits at tree row `current` (its logits `row`).
    cols = tl.arange(0, BLOCK_V)
    # the largest value (and its highest index, the last of the ascending order: the
    # token top-p never drops), the least
    top = tl.full([], float("-inf"), dtype=tl.float32)
    least = tl.full([], float("inf"), dtype=tl.float32)
    top_index = tl.zeros([], dtype=tl.int32)
    for start in range(0, vocab, BLOCK_V):
        offs = start + cols
        inside = offs < vocab
        x, key = _scaled_logits(row, offs, inside, scale)
        tile_top = tl.max(tl.where(inside, x, float("-inf")), 0)
        tile_index = tl.max(tl.where(inside & (x == tile_top), offs, -1), 0)
        top_index = tl.where(tile_top >= top, tile_index, top_index)
        top = tl.maximum(top, tile_top)
        least = tl.minimum(least, tl.min(tl.where(inside, x, float("inf")), 0))
    top_bits = top.to(tl.int32, bitcast=True)
    top_key = top_bits ^ ((top_bits >> 31) & 0x7FFFFFFF)
    least_bits = least.to(tl.int32, bitcast=True)
    least_key = least_bits ^ ((least_bits >> 31) & 0x7FFFFFFF)

    # top-k: keys below the k-th largest value's are dropped
    kth = tl.full([], -2147483648, dtype=tl.int32)
    if (top_k > 0) & (top_k < vocab):
        kth = _kth_key(row, vocab, scale, top_k, least_key, top_key, BLOCK_V, SPLITS)
    total = tl.zeros([], dtype=tl.float64)
    for start in range(0, vocab, BLOCK_V):
        offs = start + cols
        inside = offs < vocab
        x, key = _scaled_logits(row, offs, inside, scale)
        total += tl.sum(tl.where(inside & (key >= kth), _weight(x, top, PRECISE), 0.0), 0)

    # top-p: a cut key and, in its tie group, the highest dropped index
    cut = kth
    cut_index = tl.full([], -1, dtype=tl.int32)
    kept_total = total
    if top_p < 1.0:
        floor = 1.0 - top_p
        cut, below = _top_p_key(row, vocab, scale, top, kth, tl.maximum(kth, least_key),
                                top_key, total, floor, BLOCK_V, SPLITS, PRECISE)
        cut_index, kept_total = _top_p_ties(row, vocab, scale, top, top_index, kth, cut,
                                            below, total, floor, BLOCK_V, PRECISE)

    # the children's probabilities r(x) (the CPU's float64 exps / total)
    in_vocab = child & (tokens >= 0) & (tokens < vocab)
    x, key = _scaled_logits(row, tokens, in_vocab, scale)
    keep = in_vocab & _kept(key, tokens, cut, cut_index, top_index)
    child_weight = tl.where(keep, _weight(x, top, PRECISE), 0.0)
    # a token carried by two children leaves the residual once
    repeated = r < 0
    for first in range(0, ROWS, CHUNK):
        others, other_child, rows = _children_of(tree_tokens, tree_parents, tree_valid,
                                                 current, first, CHUNK, ROWS)
        same = (tokens[:, None] == others[None, :]) & other_child[None, :] \
            & (rows[None, :] < r[:, None])
        repeated = repeated | (tl.max(same.to(tl.int32), 1) > 0)
    distinct = in_vocab & ~repeated
    residual = tl.maximum(kept_total - tl.sum(tl.where(distinct, child_weight, 0.0), 0), 0.0)
    residual = residual / kept_total
    mass = child_weight / kept_total
    # the mass left before child r: the residual plus the children from r on
    after = tl.cumsum(mass, 0, reverse=True)
    tiny = tl.full([], 1e-300, dtype=tl.float64)
    accept = mass / tl.maximum(residual + after, tiny)
    taken = child & (u_child.to(tl.float64) < accept)
    first_taken = tl.min(tl.where(taken, r, BLOCK_R), 0)
    emitted = tl.sum(tl.where(r == first_taken, tokens, 0), 0)
    if first_taken == BLOCK_R:  # every child rejected: a sample of the residual
        emitted = _residual_sample(row, vocab, scale, top, cut, cut_index, top_index,
                                   tokens, child_weight, distinct, u_residual, tree_tokens,
                                   tree_parents, tree_valid, current, ROWS, BLOCK_V,
                                   CHUNK, PRECISE)
    return emitted
