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

__all__ = ["cuda_ops_available", "logits_topk", "successor_gather", "successor_update_"]

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
