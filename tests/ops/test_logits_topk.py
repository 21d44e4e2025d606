"""The compiled one-pass top-k over logits rows against its torch reference.

Its order is part of the contract (larger first, equal logits by lower id, NaN above
every number), because greedy acceptance reads column 0 as the target's argmax: a tie
broken differently would emit a token plain decoding never emits.
"""

from __future__ import annotations

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
