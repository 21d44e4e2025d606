"""The fused Graft step's bookkeeping ops on CUDA, as Triton kernels.

``graft_draft_step``, ``graft_accept_greedy`` and ``graft_accept_sampled`` (schemas and
CPU kernels in ``csrc/graft_step.cpp``, which is their specification; the Python facade
in :mod:`vllm_graft.ops`): one launcher per op, with the op's schema as its signature,
registered as the op's CUDA kernel. A launcher checks shapes, dtypes, layouts and
devices (``ValueError`` naming the op and the argument) and launches ONE kernel that
writes the op's outputs in place; it never reads a tensor's values on the host, so a
step is capturable in a CUDA graph. Like the CUDA kernels of the other ops, these trust
the values they are given (ids in range, trees parents-first): what the CPU kernels
reject is not touched here (a learn row outside the matrix writes nothing, a child token
outside the vocabulary is never accepted, a logits row outside ``logits`` makes its node
follow ``row_topk``'s column 0, a tree deeper than ``accepted_rows`` stops the walk at
its last level), and nothing is read or written outside the tensors.

Work split: one program per request (grid ``(B,)``), vectors over the request's
candidates or tree rows; a program writes only its request's rows, except the successor
matrix.

* draft step: children scores (frontier score + log-prob, NaN -> -inf, +inf -> the
  largest float, a stopped request's -inf), the pool slice, best-path confidence
  ``exp(max)``, the checkpoint test, the next frontier (``k`` rounds of arg-max, ties to
  the lower slot, as the CPU's partial sort) and its lineage. Every value the program
  rewrites (going, stage, steps, the frontier, the parents' lineage rows) is loaded
  first, then ``tl.debug_barrier()``, then stored: other threads of the program store
  what one thread reads. Step 0's reset never stores an address the step writes too
  (stores of different threads to one address are unordered).
* acceptance: the walk over ``L + 1`` levels carries a ``live`` flag (no early exit):
  every slot of ``accepted_rows`` / ``output_tokens`` is stored once, -1 past the walk.
  The accepted child is the first row ``r >= 1`` that is valid, a child of the current
  row and carries the emitted token. Then the matrix update: each row with a learn row
  writes its ``row_topk`` row there unless a later flat (request, row) row has the same
  learn row, so the last writer in flat order wins and no two programs store one row.
  The walk reads no matrix row, so the update needs no barrier.
* sampled acceptance: at a node of a sampled request, the token that plain sampling
  and the multi-draft rule emit there (:mod:`vllm_graft.kernels.sampled_node_triton`
  says how, and how close to the CPU's); greedy requests (temperature <= 0) follow
  ``row_topk``'s column 0.

Under Triton's interpreter (``TRITON_INTERPRET=1``, the CPU tests) vocabulary tiles are
larger (fewer interpreted steps); :data:`VOCAB_BLOCK` overrides the choice.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from vllm_graft.kernels.sampled_node_triton import precise_exp, sample_node

__all__ = ["graft_accept_greedy_cuda", "graft_accept_sampled_cuda", "graft_draft_step_cuda"]

#: vocabulary tile of the sampled walk's passes; None: chosen from the vocabulary size
VOCAB_BLOCK: int | None = None
#: pivots per pass of the key searches (a power of two)
SEARCH_SPLITS = 16
#: tree rows compared per step when a sampled node's children are matched against tokens
_ROW_CHUNK = 16
_SOURCE_CLASSES = 5  # context, draft, retrieved, both, padding


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---- graft_draft_step ---------------------------------------------------------------
@triton.jit(do_not_specialize=["step", "checkpoint", "full_stage"])
def _draft_step_kernel(
    logprobs, tokens, thresholds, pool_tokens, pool_parents, pool_scores,
    frontier_ids, frontier_tokens, frontier_scores, lineage, going, stage, steps,
    confidence, step, checkpoint, full_stage,
    stride_lb, stride_lw, stride_lk, stride_stage, stride_steps,
    K: tl.constexpr, DEPTH: tl.constexpr, POOL: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr, PRECISE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    first_step = step == 0
    width = tl.where(first_step, 1, K)
    start = tl.where(first_step, 0, K + (step - 1) * (K * K))  # this step's pool slots
    j = tl.arange(0, BLOCK_C)  # child j = w * K + c of frontier node w
    w = j // K
    c = j % K
    is_child = j < width * K
    from_frontier = is_child & (step > 0)

    # ---- loads of everything this program rewrites --------------------------------
    was_going = (tl.load(going + b) != 0) | first_step  # step 0 starts a build
    old_stage = tl.load(stage + b * stride_stage)
    old_steps = tl.load(steps + b * stride_steps)
    node_score = tl.load(frontier_scores + b * K + w, mask=from_frontier, other=0.0)
    parent = tl.load(frontier_ids + b * K + w, mask=from_frontier, other=-1)
    logprob = tl.load(logprobs + b * stride_lb + w * stride_lw + c * stride_lk,
                      mask=is_child, other=0.0).to(tl.float32)
    token = tl.load(tokens + (b * width + w) * K + c, mask=is_child, other=-1).to(tl.int64)

    score = node_score + logprob
    score = tl.where(score != score, float("-inf"), score)  # NaN
    score = tl.where(score == float("inf"), 3.4028234663852886e38, score)  # nan_to_num
    score = tl.where(was_going, score, float("-inf"))
    score = tl.where(is_child, score, float("-inf"))
    best = tl.max(score, 0)
    best_path = precise_exp(best, PRECISE)
    threshold = tl.load(thresholds + tl.maximum(checkpoint, 0), mask=checkpoint >= 0,
                        other=0.0)
    stops = (checkpoint >= 0) & was_going & (best_path < threshold)
    new_stage = tl.where(stops, checkpoint.to(tl.int64),
                         tl.where(first_step, full_stage.to(tl.int64), old_stage))
    still = was_going & ~stops
    new_steps = tl.where(first_step, 0, old_steps) + was_going.to(tl.int64)

    # the next frontier: k rounds of arg-max, ties to the lower child
    i = tl.arange(0, BLOCK_K)
    taken = ~is_child
    chosen = tl.zeros([BLOCK_K], dtype=tl.int32)
    chosen_score = tl.zeros([BLOCK_K], dtype=tl.float32)
    chosen_token = tl.full([BLOCK_K], -1, dtype=tl.int64)
    for rank in range(K):
        value = tl.max(tl.where(taken, float("-inf"), score), 0)
        pick = tl.min(tl.where(~taken & (score == value), j, BLOCK_C), 0)
        taken = taken | (j == pick)
        chosen = tl.where(i == rank, pick, chosen)
        chosen_score = tl.where(i == rank, value, chosen_score)
        chosen_token = tl.where(i == rank, tl.sum(tl.where(j == pick, token, 0), 0),
                                chosen_token)
    # lineage: ancestors at depths 1..step from the parent's row, then the node itself
    t = tl.arange(0, BLOCK_D)
    in_frontier = i < K
    window = (t >= 1) & (t <= step) & (t < DEPTH)
    old_lineage = tl.load(
        lineage + (b * K + chosen[:, None] // K) * DEPTH + t[None, :],
        mask=in_frontier[:, None] & window[None, :], other=-1)
    new_lineage = tl.where(t[None, :] == step + 1, i[:, None].to(tl.int64), old_lineage)
    tl.debug_barrier()

    # ---- stores ---------------------------------------------------------------------
    slot = b * POOL + start + j
    tl.store(pool_tokens + slot, tl.where(was_going, token, -1), mask=is_child)
    tl.store(pool_parents + slot, tl.where(was_going, parent, -1), mask=is_child)
    tl.store(pool_scores + slot, score, mask=is_child)
    if first_step:  # an empty pool past step 0's slots (those are stored above)
        for first in range(K, POOL, BLOCK_P):
            p = first + tl.arange(0, BLOCK_P)
            inside = p < POOL
            tl.store(pool_tokens + b * POOL + p, tl.full([BLOCK_P], -1, tl.int64),
                     mask=inside)
            tl.store(pool_parents + b * POOL + p, tl.full([BLOCK_P], -1, tl.int64),
                     mask=inside)
            tl.store(pool_scores + b * POOL + p,
                     tl.full([BLOCK_P], float("-inf"), tl.float32), mask=inside)
    conf = tl.where((t == step) & was_going, best_path, float("nan"))
    tl.store(confidence + b * DEPTH + t, conf, mask=(t < DEPTH) & ((t == step) | first_step))
    tl.store(going + b, still.to(tl.uint8))
    tl.store(stage + b * stride_stage, new_stage)
    tl.store(steps + b * stride_steps, new_steps)
    more = step + 1 < DEPTH
    tl.store(frontier_scores + b * K + i, chosen_score, mask=in_frontier & more)
    tl.store(frontier_ids + b * K + i, (start + chosen).to(tl.int64), mask=in_frontier & more)
    tl.store(frontier_tokens + b * K + i, tl.where(still, chosen_token, -1),
             mask=in_frontier & more)
    tl.store(lineage + (b * K + i[:, None]) * DEPTH + t[None, :], new_lineage,
             mask=in_frontier[:, None] & (t < DEPTH)[None, :] & (more | first_step))


# ---- acceptance ---------------------------------------------------------------------
@triton.jit
def _learn(learn_rows, row_topk, successors, request, batch, table_rows,
           ROWS: tl.constexpr, TOPK: tl.constexpr, BLOCK_R: tl.constexpr,
           BLOCK_K: tl.constexpr, CHUNK: tl.constexpr):
    # The matrix update of one request's rows: a row writes unless a later flat row
    # (this request's or a later one's) teaches the same matrix row.
    r = tl.arange(0, BLOCK_R)
    flat = request * ROWS + r
    learn = tl.load(learn_rows + flat, mask=r < ROWS, other=-1)
    teaches = (r < ROWS) & (learn >= 0) & (learn < table_rows)
    later = tl.arange(0, CHUNK)
    shadowed = r < 0
    for first in range(request * ROWS, batch * ROWS, CHUNK):
        other_flat = first + later
        other = tl.load(learn_rows + other_flat, mask=other_flat < batch * ROWS, other=-1)
        other_teaches = (other >= 0) & (other < table_rows)
        same = (learn[:, None] == other[None, :]) & other_teaches[None, :] \
            & (other_flat[None, :] > flat[:, None])
        shadowed = shadowed | (tl.max(same.to(tl.int32), 1) > 0)
    col = tl.arange(0, BLOCK_K)
    write = (teaches & ~shadowed)[:, None] & (col < TOPK)[None, :]
    top = tl.load(row_topk + flat.to(tl.int64)[:, None] * TOPK + col[None, :], mask=write,
                  other=0)
    tl.store(successors + learn[:, None] * TOPK + col[None, :], top.to(tl.int32), mask=write)


@triton.jit(do_not_specialize=["batch", "table_rows", "num_logits"])
def _accept_kernel(
    tree_tokens, tree_parents, tree_valid, tree_source, row_topk, learn_rows, successors,
    accepted_rows, output_tokens, num_accepted, accepted_sources,
    logits, logit_rows, temperature, top_k, top_p, uniforms,
    batch, table_rows, num_logits, vocab, stride_logits,
    stride_tokens, stride_accepted, stride_output, stride_num, stride_sources,
    ROWS: tl.constexpr, LEVELS: tl.constexpr, TOPK: tl.constexpr, SAMPLED: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    SPLITS: tl.constexpr, CHUNK: tl.constexpr, ROW_CHUNK: tl.constexpr,
    PRECISE: tl.constexpr,
):
    request = tl.program_id(0)
    b = request.to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    in_tree = r < ROWS
    tokens_row = tree_tokens + b * stride_tokens
    parents_row = tree_parents + b * ROWS
    valid_row = tree_valid + b * ROWS
    tokens = tl.load(tokens_row + r, mask=in_tree, other=-1)
    parents = tl.load(parents_row + r, mask=in_tree, other=-1)
    valid = tl.load(valid_row + r, mask=in_tree, other=0) != 0
    source = tl.load(tree_source + b * ROWS + r, mask=in_tree, other=0).to(tl.int32)
    # the class an accepted row counts in: context whatever else, else its plain tag
    source_class = tl.where((source & 8) != 0, 0,
                            tl.where((source >= 1) & (source <= 4), source, -1))
    candidate = valid & (r >= 1)
    classes = tl.arange(0, 8)
    by_class = tl.zeros([8], dtype=tl.int64)

    if SAMPLED:
        temp = tl.load(temperature + b)
        sampled = temp > 0.0
        scale = tl.maximum(temp, 1e-6)
        k_request = tl.load(top_k + b)
        p_request = tl.load(top_p + b)

    current = tl.zeros([], dtype=tl.int64)
    count = tl.zeros([], dtype=tl.int64)
    live = request >= 0
    for level in range(LEVELS + 1):
        emitted = tl.load(row_topk + (b * ROWS + current) * TOPK)
        if SAMPLED:
            if live & sampled:
                row = tl.load(logit_rows + b * ROWS + current)
                if (row >= 0) & (row < num_logits):
                    level_u = uniforms + (b * (LEVELS + 1) + level) * (ROWS + 1)
                    u_child = tl.load(level_u + r, mask=in_tree, other=1.0)
                    u_residual = tl.load(level_u + ROWS)
                    emitted = sample_node(
                        logits + row * stride_logits, vocab, scale, k_request, p_request,
                        tokens, candidate & (parents == current), u_child, u_residual, r,
                        tokens_row, parents_row, valid_row, current,
                        ROWS, BLOCK_R, BLOCK_V, SPLITS, ROW_CHUNK, PRECISE).to(tl.int64)
        match = candidate & (parents == current) & (tokens == emitted)
        child = tl.min(tl.where(match, r, BLOCK_R), 0)
        found = live & (child < BLOCK_R) & (level < LEVELS)
        tl.store(output_tokens + b * stride_output + level, tl.where(live, emitted, -1))
        tl.store(accepted_rows + b * stride_accepted + level,
                 tl.where(found, child.to(tl.int64), -1), mask=level < LEVELS)
        child_class = tl.sum(tl.where(r == child, source_class, 0), 0)
        by_class += ((classes == child_class) & found).to(tl.int64)
        current = tl.where(found, child.to(tl.int64), current)
        count += found.to(tl.int64)
        live = found
    tl.store(num_accepted + b * stride_num, count)
    tl.store(accepted_sources + b * stride_sources + classes, by_class,
             mask=classes < 5)
    _learn(learn_rows, row_topk, successors, request, batch, table_rows, ROWS, TOPK,
           BLOCK_R, BLOCK_K, CHUNK)


# ---- launchers: checks (shapes, dtypes, layouts, devices; never values) -------------
def _fail(op: str, message: str):
    raise ValueError(f"{op}: {message}")


def _check_dtype(op: str, name: str, t: torch.Tensor, *dtypes: torch.dtype) -> None:
    if t.dtype not in dtypes:
        expected = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        _fail(op, f"{name} must be {expected}, got {str(t.dtype).replace('torch.', '')}")


def _check_shape(op: str, name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        _fail(op, f"{name} must have shape {list(shape)}, got {list(t.shape)}")


def _check_on(op: str, name: str, t: torch.Tensor, reference: torch.Tensor) -> None:
    if t.device != reference.device:
        _fail(op, f"{name} is on {t.device} but the batch is on {reference.device}")


def _check_contiguous(op: str, reference: torch.Tensor, **tensors: torch.Tensor) -> None:
    """Each tensor contiguous and on the device of ``reference``."""
    for name, t in tensors.items():
        if not t.is_contiguous():
            _fail(op, f"{name} must be contiguous")
        _check_on(op, name, t, reference)


def _check_rows(op: str, reference: torch.Tensor, **tensors: torch.Tensor) -> None:
    """[B] or [B, X] tensors whose rows may be column slices of a wider buffer."""
    for name, t in tensors.items():
        if t.dim() == 2 and t.shape[1] > 1 and t.stride(1) != 1:
            _fail(op, f"{name} must have unit stride along its rows, got strides "
                      f"{list(t.stride())}")
        _check_on(op, name, t, reference)


def _step_start(step: int, k: int) -> int:
    return 0 if step == 0 else k + (step - 1) * k * k


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(max(n, 1)))


_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_INDEX = (torch.int64, torch.int32)


def graft_draft_step_cuda(logprobs: torch.Tensor, tokens: torch.Tensor,
                          thresholds: torch.Tensor, step: int, checkpoint: int,
                          pool_tokens: torch.Tensor, pool_parents: torch.Tensor,
                          pool_scores: torch.Tensor, frontier_ids: torch.Tensor,
                          frontier_tokens: torch.Tensor, frontier_scores: torch.Tensor,
                          lineage: torch.Tensor, going: torch.Tensor, stage: torch.Tensor,
                          steps: torch.Tensor, confidence: torch.Tensor) -> None:
    """``graft_draft_step`` (see :func:`vllm_graft.ops.graft_draft_step`): one launch."""
    op = "graft_draft_step"
    if logprobs.dim() != 3:
        _fail(op, f"logprobs must be [B, W, k], got {list(logprobs.shape)}")
    batch, width, k = logprobs.shape
    depth = confidence.shape[1] if confidence.dim() == 2 else 0
    pool = pool_tokens.shape[1] if pool_tokens.dim() == 2 else 0
    if k < 1:
        _fail(op, "top_k (logprobs' last dimension) must be at least 1")
    if not 0 <= step < depth:
        _fail(op, f"step {step} outside [0, {depth})")
    if width != (1 if step == 0 else k):
        _fail(op, f"step {step} expands {1 if step == 0 else k} nodes per request, "
                  f"logprobs has {width}")
    if pool != _step_start(depth, k):
        _fail(op, f"the pool holds {pool} slots, top_k {k} and {depth} steps need "
                  f"{_step_start(depth, k)}")
    _check_dtype(op, "logprobs", logprobs, *_FLOATS)
    _check_shape(op, "tokens", tokens, tuple(logprobs.shape))
    _check_dtype(op, "tokens", tokens, *_INDEX)
    _check_dtype(op, "thresholds", thresholds, torch.float32)
    if checkpoint >= thresholds.numel():
        _fail(op, f"checkpoint {checkpoint} but only {thresholds.numel()} thresholds")
    for name, t, dtype in (("pool_tokens", pool_tokens, torch.int64),
                           ("pool_parents", pool_parents, torch.int64),
                           ("pool_scores", pool_scores, torch.float32)):
        _check_dtype(op, name, t, dtype)
        _check_shape(op, name, t, (batch, pool))
    for name, t, dtype in (("frontier_ids", frontier_ids, torch.int64),
                           ("frontier_tokens", frontier_tokens, torch.int64),
                           ("frontier_scores", frontier_scores, torch.float32)):
        _check_dtype(op, name, t, dtype)
        _check_shape(op, name, t, (batch, k))
    _check_dtype(op, "lineage", lineage, torch.int64)
    _check_shape(op, "lineage", lineage, (batch, k, depth))
    _check_dtype(op, "going", going, torch.bool)
    _check_shape(op, "going", going, (batch,))
    for name, t in (("stage", stage), ("steps", steps)):
        _check_dtype(op, name, t, torch.int64)
        _check_shape(op, name, t, (batch,))
    _check_dtype(op, "confidence", confidence, torch.float32)
    _check_shape(op, "confidence", confidence, (batch, depth))
    _check_on(op, "logprobs", logprobs, logprobs)
    _check_on(op, "tokens", tokens, logprobs)
    tokens = tokens.contiguous()  # a drafter's top-k is already: no copy then
    _check_contiguous(op, logprobs, thresholds=thresholds,
                      pool_tokens=pool_tokens, pool_parents=pool_parents,
                      pool_scores=pool_scores, frontier_ids=frontier_ids,
                      frontier_tokens=frontier_tokens, frontier_scores=frontier_scores,
                      lineage=lineage, going=going, confidence=confidence)
    _check_rows(op, logprobs, stage=stage, steps=steps)
    if batch == 0:
        return
    _draft_step_kernel[(batch,)](
        logprobs, tokens, thresholds, pool_tokens, pool_parents, pool_scores,
        frontier_ids, frontier_tokens, frontier_scores, lineage, going.view(torch.uint8),
        stage, steps, confidence, step, checkpoint, thresholds.numel(),
        *logprobs.stride(), stage.stride(0), steps.stride(0),
        K=k, DEPTH=depth, POOL=pool, BLOCK_C=_pow2(k * k), BLOCK_K=_pow2(k),
        BLOCK_D=_pow2(depth + 1), BLOCK_P=min(_pow2(pool), 1024),
        PRECISE=not _interpreting(), num_warps=4 if k * k <= 1024 else 8)


def _check_acceptance(op: str, tree_tokens, tree_parents, tree_valid, tree_source,
                      row_topk, learn_rows, successors, accepted_rows, output_tokens,
                      num_accepted, accepted_sources) -> tuple[int, int, int, int]:
    """The checks both acceptance ops share; returns (batch, rows, levels, k)."""
    _check_dtype(op, "tree_tokens", tree_tokens, torch.int64)
    _check_dtype(op, "tree_parents", tree_parents, torch.int64)
    _check_dtype(op, "tree_valid", tree_valid, torch.bool)
    _check_dtype(op, "tree_source", tree_source, torch.uint8)
    if tree_tokens.dim() != 2:
        _fail(op, f"tree_tokens must be [B, rows], got {list(tree_tokens.shape)}")
    batch, rows = tree_tokens.shape
    if rows < 1:
        _fail(op, "a tree needs its root row")
    for name, t in (("tree_parents", tree_parents), ("tree_valid", tree_valid),
                    ("tree_source", tree_source)):
        _check_shape(op, name, t, (batch, rows))
    for name, t in (("accepted_rows", accepted_rows), ("output_tokens", output_tokens),
                    ("num_accepted", num_accepted),
                    ("accepted_sources", accepted_sources)):
        _check_dtype(op, name, t, torch.int64)
    if accepted_rows.dim() != 2 or accepted_rows.shape[0] != batch:
        _fail(op, f"accepted_rows must be [B, L], got {list(accepted_rows.shape)}")
    levels = accepted_rows.shape[1]
    _check_shape(op, "output_tokens", output_tokens, (batch, levels + 1))
    _check_shape(op, "num_accepted", num_accepted, (batch,))
    _check_shape(op, "accepted_sources", accepted_sources, (batch, _SOURCE_CLASSES))
    _check_contiguous(op, tree_tokens, tree_parents=tree_parents, tree_valid=tree_valid,
                      tree_source=tree_source)
    _check_rows(op, tree_tokens, tree_tokens=tree_tokens, accepted_rows=accepted_rows,
                output_tokens=output_tokens, num_accepted=num_accepted,
                accepted_sources=accepted_sources)
    _check_dtype(op, "row_topk", row_topk, torch.int64)
    if row_topk.dim() != 2 or row_topk.shape[0] != batch * rows:
        _fail(op, f"row_topk must be [B * rows, k] = [{batch * rows}, k], got "
                  f"{list(row_topk.shape)}")
    k = row_topk.shape[1]
    if k < 1:
        _fail(op, "row_topk needs at least its argmax column")
    _check_dtype(op, "learn_rows", learn_rows, torch.int64)
    _check_shape(op, "learn_rows", learn_rows, (batch, rows))
    _check_dtype(op, "successors", successors, torch.int32)
    if successors.dim() != 2:
        _fail(op, f"successors must be a [P * V, k] table, got {list(successors.shape)}")
    if successors.shape[1] != k:
        _fail(op, f"successors has k = {successors.shape[1]}, row_topk {k}")
    _check_contiguous(op, tree_tokens, row_topk=row_topk, learn_rows=learn_rows,
                      successors=successors)
    return batch, rows, levels, k


def _accept_blocks(rows: int, k: int) -> dict:
    block_r = _pow2(rows, 2)
    return dict(BLOCK_R=block_r, BLOCK_K=_pow2(k, 2),
                CHUNK=max(16, min(256, 2048 // block_r)), ROW_CHUNK=_ROW_CHUNK)


def graft_accept_greedy_cuda(tree_tokens: torch.Tensor, tree_parents: torch.Tensor,
                             tree_valid: torch.Tensor, tree_source: torch.Tensor,
                             row_topk: torch.Tensor, learn_rows: torch.Tensor,
                             vocab_size: int, successors: torch.Tensor,
                             accepted_rows: torch.Tensor, output_tokens: torch.Tensor,
                             num_accepted: torch.Tensor,
                             accepted_sources: torch.Tensor) -> None:
    """``graft_accept_greedy`` (see :func:`vllm_graft.ops.graft_accept_greedy`): one
    launch for the walk and the matrix update. ``vocab_size`` bounds ``row_topk``'s
    values, which the kernel trusts."""
    op = "graft_accept_greedy"
    batch, rows, levels, k = _check_acceptance(
        op, tree_tokens, tree_parents, tree_valid, tree_source, row_topk, learn_rows,
        successors, accepted_rows, output_tokens, num_accepted, accepted_sources)
    if batch == 0:
        return
    unused = tree_tokens  # the sampled walk's inputs: never read here
    _accept_kernel[(batch,)](
        tree_tokens, tree_parents, tree_valid.view(torch.uint8), tree_source, row_topk,
        learn_rows, successors, accepted_rows, output_tokens, num_accepted,
        accepted_sources, unused, unused, unused, unused, unused, unused,
        batch, successors.shape[0], 0, 1, 0,
        tree_tokens.stride(0), accepted_rows.stride(0), output_tokens.stride(0),
        num_accepted.stride(0), accepted_sources.stride(0),
        ROWS=rows, LEVELS=levels, TOPK=k, SAMPLED=False, BLOCK_V=16,
        SPLITS=SEARCH_SPLITS, PRECISE=not _interpreting(),
        num_warps=4 if rows <= 128 else 8, **_accept_blocks(rows, k))


def _vocab_block(vocab: int) -> int:
    if VOCAB_BLOCK is not None:
        return VOCAB_BLOCK
    return min(_pow2(vocab, 16), 2048 if _interpreting() else 512)


def graft_accept_sampled_cuda(logits: torch.Tensor, logit_rows: torch.Tensor,
                              tree_tokens: torch.Tensor, tree_parents: torch.Tensor,
                              tree_valid: torch.Tensor, tree_source: torch.Tensor,
                              temperature: torch.Tensor, top_k: torch.Tensor,
                              top_p: torch.Tensor, uniforms: torch.Tensor,
                              row_topk: torch.Tensor, learn_rows: torch.Tensor,
                              vocab_size: int, successors: torch.Tensor,
                              accepted_rows: torch.Tensor, output_tokens: torch.Tensor,
                              num_accepted: torch.Tensor,
                              accepted_sources: torch.Tensor) -> None:
    """``graft_accept_sampled`` (see :func:`vllm_graft.ops.graft_accept_sampled`): one
    launch for the walk and the matrix update."""
    op = "graft_accept_sampled"
    batch, rows, levels, k = _check_acceptance(
        op, tree_tokens, tree_parents, tree_valid, tree_source, row_topk, learn_rows,
        successors, accepted_rows, output_tokens, num_accepted, accepted_sources)
    if logits.dim() != 2 or (logits.shape[1] > 1 and logits.stride(1) != 1):
        _fail(op, f"logits must be [N, V] with contiguous rows, got shape "
                  f"{list(logits.shape)} and strides {list(logits.stride())}")
    _check_dtype(op, "logits", logits, *_FLOATS)
    _check_on(op, "logits", logits, tree_tokens)
    vocab = logits.shape[1]
    if vocab < 1:
        _fail(op, "logits has an empty vocabulary")
    _check_dtype(op, "logit_rows", logit_rows, torch.int64)
    _check_shape(op, "logit_rows", logit_rows, (batch, rows))
    _check_dtype(op, "temperature", temperature, torch.float32)
    _check_dtype(op, "top_k", top_k, torch.int64)
    _check_dtype(op, "top_p", top_p, torch.float32)
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        _check_shape(op, name, t, (batch,))
    _check_dtype(op, "uniforms", uniforms, torch.float32)
    _check_shape(op, "uniforms", uniforms, (batch, levels + 1, rows + 1))
    _check_contiguous(op, tree_tokens, logit_rows=logit_rows, temperature=temperature,
                      top_k=top_k, top_p=top_p, uniforms=uniforms)
    if batch == 0:
        return
    _accept_kernel[(batch,)](
        tree_tokens, tree_parents, tree_valid.view(torch.uint8), tree_source, row_topk,
        learn_rows, successors, accepted_rows, output_tokens, num_accepted,
        accepted_sources, logits, logit_rows, temperature, top_k, top_p, uniforms,
        batch, successors.shape[0], logits.shape[0], vocab, logits.stride(0),
        tree_tokens.stride(0), accepted_rows.stride(0), output_tokens.stride(0),
        num_accepted.stride(0), accepted_sources.stride(0),
        ROWS=rows, LEVELS=levels, TOPK=k, SAMPLED=True, BLOCK_V=_vocab_block(vocab),
        SPLITS=SEARCH_SPLITS, PRECISE=not _interpreting(), num_warps=8,
        **_accept_blocks(rows, k))
