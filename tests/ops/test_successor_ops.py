"""The compiled successor-matrix ops against the pure-torch reference.

Every sample runs through the real compiled ops: equality with the reference,
``torch.library.opcheck`` (schema, fake tensor, autograd registration, AOT
dispatch), the highest-index-wins rule for duplicate tokens, and clear errors
for bad input. CUDA cases are collected everywhere and skipped without a GPU.
"""

from __future__ import annotations

import doctest
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from vllm_graft import ops
from vllm_graft.ops_reference import reference_successor_gather, reference_successor_update_

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    ),
]

SMALL_VOCAB = 111
QWEN_VOCAB = 151936


@dataclass(frozen=True)
class Sample:
    """Sizes and dtypes of one generated input; tensors are built per device."""

    vocab_size: int
    k: int
    num_nodes: int
    token_dtype: torch.dtype
    next_token_dtype: torch.dtype = torch.int64
    seed: int = 0

    @property
    def id(self) -> str:
        dtypes = f"{str(self.token_dtype)[6:]}-{str(self.next_token_dtype)[6:]}"
        return f"V{self.vocab_size}-k{self.k}-N{self.num_nodes}-{dtypes}"


def _samples() -> list[Sample]:
    samples = []
    dtype_pairs = [
        (torch.int32, torch.int32),
        (torch.int64, torch.int64),
        (torch.int32, torch.int64),
        (torch.int64, torch.int32),
    ]
    for vocab_size in (SMALL_VOCAB, QWEN_VOCAB):
        for k in (1, 8):
            for seed, (token_dtype, next_dtype) in enumerate(dtype_pairs):
                samples.append(Sample(vocab_size, k, 200, token_dtype, next_dtype, seed))
    for token_dtype in (torch.int32, torch.int64):
        samples.append(Sample(SMALL_VOCAB, 8, 0, token_dtype, token_dtype))
    return samples


SAMPLES = [pytest.param(sample, id=sample.id) for sample in _samples()]


def _generator(sample: Sample) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + sample.seed)


def random_successors(sample: Sample, device: str) -> torch.Tensor:
    """[V, k] int32 with about a quarter of the entries empty (-1)."""
    gen = _generator(sample)
    shape = (sample.vocab_size, sample.k)
    values = torch.randint(0, sample.vocab_size, shape, generator=gen, dtype=torch.int32)
    empty = torch.rand(shape, generator=gen) < 0.25
    return values.masked_fill(empty, -1).to(device)


def gather_inputs(sample: Sample, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = _generator(sample)
    n, vocab_size, k = sample.num_nodes, sample.vocab_size, sample.k
    parents = torch.randint(-1, vocab_size, (n,), generator=gen)
    ranks = torch.randint(0, k, (n,), generator=gen)
    if n:
        parents[:3] = torch.tensor([vocab_size - 1, -1, 0])  # both vocab edges and "no parent"
        ranks[0] = k - 1
    dtype = sample.token_dtype
    return random_successors(sample, device), parents.to(device, dtype), ranks.to(device, dtype)


def update_inputs(sample: Sample, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = _generator(sample)
    n, vocab_size, k = sample.num_nodes, sample.vocab_size, sample.k
    # Tokens from a small pool so many nodes share a token and the winner rule matters.
    pool = torch.randint(0, vocab_size, (max(n // 4, 1),), generator=gen)
    tokens = pool[torch.randint(0, pool.numel(), (n,), generator=gen)]
    tokens[torch.rand(n, generator=gen) < 0.2] = -1
    next_tokens = torch.randint(0, vocab_size, (n, k), generator=gen)
    if n:
        tokens[:2] = torch.tensor([vocab_size - 1, -1])
        next_tokens[0, -1] = vocab_size - 1
    return (
        random_successors(sample, device),
        tokens.to(device, sample.token_dtype),
        next_tokens.to(device, sample.next_token_dtype),
    )


# ---- equality with the reference --------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sample", SAMPLES)
@pytest.mark.parametrize("check", [True, False], ids=["check", "nocheck"])
def test_gather_matches_reference(sample: Sample, device: str, check: bool):
    successors, parents, ranks = gather_inputs(sample, device)
    out = ops.successor_gather(successors, parents, ranks, check=check)
    assert out.dtype == torch.int32
    assert out.device == successors.device
    assert torch.equal(out, reference_successor_gather(successors, parents, ranks))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sample", SAMPLES)
@pytest.mark.parametrize("check", [True, False], ids=["check", "nocheck"])
def test_update_matches_reference(sample: Sample, device: str, check: bool):
    successors, tokens, next_tokens = update_inputs(sample, device)
    expected = successors.clone()
    reference_successor_update_(expected, tokens, next_tokens)
    result = ops.successor_update_(successors, tokens, next_tokens, check=check)
    assert result is None
    assert torch.equal(successors, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sample", SAMPLES)
def test_opcheck(sample: Sample, device: str):
    torch.library.opcheck(
        torch.ops.vllm_graft.successor_gather.default, gather_inputs(sample, device)
    )
    torch.library.opcheck(
        torch.ops.vllm_graft.successor_update_.default, update_inputs(sample, device)
    )


# ---- the winner rule ----------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("token_dtype", [torch.int32, torch.int64])
def test_update_highest_index_wins(device: str, token_dtype: torch.dtype):
    successors = torch.full((10, 2), -1, dtype=torch.int32, device=device)
    tokens = torch.tensor([5, 7, 5, -1, 5, 9], dtype=token_dtype, device=device)
    next_tokens = torch.tensor(
        [[1, 2], [3, 4], [5, 6], [7, 8], [9, 0], [9, 9]], dtype=torch.int64, device=device
    )
    ops.successor_update_(successors, tokens, next_tokens)
    expected = torch.full((10, 2), -1, dtype=torch.int32)
    expected[5] = torch.tensor([9, 0])  # node 4, the last of three nodes on token 5
    expected[7] = torch.tensor([3, 4])
    expected[9] = torch.tensor([9, 9])
    assert torch.equal(successors.cpu(), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("check", [True, False], ids=["check", "nocheck"])
def test_update_ignores_next_tokens_of_skipped_nodes(device: str, check: bool):
    # logits_topk leaves -1 in the rows it skipped; the update never reads them
    args = _valid_update(device)
    args["next_tokens"][2] = -1  # tokens[2] == -1
    expected = args["successors"].clone()
    reference_successor_update_(expected, args["tokens"], args["next_tokens"])
    ops.successor_update_(**args, check=check)
    assert torch.equal(args["successors"], expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_update_cpu_and_cuda_bit_identical():
    sample = Sample(QWEN_VOCAB, 8, 4096, torch.int64, seed=7)
    cpu_inputs = update_inputs(sample, "cpu")
    cuda_inputs = tuple(t.cuda() for t in cpu_inputs)
    ops.successor_update_(*cpu_inputs)
    ops.successor_update_(*cuda_inputs)
    assert torch.equal(cpu_inputs[0], cuda_inputs[0].cpu())


# ---- bad input ----------------------------------------------------------------------

V, K, N = SMALL_VOCAB, 8, 4


def _valid_gather(device: str) -> dict[str, torch.Tensor]:
    return {
        "successors": torch.zeros(V, K, dtype=torch.int32, device=device),
        "parent_tokens": torch.tensor([0, 1, -1, V - 1], device=device),
        "ranks": torch.tensor([0, K - 1, 0, 3], device=device),
    }


def _valid_update(device: str) -> dict[str, torch.Tensor]:
    return {
        "successors": torch.zeros(V, K, dtype=torch.int32, device=device),
        "tokens": torch.tensor([0, 1, -1, V - 1], device=device),
        "next_tokens": torch.zeros(N, K, dtype=torch.int64, device=device),
    }


def _set(tensor: torch.Tensor, index, value: int) -> torch.Tensor:
    tensor = tensor.clone()
    tensor[index] = value
    return tensor


# (case id, replaced argument, how to build its bad value, exception, message regex)
BAD_GATHER = [
    ("successors-float", "successors", lambda a: a["successors"].float(),
     RuntimeError, "successors must be int32, got Float"),
    ("successors-1d", "successors", lambda a: a["successors"].flatten(),
     RuntimeError, r"successors must be 2-D \[V, k\], got shape \[888\]"),
    ("successors-noncontiguous", "successors",
     lambda a: torch.zeros(K, V, dtype=torch.int32, device=a["successors"].device).t(),
     RuntimeError, "successors must be contiguous"),
    ("parents-float", "parent_tokens", lambda a: a["parent_tokens"].float(),
     RuntimeError, "parent_tokens must be int32 or int64, got Float"),
    ("parents-2d", "parent_tokens", lambda a: a["parent_tokens"].view(2, 2),
     RuntimeError, r"parent_tokens must be 1-D, got shape \[2, 2\]"),
    ("ranks-dtype-mismatch", "ranks", lambda a: a["ranks"].int(),
     RuntimeError, "ranks must have the dtype of parent_tokens"),
    ("length-mismatch", "ranks", lambda a: a["ranks"][:3],
     RuntimeError, "ranks has 3 entries but parent_tokens has 4"),
    ("parent-equals-vocab", "parent_tokens", lambda a: _set(a["parent_tokens"], 2, V),
     ValueError, r"parent_tokens\[2\] = 111 is out of range \[-1, 111\)"),
    ("parent-below-minus-one", "parent_tokens", lambda a: _set(a["parent_tokens"], 0, -2),
     ValueError, r"parent_tokens\[0\] = -2 is out of range"),
    ("rank-equals-k", "ranks", lambda a: _set(a["ranks"], 1, K),
     ValueError, r"ranks\[1\] = 8 is out of range \[0, 8\)"),
    ("rank-negative", "ranks", lambda a: _set(a["ranks"], 3, -1),
     ValueError, r"ranks\[3\] = -1 is out of range \[0, 8\)"),
]

BAD_UPDATE = [
    ("successors-int64", "successors", lambda a: a["successors"].long(),
     RuntimeError, "successors must be int32, got Long"),
    ("successors-noncontiguous", "successors",
     lambda a: torch.zeros(K, V, dtype=torch.int32, device=a["successors"].device).t(),
     RuntimeError, "successors must be contiguous"),
    ("tokens-float", "tokens", lambda a: a["tokens"].float(),
     RuntimeError, "tokens must be int32 or int64, got Float"),
    ("next-tokens-1d", "next_tokens", lambda a: a["next_tokens"].flatten(),
     RuntimeError, "next_tokens must be 2-D"),
    ("next-tokens-int16", "next_tokens", lambda a: a["next_tokens"].short(),
     RuntimeError, "next_tokens must be int32 or int64, got Short"),
    ("row-count-mismatch", "next_tokens", lambda a: a["next_tokens"][:3],
     RuntimeError, "next_tokens has 3 rows but tokens has 4 entries"),
    ("k-mismatch", "next_tokens", lambda a: a["next_tokens"][:, :4].contiguous(),
     RuntimeError, "next_tokens has k = 4 columns but successors has k = 8"),
    ("token-equals-vocab", "tokens", lambda a: _set(a["tokens"], 1, V),
     ValueError, r"tokens\[1\] = 111 is out of range \[-1, 111\)"),
    ("token-below-minus-one", "tokens", lambda a: _set(a["tokens"], 0, -5),
     ValueError, r"tokens\[0\] = -5 is out of range"),
    ("next-token-equals-vocab", "next_tokens", lambda a: _set(a["next_tokens"], (1, 3), V),
     ValueError, r"next_tokens\[1, 3\] = 111 is out of range \[0, 111\)"),
    ("next-token-negative", "next_tokens", lambda a: _set(a["next_tokens"], (3, 0), -1),
     ValueError, r"next_tokens\[3, 0\] = -1 is out of range \[0, 111\)"),
]


def _skip_unchecked_range_case_on_cuda(device: str, check: bool, error: type) -> None:
    if device == "cuda" and not check and error is ValueError:
        pytest.skip("with check=False the CUDA kernels do not validate id ranges (by design)")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("check", [True, False], ids=["check", "nocheck"])
@pytest.mark.parametrize(
    "argument, make_bad, error, message",
    [pytest.param(*case[1:], id=case[0]) for case in BAD_GATHER],
)
def test_gather_rejects_bad_input(device, check, argument, make_bad, error, message):
    _skip_unchecked_range_case_on_cuda(device, check, error)
    args = _valid_gather(device)
    args[argument] = make_bad(args)
    with pytest.raises(error, match=message):
        ops.successor_gather(**args, check=check)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("check", [True, False], ids=["check", "nocheck"])
@pytest.mark.parametrize(
    "argument, make_bad, error, message",
    [pytest.param(*case[1:], id=case[0]) for case in BAD_UPDATE],
)
def test_update_rejects_bad_input(device, check, argument, make_bad, error, message):
    _skip_unchecked_range_case_on_cuda(device, check, error)
    args = _valid_update(device)
    args[argument] = make_bad(args)
    before = args["successors"].clone()
    with pytest.raises(error, match=message):
        ops.successor_update_(**args, check=check)
    assert torch.equal(args["successors"], before), "a rejected update must not write"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_mixed_devices_rejected():
    args = _valid_gather("cuda")
    args["ranks"] = args["ranks"].cpu()
    with pytest.raises(RuntimeError, match="ranks is on cpu but successors is on cuda"):
        ops.successor_gather(**args, check=False)
    args = _valid_update("cuda")
    args["tokens"] = args["tokens"].cpu()
    with pytest.raises(RuntimeError, match="tokens is on cpu but successors is on cuda"):
        ops.successor_update_(**args, check=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_unchecked_ops_never_synchronise_the_device():
    """Graft's engine runs the ops unchecked (``SuccessorMatrix.check``): a tree build
    gathers eight levels, and each checked call waits for the GPU. Under torch's sync
    debugging an unchecked gather and update run through; a checked one is caught."""
    gather, update = _valid_gather("cuda"), _valid_update("cuda")
    ops.successor_gather(**gather, check=False)  # kernels loaded before watching
    ops.successor_update_(**update, check=False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.successor_gather(**gather, check=False)
        ops.successor_update_(**update, check=False)
        with pytest.raises(RuntimeError, match="synchroniz"):
            ops.successor_gather(**gather, check=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---- integration --------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_traces_both_ops(device: str):
    def draft_then_verify(successors, parents, ranks, tokens, next_tokens):
        drafted = ops.successor_gather(successors, parents, ranks, check=False)
        ops.successor_update_(successors, tokens, next_tokens, check=False)
        return drafted

    compiled = torch.compile(draft_then_verify, backend="aot_eager", fullgraph=True)
    sample = Sample(SMALL_VOCAB, 8, 50, torch.int64)
    successors, parents, ranks = gather_inputs(sample, device)
    _, tokens, next_tokens = update_inputs(sample, device)
    expected_successors = successors.clone()
    expected_drafted = reference_successor_gather(expected_successors, parents, ranks)
    reference_successor_update_(expected_successors, tokens, next_tokens)

    drafted = compiled(successors, parents, ranks, tokens, next_tokens)
    assert torch.equal(drafted, expected_drafted)
    assert torch.equal(successors, expected_successors)


def test_cuda_ops_available_reports_registration():
    assert isinstance(ops.cuda_ops_available(), bool)
    if torch.cuda.is_available():
        assert ops.cuda_ops_available(), (
            "a GPU is visible but vllm_graft._C has no CUDA kernels; rebuild with "
            "VLLM_GRAFT_BUILD_CUDA=1 pip install --no-build-isolation -e ."
        )


def test_docstring_examples_run():
    result = doctest.testmod(ops, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0
    assert result.failed == 0


def test_missing_extension_error_says_how_to_build():
    # Blocking the extension module makes `import vllm_graft._C` fail as an unbuilt tree would.
    script = (
        "import sys\n"
        "sys.modules['vllm_graft._C'] = None\n"
        "try:\n"
        "    import vllm_graft.ops\n"
        "except ImportError as error:\n"
        "    assert 'pip install --no-build-isolation -e .' in str(error), error\n"
        "    assert isinstance(error.__cause__, ImportError), error.__cause__\n"
        "else:\n"
        "    raise SystemExit('importing vllm_graft.ops did not fail')\n"
    )
    run_python(script)


def run_python(script: str) -> str:
    """``script``'s standard output in a fresh interpreter, which must exit 0."""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.skipif(shutil.which("ldd") is None, reason="ldd (Linux) is needed to read links")
def test_extension_links_libstdcxx_dynamically():
    # torch uses the shared libstdc++; a statically linked second copy in vllm_graft._C
    # disagrees with it on locale facets, and the first error message that formats a
    # number segfaults (seen on a GPU image whose Python names a compiler that links it
    # statically). The ops must share torch's copy.
    import vllm_graft._C as extension

    links = subprocess.run(["ldd", extension.__file__], capture_output=True, text=True).stdout
    assert "libstdc++" in links, (
        f"{extension.__file__} does not link libstdc++ dynamically; rebuild with a compiler "
        f"that does (CXX=/usr/bin/g++ LDSHARED='/usr/bin/g++ -shared'):\n{links}")


@pytest.mark.skipif(shutil.which("nm") is None, reason="nm (binutils) is needed to read symbols")
def test_cpu_kernels_are_built_to_run_on_torch_threads():
    # ATen's parallel_for is a header template: its loop runs on torch's intra-op threads
    # only where the including source is compiled with OpenMP. Built without it, every
    # CPU kernel here ran on one thread (the top-k pass over a chain step's logits rows
    # took about twice as long on 2 cores).
    import vllm_graft._C as extension

    symbols = subprocess.run(["nm", "-D", "--undefined-only", extension.__file__],
                             capture_output=True, text=True, check=True).stdout
    assert "GOMP_parallel" in symbols, (
        f"{extension.__file__} was built without OpenMP (no GOMP_parallel import): "
        f"setup.py must pass -fopenmp to the C++ compiler and linker")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_ops_share_torchs_openmp_runtime():
    # The extension names libgomp.so.1 as torch does; the loader must reuse the copy torch
    # loaded (one thread pool), not add the compiler's own beside it.
    loaded = run_python(
        "import torch, vllm_graft.ops as ops\n"
        "ops.logits_topk(torch.randn(64, 4096), 4)\n"
        "paths = {line.split()[-1] for line in open('/proc/self/maps') if 'libgomp' in line}\n"
        "print(len(paths), sorted(paths))\n")
    assert loaded.split()[0] in ("0", "1"), loaded
