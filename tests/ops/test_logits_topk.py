"""The compiled one-pass top-k over logits rows against its torch reference.

Its order is part of the contract (larger first, equal logits by lower id, NaN above
every number), because greedy acceptance reads column 0 as the target's argmax: a tie
broken differently would emit a token plain decoding never emits.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
import torch

from vllm_graft import ops
from vllm_graft.ops_reference import reference_logits_topk

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    ),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
QWEN_VOCAB = 151936
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _logits(rows: int, vocab: int, dtype: torch.dtype, seed: int, device: str,
            ties: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen)
    if ties:  # few distinct values, so most comparisons are ties
        logits = torch.randint(-3, 3, (rows, vocab), generator=gen).float()
    return logits.to(device, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("vocab, k", [(37, 1), (37, 8), (37, 37), (1000, 64), (QWEN_VOCAB, 8)])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_matches_reference(device, dtype, vocab, k, ties):
    logits = _logits(7, vocab, dtype, seed=vocab + k, device=device, ties=ties)
    out = ops.logits_topk(logits, k)
    assert out.dtype == torch.int64 and out.shape == (7, k) and out.device == logits.device
    assert torch.equal(out, reference_logits_topk(logits, k))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_column_zero_is_argmax_with_ties_nan_and_infinities(device, dtype):
    logits = _logits(8, 300, dtype, seed=1, device=device)
    logits[0] = 0.0  # every entry tied: id 0
    logits[1, [250, 17, 100]] = 50.0  # a three-way tie at the top: id 17
    logits[2, [90, 40]] = float("nan")  # NaN beats numbers: the first NaN
    logits[3] = float("-inf")  # all -inf
    logits[4, [5, 6]] = float("inf")
    logits[5, 299] = 1e4  # the last column
    out = ops.logits_topk(logits, 4)
    assert torch.equal(out[:, 0], logits.argmax(dim=-1))
    assert out[1, :3].tolist() == [17, 100, 250]
    assert out[2, :2].tolist() == [40, 90]
    assert out[3].tolist() == [0, 1, 2, 3]
    assert torch.equal(out, reference_logits_topk(logits, 4))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("row_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_selected_rows_read_in_place(device, row_dtype):
    base = _logits(10, 500, torch.float32, seed=3, device=device)
    logits = base[::2]  # a row stride of two rows: read where they lie, no copy needed
    rows = torch.tensor([4, -1, 0, 0, 2], dtype=row_dtype, device=device)
    out = ops.logits_topk(logits, 5, rows)
    assert torch.equal(out, reference_logits_topk(logits, 5, rows))
    assert out[1].tolist() == [-1] * 5
    assert torch.equal(out[2], out[3])


@pytest.mark.parametrize("device", DEVICES)
def test_empty_rows(device):
    logits = _logits(3, 50, torch.float32, seed=0, device=device)
    out = ops.logits_topk(logits, 4, torch.zeros(0, dtype=torch.long, device=device))
    assert out.shape == (0, 4)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    logits = _logits(6, 200, torch.float32, seed=5, device=device)
    rows = torch.tensor([5, -1, 2], device=device)
    torch.library.opcheck(torch.ops.vllm_graft.logits_topk.default, (logits, rows, 8))


def test_torch_compile_traces_it():
    logits = _logits(4, 100, torch.float32, seed=2, device="cpu")
    compiled = torch.compile(lambda x: ops.logits_topk(x, 3, check=False),
                             backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(logits), reference_logits_topk(logits, 3))


BAD = [
    ("int-logits", lambda x, r: (x.long(), r, 2), RuntimeError,
     "logits must be float32, float16, bfloat16 or float64, got Long"),
    ("1d-logits", lambda x, r: (x[0], r, 2), RuntimeError, r"logits must be 2-D \[rows, vocab\]"),
    ("column-stride", lambda x, r: (x.t(), r, 2), RuntimeError, "logits rows must be contiguous"),
    ("float-rows", lambda x, r: (x, r.float(), 2), RuntimeError,
     "rows must be int32 or int64, got Float"),
    ("2d-rows", lambda x, r: (x, r.view(1, -1), 2), RuntimeError, "rows must be 1-D"),
    ("k-zero", lambda x, r: (x, r, 0), RuntimeError, r"k must be in \[1, 64\], got 0"),
    ("k-65", lambda x, r: (x, r, 65), RuntimeError, r"k must be in \[1, 64\], got 65"),
    ("k-over-vocab", lambda x, r: (x[:, :3], r, 4), RuntimeError,
     r"k = 4 exceeds the vocabulary \(3 columns\)"),
    ("row-too-large", lambda x, r: (x, torch.tensor([0, 6]), 2), ValueError,
     r"rows\[1\] = 6 is out of range \[-1, 6\)"),
    ("row-below-minus-one", lambda x, r: (x, torch.tensor([-2]), 2), ValueError,
     r"rows\[0\] = -2 is out of range"),
]


@pytest.mark.parametrize("make_args, error, message",
                         [pytest.param(*case[1:], id=case[0]) for case in BAD])
def test_rejects_bad_input(make_args, error, message):
    logits = _logits(6, 10, torch.float32, seed=0, device="cpu")
    rows = torch.tensor([0, 5])
    logits, rows, k = make_args(logits, rows)
    with pytest.raises(error, match=message):
        ops.logits_topk(logits, k, rows)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_checks_rows_when_asked_and_never_reads_outside():
    logits = _logits(6, 10, torch.float32, seed=0, device="cuda")
    rows = torch.tensor([0, 6], device="cuda")
    with pytest.raises(ValueError, match=r"rows\[1\] = 6 is out of range"):
        ops.logits_topk(logits, 2, rows)
    assert ops.logits_topk(logits, 2, rows, check=False)[1].tolist() == [-1, -1]


# The CUDA kernel splits each row across blocks when there are few rows: each block takes
# the top-k of one slice, and the row's last block to finish merges the slices' lists.
# The split rule is mirrored here from the kernel header, whose constants it reads.
_TOPK_HEADER = Path(__file__).resolve().parents[2] / "csrc" / "kernels" / "topk_kernels.cuh"


@functools.cache
def _header_constant(name: str) -> int:
    match = re.search(rf"constexpr int(?:64_t)? {name} = (\d+);", _TOPK_HEADER.read_text())
    assert match, f"{name} not found in {_TOPK_HEADER.name}"
    return int(match.group(1))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _slice_length(vocab: int, splits: int) -> int:
    """logits_topk_slice_length: ceil(vocab / splits) rounded up to the alignment."""
    if splits <= 1:
        return vocab
    align = _header_constant("kLogitsTopkSliceAlign")
    return _ceil_div(_ceil_div(vocab, splits), align) * align


def _split_count(num_rows: int, vocab: int, sm_count: int) -> int:
    """logits_topk_split_count: slices per row the launcher picks on sm_count SMs."""
    if num_rows < 1 or sm_count < 1:
        return 1
    splits = _ceil_div(_header_constant("kLogitsTopkBlocksPerSm") * sm_count, num_rows)
    splits = min(splits, vocab // _header_constant("kMinLogitsTopkSlice"),
                 _header_constant("kMaxLogitsTopkSplits"))
    if splits <= 1:
        return 1
    return _ceil_div(vocab, _slice_length(vocab, splits))  # rounding may leave fewer


def _best_heads(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per row, the column of the best (value, id) in the op's order; ids -1 are empty."""
    valid = ids >= 0
    nan = values.isnan() & valid
    never = torch.iinfo(torch.int64).max
    first_nan = torch.where(nan, ids, never).argmin(1)  # several NaNs: the lowest id
    numbers = valid & ~nan
    top = torch.where(numbers, values, float("-inf")).max(1, keepdim=True).values
    first_top = torch.where(numbers & (values == top), ids, never).argmin(1)
    return torch.where(nan.any(1), first_nan, first_top)


def _split_topk(logits: torch.Tensor, k: int, rows: torch.Tensor, splits: int) -> torch.Tensor:
    """The split kernel in torch: each of the splits slices' top-k in the op's order (padded
    with -1 past a short slice), then k rounds taking the best head of the slices' lists."""
    picked = logits[rows.clamp(min=0).long()]
    picked = picked.double() if picked.dtype == torch.float64 else picked.float()
    num_rows, vocab = picked.shape
    length = _slice_length(vocab, splits)
    list_values = torch.zeros(num_rows, splits, k, dtype=picked.dtype)
    list_ids = torch.full((num_rows, splits, k), -1, dtype=torch.long)
    for s in range(splits):
        begin, end = s * length, min((s + 1) * length, vocab)
        if begin >= end:
            continue
        # a stable descending sort is the op's order: NaN first, equal values by id
        order = picked[:, begin:end].sort(dim=1, descending=True, stable=True).indices[:, :k]
        taken = order.shape[1]
        list_ids[:, s, :taken] = order + begin
        list_values[:, s, :taken] = picked[:, begin:end].gather(1, order)
    heads = torch.zeros(num_rows, splits, dtype=torch.long)
    out = torch.full((num_rows, k), -1, dtype=torch.long)
    for r in range(k):
        at = heads.clamp(max=k - 1).unsqueeze(2)
        head_values = list_values.gather(2, at).squeeze(2)
        head_ids = torch.where(heads < k, list_ids.gather(2, at).squeeze(2), -1)
        column = _best_heads(head_values, head_ids)
        winner = head_ids.gather(1, column.unsqueeze(1)).squeeze(1)
        out[:, r] = winner
        heads.scatter_add_(1, column.unsqueeze(1), (winner >= 0).long().unsqueeze(1))
    return torch.where((rows >= 0).unsqueeze(1), out, -1)


# A last slice of one logit (k > slice length) for up to ~30 rows on 16+ SMs.
SHORT_LAST_SLICE_VOCAB = 69633
SPLIT_VOCABS = [QWEN_VOCAB, 4097, 8193, 50257, SHORT_LAST_SLICE_VOCAB]


def _patterned(logits: torch.Tensor, pattern: str, seed: int) -> torch.Tensor:
    """Ties and NaNs that straddle slice boundaries, on a float copy of logits."""
    rows, vocab = logits.shape
    logits = logits.float()
    gen = torch.Generator().manual_seed(seed)
    if pattern == "ties":  # few distinct values: ties within and across every slice
        logits = torch.randint(-3, 3, (rows, vocab), generator=gen).float()
    elif pattern == "nan":  # NaNs spread over the slices, a tied top, a -inf row
        nan_at = torch.randint(0, vocab, (rows, 5), generator=gen)
        logits.scatter_(1, nan_at, float("nan"))
        logits[:, [vocab - 1, 0, vocab // 2]] = 9.0
        logits[0, :vocab // 3] = float("nan")
        logits[-1] = float("-inf")
    elif pattern == "flat":  # every slice offers the same values
        logits[:] = 1.0
        logits[:, -1] = 2.0
    return logits


@pytest.mark.parametrize("sm_count, num_rows", [(132, 1), (132, 61), (16, 7)])
@pytest.mark.parametrize("vocab", SPLIT_VOCABS)
@pytest.mark.parametrize("k", [1, 8, 64])
@pytest.mark.parametrize("pattern", ["distinct", "ties", "nan", "flat"])
def test_split_topk_merge_rule(sm_count, num_rows, vocab, k, pattern):
    """Merging the slices' top-k in the op's order gives the whole row's top-k, with the
    slices the launcher picks for num_rows rows on sm_count SMs (rows are independent, so
    three of them stand for all)."""
    splits = _split_count(num_rows, vocab, sm_count)
    seed = num_rows * 7 + vocab + k
    logits = _patterned(_logits(3, vocab, torch.float32, seed, "cpu"), pattern, seed)
    rows = torch.tensor([0, -1, 2])
    assert torch.equal(_split_topk(logits, k, rows, splits),
                       reference_logits_topk(logits, k, rows))


def test_split_rule_shapes():
    """The rule splits few rows into slices of a few thousand logits, none empty."""
    assert _split_count(600, QWEN_VOCAB, 132) == 1  # enough rows: one block each
    assert _split_count(61, QWEN_VOCAB, 132) > 1  # a batch-1 Graft step
    assert _split_count(1, 4097, 132) == 1  # too short to split
    for sm_count in (16, 108, 132):
        for num_rows in range(1, 70):
            for vocab in [*SPLIT_VOCABS, 262144, 64]:
                splits = _split_count(num_rows, vocab, sm_count)
                length = _slice_length(vocab, splits)
                assert 1 <= splits <= _header_constant("kMaxLogitsTopkSplits")
                assert (splits - 1) * length < vocab <= splits * length  # no empty slice
                if splits > 1:
                    assert length >= _header_constant("kMinLogitsTopkSlice")
    splits = _split_count(5, SHORT_LAST_SLICE_VOCAB, 132)
    assert SHORT_LAST_SLICE_VOCAB - (splits - 1) * _slice_length(SHORT_LAST_SLICE_VOCAB,
                                                                 splits) == 1


def _sm_count() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("num_rows", [1, 5, 61, 64])
@pytest.mark.parametrize("vocab", SPLIT_VOCABS)
@pytest.mark.parametrize("k", [1, 8, 64])
@pytest.mark.parametrize("pattern", ["distinct", "ties", "nan"])
def test_cuda_split_rows_match_reference(dtype, num_rows, vocab, k, pattern):
    seed = num_rows + vocab + k
    logits = _patterned(_logits(num_rows, vocab, torch.float32, seed, "cpu"), pattern, seed)
    logits = logits.to("cuda", dtype)
    rows = torch.arange(num_rows, device="cuda").flip(0)
    if num_rows > 1:
        rows[num_rows // 2] = -1
    out = ops.logits_topk(logits, k, rows)
    assert torch.equal(out, reference_logits_topk(logits, k, rows))
    again = ops.logits_topk(logits, k, rows)  # the tickets were left at zero
    assert torch.equal(again, out)


@CUDA
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("pattern", ["ties", "nan", "flat"])
def test_cuda_split_rows_every_dtype(dtype, pattern):
    logits = _patterned(_logits(3, QWEN_VOCAB, torch.float32, 11, "cpu"), pattern, 11)
    logits = logits.to("cuda", dtype)
    for k in (1, 64):
        assert torch.equal(ops.logits_topk(logits, k), reference_logits_topk(logits, k))


@CUDA
def test_cuda_split_path_is_taken_and_short_last_slice():
    splits = _split_count(3, SHORT_LAST_SLICE_VOCAB, _sm_count())
    length = _slice_length(SHORT_LAST_SLICE_VOCAB, splits)
    assert splits > 1 and SHORT_LAST_SLICE_VOCAB - (splits - 1) * length < 64
    logits = _logits(4, SHORT_LAST_SLICE_VOCAB, torch.float32, seed=9, device="cuda")
    logits[1, -1] = 1e4  # the best logit alone in the last slice
    logits[2, -1] = float("nan")
    rows = torch.tensor([0, 1, 2], device="cuda")
    out = ops.logits_topk(logits, 64, rows)
    assert out[1, 0].item() == out[2, 0].item() == SHORT_LAST_SLICE_VOCAB - 1
    assert torch.equal(out, reference_logits_topk(logits, 64, rows))


@CUDA
def test_cuda_split_rows_strided_repeated_and_out_of_range():
    base = _logits(12, QWEN_VOCAB, torch.bfloat16, seed=4, device="cuda")
    logits = base[::3]  # four rows, read in place
    logits[2, 1000:1010] = 7.0  # a tie at the top inside one slice
    logits[3, [5, QWEN_VOCAB - 5]] = 7.0  # and across the first and last slices
    rows = torch.tensor([3, 2, -1, 2, 9, 0], device="cuda")  # 9: out of range, skipped
    out = ops.logits_topk(logits, 16, rows, check=False)
    valid = torch.tensor([3, 2, -1, 2, -1, 0], device="cuda")
    assert torch.equal(out, reference_logits_topk(logits, 16, valid))
    assert out[0, :2].tolist() == [5, QWEN_VOCAB - 5]
    assert out[1, :10].tolist() == list(range(1000, 1010))
    assert out[4].tolist() == [-1] * 16


@CUDA
def test_cuda_split_rows_replay_in_a_graph():
    logits = _logits(2, QWEN_VOCAB, torch.float16, seed=6, device="cuda")
    rows = torch.tensor([1, 0], device="cuda")
    ops.logits_topk(logits, 8, rows, check=False)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.logits_topk(logits, 8, rows, check=False)
    for seed in (7, 8, 9):
        logits.copy_(_logits(2, QWEN_VOCAB, torch.float16, seed=seed, device="cuda"))
        graph.replay()
        assert torch.equal(out, reference_logits_topk(logits, 8, rows))
