"""The fused step's Triton kernels (``vllm_graft/kernels/graft_step_triton.py``) against
the CPU ops they implement (``csrc/graft_step.cpp``), on the same inputs, under Triton's
interpreter (collected only with TRITON_INTERPRET=1; see ../conftest.py).

Draft steps: whole builds of random answers (NaN, -inf and +inf log-probabilities, tied
scores, checkpoints that stop some requests, every float dtype, int32 and int64 tokens,
a non-contiguous ``logprobs``, stage / steps as columns of a packed buffer, state left
over from an earlier build), and the fused builder's own builds with the Triton step in
place of the CPU op. Acceptance: trees of the fused builder (bench_core's drafter and
steered logits) and random trees (siblings with equal tokens, invalid rows, every source
tag, learn rows shared within and across requests), on the strided packed columns the
step uses; sampled walks mix greedy requests with temperatures, top-k (1, 2, 10, off,
ties at the k-th value) and top-p (1.0 down to 0.02, ties at the cut), and root-only trees
test the residual sample, i.e. the sampling distribution itself. Every output is poisoned
first, so an unwritten entry fails. Each launcher runs one kernel and no tensor op but
dtype views (no value read on the host), and names the op and the argument it rejects.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from vllm_graft import ops
from vllm_graft.core.config import GraftConfig
from vllm_graft.kernels import graft_step_triton
from vllm_graft.kernels.graft_step_triton import (graft_accept_greedy_cuda,
                                                  graft_accept_sampled_cuda,
                                                  graft_draft_step_cuda)

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"
POISON = 12345
DRAFT_STATE = ("pool_tokens", "pool_parents", "pool_scores", "frontier_ids",
               "frontier_tokens", "frontier_scores", "lineage", "going", "stage", "steps",
               "confidence")
ACCEPT_OUTPUTS = ops.ACCEPT_OUTPUTS

# NumPy's warnings from the interpreter: inf - inf and exp overflow (as the CPU kernels
# compute them), loop bounds read from 1-element arrays
pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")]


@pytest.fixture(scope="module")
def bench_core():
    """``scripts/bench_core.py``: its drafter, steered logits and fused builder inputs."""
    spec = importlib.util.spec_from_file_location("bench_core", SCRIPTS / "bench_core.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_core"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("bench_core", None)


def assert_same(expected: torch.Tensor, actual: torch.Tensor, what: str) -> None:
    if expected.is_floating_point():
        # confidences come from exp: NumPy's in the interpreter, the C library's on CPU
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0, equal_nan=True,
                                   msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(actual, expected), f"{what}:\n{expected}\n{actual}"


# ---- graft_draft_step ---------------------------------------------------------------
def draft_state(batch: int, k: int, depth: int, seed: int) -> dict[str, torch.Tensor]:
    """The draft state filled with junk (step 0 resets it); stage and steps are columns of
    a packed buffer, as in StepBuffers."""
    g = torch.Generator().manual_seed(seed)
    pool = k + (depth - 1) * k * k

    def ints(*shape):
        return torch.randint(-3, 40, shape, generator=g)

    packed = ints(batch, 5)
    return dict(pool_tokens=ints(batch, pool), pool_parents=ints(batch, pool),
                pool_scores=torch.randn(batch, pool, generator=g),
                frontier_ids=ints(batch, k), frontier_tokens=ints(batch, k),
                frontier_scores=torch.randn(batch, k, generator=g),
                lineage=ints(batch, k, depth),
                going=torch.rand(batch, generator=g) < 0.5,
                stage=packed[:, 1], steps=packed[:, 3],
                confidence=torch.randn(batch, depth, generator=g))


def draft_answer(batch: int, width: int, k: int, dtype: torch.dtype,
                 token_dtype: torch.dtype, ties: bool, g: torch.Generator):
    """A drafter's answer: log-probs with NaN, -inf and +inf sprinkled in, as a
    non-contiguous [B, W, k] view."""
    logprobs = -torch.rand(batch, width, k, generator=g) * 5
    if ties:
        logprobs = (logprobs * 2).round() / 2
    special = torch.rand(batch, width, k, generator=g)
    logprobs[special < 0.06] = float("nan")
    logprobs[(special >= 0.06) & (special < 0.12)] = float("-inf")
    logprobs[(special >= 0.12) & (special < 0.14)] = float("inf")
    strided = torch.empty(batch, k, width, dtype=dtype).transpose(1, 2)
    strided.copy_(logprobs)
    tokens = torch.randint(0, 1000, (batch, width, k), generator=g).to(token_dtype)
    return strided, tokens


DRAFT_CASES = [  # batch, top_k, depth, checkpoints, logprobs dtype, token dtype, ties
    (1, 1, 4, (0, 2), torch.float32, torch.int64, False),
    (3, 2, 4, (1,), torch.float16, torch.int32, True),
    (8, 10, 3, (0, 1), torch.float32, torch.int64, True),
    (3, 4, 1, (0,), torch.bfloat16, torch.int64, False),
    (8, 3, 5, (), torch.float64, torch.int32, False),
]


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("batch, k, depth, checkpoints, dtype, token_dtype, ties",
                         DRAFT_CASES)
def test_draft_step_matches_cpu(batch, k, depth, checkpoints, dtype, token_dtype, ties,
                                seed):
    thresholds = torch.tensor([0.3, 0.12, 0.04])
    seed = seed * 1000 + batch * 100 + k * 10 + depth
    expected, actual = draft_state(batch, k, depth, seed), draft_state(batch, k, depth, seed)
    g = torch.Generator().manual_seed(seed)
    stopped = False
    for build in range(2):  # the second build starts from the first one's state
        for step in range(depth):
            logprobs, tokens = draft_answer(batch, 1 if step == 0 else k, k, dtype,
                                            token_dtype, ties, g)
            checkpoint = checkpoints.index(step) if step in checkpoints else -1
            torch.ops.vllm_graft.graft_draft_step.default(
                logprobs, tokens, thresholds, step, checkpoint,
                *(expected[name] for name in DRAFT_STATE))
            graft_draft_step_cuda(logprobs, tokens, thresholds, step, checkpoint,
                                  *(actual[name] for name in DRAFT_STATE))
            for name in DRAFT_STATE:
                assert_same(expected[name], actual[name],
                            f"build {build} step {step} {name}")
            stopped = stopped or not bool(expected["going"].all())
    assert stopped or not checkpoints, "no request ever stopped at a checkpoint"


@pytest.mark.parametrize("batch, top_k, depth", [(3, 10, 7), (2, 2, 5)])
def test_fused_builds_match_with_triton_steps(bench_core, monkeypatch, batch, top_k, depth):
    # The fused builder's own builds (bench_core's drafter, calibrated checkpoints) with the
    # Triton step in place of the CPU op: the same state and the same trees.
    cfg = GraftConfig(budget=60) if top_k == 10 else GraftConfig(
        budget=20, top_k=top_k, max_depth=depth, checkpoints=(1,), draft_keep=(4,),
        thresholds=(0.3,))
    builder, drafter, roots = bench_core.build_inputs(batch, 1000, "compiled", cfg,
                                                      torch.device("cpu"), fused_ops=True)
    names = DRAFT_STATE + ops.TREE_OUTPUTS

    def build() -> dict[str, torch.Tensor]:
        buffers = builder.fused.build(roots, drafter, successors=builder.matrix.table)
        return {name: getattr(buffers, name).clone() for name in names}

    expected = build()
    monkeypatch.setattr(ops, "graft_draft_step", graft_draft_step_cuda)
    actual = build()
    for name in names:
        assert_same(expected[name], actual[name], name)


# ---- acceptance: inputs ---------------------------------------------------------------
SOURCE_TAGS = torch.tensor([0, 1, 2, 3, 4, 8, 9, 10, 11, 12, 5, 6], dtype=torch.uint8)


def packed_rows(values: torch.Tensor, offset: int = 2) -> torch.Tensor:
    """``values`` as a column slice of a wider buffer (strided rows)."""
    wide = torch.full((values.shape[0], values.shape[1] + offset + 3), 7, dtype=values.dtype)
    wide[:, offset:offset + values.shape[1]] = values
    return wide[:, offset:offset + values.shape[1]]


def accept_outputs(batch: int, levels: int) -> dict[str, torch.Tensor]:
    """Poisoned outputs as columns of one packed buffer (StepBuffers' layout)."""
    widths = {"num_accepted": 1, "accepted_sources": 5, "output_tokens": levels + 1,
              "accepted_rows": levels}
    packed = torch.full((batch, 3 + sum(widths.values())), POISON, dtype=torch.long)
    out, start = {}, 2
    for name, width in widths.items():
        out[name] = packed[:, start] if name == "num_accepted" else \
            packed[:, start:start + width]
        start += width
    return out


def random_trees(batch: int, rows: int, vocab: int, token_range: int, g: torch.Generator,
                 partitions: int = 2) -> dict[str, torch.Tensor]:
    """Parents-first random trees: parents anywhere before a row, some rows invalid (and
    their subtrees), tokens from a small range (siblings may repeat a token), every
    source tag; learn rows in one of ``partitions`` matrix partitions (or none)."""
    parents = torch.full((batch, rows), -1)
    depth = torch.zeros(batch, rows, dtype=torch.long)
    valid = torch.zeros(batch, rows, dtype=torch.bool)
    valid[:, 0] = True
    for r in range(1, rows):
        parent = (torch.rand(batch, generator=g) * r).long()
        parents[:, r] = parent
        depth[:, r] = depth.gather(1, parent[:, None])[:, 0] + 1
        valid[:, r] = (torch.rand(batch, generator=g) < 0.85) \
            & valid.gather(1, parent[:, None])[:, 0]
    tokens = torch.randint(0, min(token_range, vocab), (batch, rows), generator=g)
    source = SOURCE_TAGS[torch.randint(0, len(SOURCE_TAGS), (batch, rows), generator=g)]
    partition = torch.randint(-1, partitions, (batch, 1), generator=g)
    learn = torch.where(valid & (source != 4) & (partition >= 0),
                        tokens + partition.clamp(min=0) * vocab, -1)
    levels = int(torch.where(valid, depth, 0).max())
    return dict(tree_tokens=packed_rows(tokens), tree_parents=parents, tree_valid=valid,
                tree_source=source, learn_rows=learn, levels=levels)


def steered_row_topk(tree: dict, vocab: int, k: int, g: torch.Generator,
                     follow: float = 0.8) -> torch.Tensor:
    """[B * rows, k] random top-k whose column 0 is, at most rows, a child's token."""
    tokens, parents, valid = tree["tree_tokens"], tree["tree_parents"], tree["tree_valid"]
    batch, rows = tokens.shape
    top = torch.randint(0, vocab, (batch, rows, k), generator=g)
    is_child = (parents[:, None, :] == torch.arange(rows)[None, :, None]) & valid[:, None, :]
    pick = torch.where(is_child, torch.rand(batch, rows, rows, generator=g), -1.0).argmax(2)
    follows = is_child.any(2) & (torch.rand(batch, rows, generator=g) < follow)
    top[..., 0] = torch.where(follows, tokens.gather(1, pick), top[..., 0])
    return top.view(batch * rows, k)


def builder_trees(bench_core, batch: int, vocab: int, cfg: GraftConfig, seed: int):
    """The fused builder's trees (StepBuffers' strided views), steered logits [N, V] and
    the successor matrix; every third request's logits are left unsteered (early
    rejections)."""
    builder, drafter, roots = bench_core.build_inputs(batch, vocab, "compiled", cfg,
                                                      torch.device("cpu"), fused_ops=True)
    buffers = builder.fused.build(roots, drafter, successors=builder.matrix.table)
    tree = buffers.tree()
    logits = bench_core.steer_logits(tree, vocab, batch, seed)
    g = torch.Generator().manual_seed(seed)
    plain = torch.arange(batch) % 3 == 1
    logits[plain] = torch.randn(int(plain.sum()), *logits.shape[1:], generator=g) * 3
    rows = torch.where(buffers.tree_valid, buffers.row_index, -1)
    return buffers, logits.view(-1, vocab), rows, builder.matrix.table


def run_accept(kind: str, tree: dict, row_topk: torch.Tensor, successors: torch.Tensor,
               vocab: int, levels: int, sampled: tuple = ()) -> dict[str, torch.Tensor]:
    """The CPU op and the Triton launcher on the same inputs; asserts equal outputs and
    matrices, returns the CPU's outputs."""
    common = (tree["tree_tokens"], tree["tree_parents"], tree["tree_valid"],
              tree["tree_source"])
    batch = tree["tree_tokens"].shape[0]
    results = []
    for op in ("cpu", "triton"):
        matrix = successors.clone()
        out = accept_outputs(batch, levels)
        if kind == "greedy":
            fn = torch.ops.vllm_graft.graft_accept_greedy.default if op == "cpu" \
                else graft_accept_greedy_cuda
            fn(*common, row_topk, tree["learn_rows"], vocab, matrix,
               *(out[name] for name in ACCEPT_OUTPUTS))
        else:
            logits, logit_rows, temperature, top_k, top_p, uniforms = sampled
            fn = torch.ops.vllm_graft.graft_accept_sampled.default if op == "cpu" \
                else graft_accept_sampled_cuda
            fn(logits, logit_rows, *common, temperature, top_k, top_p, uniforms, row_topk,
               tree["learn_rows"], vocab, matrix, *(out[name] for name in ACCEPT_OUTPUTS))
        results.append((out, matrix))
    (expected, expected_matrix), (actual, actual_matrix) = results
    for name in ACCEPT_OUTPUTS:
        assert_same(expected[name], actual[name], name)
    assert torch.equal(expected_matrix, actual_matrix), "successor matrices differ"
    assert not torch.equal(expected_matrix, successors) or not (tree["learn_rows"] >= 0).any()
    return expected


def buffers_tree(buffers) -> dict:
    return dict(tree_tokens=buffers.tree_tokens, tree_parents=buffers.tree_parents,
                tree_valid=buffers.tree_valid, tree_source=buffers.tree_source,
                learn_rows=buffers.learn_rows)


BUILDER_CASES = [  # batch, vocab, top_k, depth, budget (top_k 10: the default recipe)
    (1, 37, 1, 5, 8),
    (3, 1000, 2, 4, 20),
    (8, 5003, 10, 7, 60),
]


def builder_config(top_k: int, depth: int, budget: int) -> GraftConfig:
    if top_k == 10:
        return GraftConfig(budget=budget)
    return GraftConfig(budget=budget, top_k=top_k, max_depth=depth, checkpoints=(),
                       draft_keep=())


# ---- graft_accept_greedy --------------------------------------------------------------
@pytest.mark.parametrize("batch, vocab, top_k, depth, budget", BUILDER_CASES)
def test_accept_greedy_on_built_trees(bench_core, batch, vocab, top_k, depth, budget):
    buffers, logits, rows, successors = builder_trees(
        bench_core, batch, vocab, builder_config(top_k, depth, budget), seed=batch)
    row_topk = ops.logits_topk(logits, successors.shape[1], rows.view(-1))
    levels = buffers.accepted_rows.shape[1]
    out = run_accept("greedy", buffers_tree(buffers), row_topk, successors, vocab, levels)
    assert (out["num_accepted"] >= 2).any(), "the steered walks accept nothing"


@pytest.mark.parametrize("seed", range(12))
def test_accept_greedy_on_random_trees(seed):
    g = torch.Generator().manual_seed(seed)
    batch = (1, 3, 8)[seed % 3]
    rows = (1, 5, 33, 70)[seed % 4]
    vocab = (37, 1000)[seed % 2]
    k = (1, 3, 8)[seed // 4 % 3]
    tree = random_trees(batch, rows, vocab, token_range=(4, 50)[seed // 2 % 2], g=g)
    row_topk = steered_row_topk(tree, vocab, k, g)
    successors = torch.randint(-1, vocab, (2 * vocab, k), generator=g, dtype=torch.int32)
    levels = tree["levels"] + seed % 3  # a depth bound at or past the trees' depth
    run_accept("greedy", tree, row_topk, successors, vocab, levels)


# ---- graft_accept_sampled -------------------------------------------------------------
TEMPERATURES = torch.tensor([0.0, 0.4, 1.0, 1.0, 1.7])
TOP_PS = torch.tensor([1.0, 1.0, 0.97, 0.7, 0.3, 0.02])


def sampling_settings(batch: int, vocab: int, g: torch.Generator):
    """Per request: a temperature (0: greedy), a top-k (1, 2, 10, or off: 0, -1, V,
    past V) and a top-p (1.0: off, down to 0.02)."""
    pick = lambda n: torch.randint(0, n, (batch,), generator=g)  # noqa: E731
    top_ks = torch.tensor([0, 1, 2, 10, vocab, vocab + 5, -1])
    return (TEMPERATURES[pick(len(TEMPERATURES))], top_ks[pick(len(top_ks))],
            TOP_PS[pick(len(TOP_PS))])


def random_logits(count: int, vocab: int, kind: str, g: torch.Generator) -> torch.Tensor:
    """Target logits: ``normal``; ``ties`` (a few integer values: tie groups at the k-th
    value and at the top-p cut); ``masked`` (a fifth at -inf); ``bf16``."""
    if kind == "ties":
        return torch.randint(-2, 3, (count, vocab), generator=g).float()
    logits = torch.randn(count, vocab, generator=g) * 2.5
    if kind == "masked":
        logits[torch.rand(count, vocab, generator=g) < 0.2] = float("-inf")
    if kind == "bf16":
        logits = logits.bfloat16()
    return logits


def wide_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` as rows of a wider buffer (row stride past V)."""
    wide = torch.zeros(logits.shape[0], logits.shape[1] + 5, dtype=logits.dtype)
    wide[:, :logits.shape[1]] = logits
    return wide[:, :logits.shape[1]]


def steer(logits: torch.Tensor, tree: dict, logit_rows: torch.Tensor,
          g: torch.Generator) -> None:
    """Raise each valid child's token at its parent's logits row (by 0 to 6, whole steps:
    ties stay ties), so walks go deep."""
    tokens, parents, valid = tree["tree_tokens"], tree["tree_parents"], tree["tree_valid"]
    b, r = torch.nonzero(valid & (parents >= 0), as_tuple=True)
    at = logit_rows[b, parents[b, r]]
    bias = torch.randint(0, 7, (len(b),), generator=g).to(logits.dtype)
    logits[at, tokens[b, r]] += bias


@pytest.mark.parametrize("batch, vocab, top_k, depth, budget", BUILDER_CASES)
def test_accept_sampled_on_built_trees(bench_core, batch, vocab, top_k, depth, budget):
    buffers, logits, rows, successors = builder_trees(
        bench_core, batch, vocab, builder_config(top_k, depth, budget), seed=batch + 1)
    g = torch.Generator().manual_seed(batch)
    levels = buffers.accepted_rows.shape[1]
    temperature, top_k_, top_p = sampling_settings(batch, vocab, g)
    temperature[0] = 1.0  # at least one sampled request
    uniforms = torch.rand(batch, levels + 1, rows.shape[1] + 1, generator=g)
    row_topk = ops.logits_topk(logits, successors.shape[1], rows.view(-1))
    out = run_accept("sampled", buffers_tree(buffers), row_topk, successors, vocab, levels,
                     (wide_rows(logits), rows, temperature, top_k_, top_p, uniforms))
    assert (out["num_accepted"] >= 1).any(), "the steered walks accept nothing"


@pytest.mark.parametrize("seed", range(12))
def test_accept_sampled_on_random_trees(seed):
    g = torch.Generator().manual_seed(100 + seed)
    batch = (3, 8, 1)[seed % 3]
    rows = (5, 33, 12, 70)[seed % 4]
    vocab = (37, 1000, 5003)[seed // 3 % 3]
    kind = ("normal", "ties", "masked", "bf16")[seed // 2 % 4]
    k = (2, 8)[seed % 2]
    tree = random_trees(batch, rows, vocab, token_range=(6, 60)[seed // 4 % 2], g=g)
    levels = tree["levels"] + seed % 2
    # logits rows in a shuffled order, -1 at invalid tree rows
    order = torch.randperm(batch * rows, generator=g).view(batch, rows)
    logit_rows = torch.where(tree["tree_valid"], order, -1)
    logits = random_logits(batch * rows, vocab, kind, g)
    steer(logits, tree, order, g)
    temperature, top_k, top_p = sampling_settings(batch, vocab, g)
    uniforms = torch.rand(batch, levels + 1, rows + 1, generator=g)
    row_topk = ops.logits_topk(logits, k, logit_rows.view(-1))
    successors = torch.randint(-1, vocab, (2 * vocab, k), generator=g, dtype=torch.int32)
    run_accept("sampled", tree, row_topk, successors, vocab, levels,
               (wide_rows(logits), logit_rows, temperature, top_k, top_p, uniforms))


def root_only(batch: int, vocab: int) -> dict:
    tree = dict(tree_tokens=packed_rows(torch.randint(0, vocab, (batch, 1))),
                tree_parents=torch.full((batch, 1), -1), tree_valid=torch.ones(batch, 1,
                                                                               dtype=bool),
                tree_source=torch.zeros(batch, 1, dtype=torch.uint8),
                learn_rows=torch.full((batch, 1), -1))
    return tree


@pytest.mark.parametrize("vocab, kind, block, rounds", [
    (37, "ties", None, 3), (256, "ties", 32, 2), (1000, "normal", None, 3),
    (5003, "masked", None, 3), (5003, "bf16", None, 3)])
def test_sampling_distribution(monkeypatch, vocab, kind, block, rounds):
    # Root-only trees: the emitted token is plain sampling's draw at the uniform, so equal
    # tokens over many uniforms and settings check the distribution (top-k, top-p and
    # their ties) token for token. ``block``: small vocabulary tiles (tie groups, cuts and
    # residual draws across many of them).
    monkeypatch.setattr(graft_step_triton, "VOCAB_BLOCK", block)
    g = torch.Generator().manual_seed(vocab + len(kind))
    batch = 8
    tree = root_only(batch, vocab)
    logits = random_logits(batch, vocab, kind, g)
    row_topk = ops.logits_topk(logits, 1)
    rows = torch.arange(batch).view(batch, 1)
    emitted = set()
    for round_ in range(rounds):
        temperature, top_k, top_p = sampling_settings(batch, vocab, g)
        temperature = temperature.clamp(min=0.3)  # every request samples
        if round_ == rounds - 1:  # the extremes: top-p 0 keeps the last of the largest values
            top_p[:4] = torch.tensor([0.0, 1e-4, 0.999, 0.5])
            top_k[4:] = torch.tensor([1, 2, vocab - 1, 3])
        uniforms = torch.rand(batch, 1, 2, generator=g)
        out = run_accept("sampled", tree, row_topk, torch.zeros(1, 1, dtype=torch.int32),
                         vocab, 0, (logits, rows, temperature, top_k, top_p, uniforms))
        emitted.update(out["output_tokens"][:, 0].tolist())
    assert len(emitted) > batch, "the draws do not spread over the vocabulary"


def test_learn_rows_last_writer_wins():
    # every row of every request teaches one of three matrix rows: the last flat row wins
    g = torch.Generator().manual_seed(3)
    batch, rows, vocab, k = 8, 9, 50, 4
    tree = random_trees(batch, rows, vocab, token_range=5, g=g)
    tree["learn_rows"] = torch.randint(0, 3, (batch, rows), generator=g)
    tree["learn_rows"][-1, -1] = -1
    row_topk = steered_row_topk(tree, vocab, k, g)
    successors = torch.full((vocab, k), -1, dtype=torch.int32)
    run_accept("greedy", tree, row_topk, successors, vocab, tree["levels"])


# ---- one launch, no host reads, checks -------------------------------------------------
class CountedKernel:
    """A Triton kernel whose launches are counted (and run outside any dispatch mode)."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.launches += 1
            with _disable_current_modes():
                return launch(*args, **kwargs)
        return run


class TensorOps(TorchDispatchMode):
    """The tensor ops a launcher dispatches besides its kernel."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func))
        return func(*args, **(kwargs or {}))


def test_one_launch_and_no_host_reads(monkeypatch):
    # Each launcher runs one kernel and no tensor op but dtype views (a value read on the
    # host would show as aten._local_scalar_dense, a copy as aten.copy_).
    kernels = {name: CountedKernel(getattr(graft_step_triton, name))
               for name in ("_draft_step_kernel", "_accept_kernel")}
    for name, kernel in kernels.items():
        monkeypatch.setattr(graft_step_triton, name, kernel)
    g = torch.Generator().manual_seed(4)
    batch, k, depth, vocab = 3, 2, 3, 40
    state = draft_state(batch, k, depth, seed=4)
    logprobs, tokens = draft_answer(batch, 1, k, torch.float32, torch.int64, False, g)
    tree = random_trees(batch, 6, vocab, token_range=5, g=g)
    row_topk = steered_row_topk(tree, vocab, k, g)
    successors = torch.zeros(2 * vocab, k, dtype=torch.int32)
    out = accept_outputs(batch, tree["levels"])
    common = (tree["tree_tokens"], tree["tree_parents"], tree["tree_valid"],
              tree["tree_source"])
    logits = torch.randn(batch * 6, vocab, generator=g)
    logit_rows = torch.arange(batch * 6).view(batch, 6)
    settings = (torch.ones(batch), torch.full((batch,), 3), torch.full((batch,), 0.9))
    uniforms = torch.rand(batch, tree["levels"] + 1, 7, generator=g)
    thresholds = torch.tensor([0.5])
    calls = {
        "_draft_step_kernel": lambda: graft_draft_step_cuda(
            logprobs, tokens, thresholds, 0, 0,
            *(state[name] for name in DRAFT_STATE)),
        "_accept_kernel": lambda: graft_accept_greedy_cuda(
            *common, row_topk, tree["learn_rows"], vocab, successors,
            *(out[name] for name in ACCEPT_OUTPUTS)),
        "sampled": lambda: graft_accept_sampled_cuda(
            logits, logit_rows, *common, *settings, uniforms, row_topk, tree["learn_rows"],
            vocab, successors, *(out[name] for name in ACCEPT_OUTPUTS)),
    }
    for name, call in calls.items():
        kernel = kernels.get(name, kernels["_accept_kernel"])
        before = kernel.launches
        with TensorOps() as seen:
            call()
        assert kernel.launches == before + 1, name
        assert seen.ops <= {"aten.view.dtype", "aten.detach.default"}, (name, seen.ops)


def test_bad_inputs_name_the_op_and_argument():
    batch, k, depth = 2, 2, 3
    state = draft_state(batch, k, depth, seed=0)
    logprobs, tokens = torch.zeros(batch, 1, k), torch.zeros(batch, 1, k, dtype=torch.long)
    thresholds = torch.tensor([0.5])

    def draft(step=0, **changes):
        args = dict(state, **changes)
        graft_draft_step_cuda(logprobs if step == 0 else torch.zeros(batch, k, k),
                              tokens if step == 0 else torch.zeros(batch, k, k, dtype=int),
                              thresholds, step, -1, *(args[name] for name in DRAFT_STATE))

    with pytest.raises(ValueError, match="graft_draft_step: step 3 outside"):
        draft(step=3)
    with pytest.raises(ValueError, match="graft_draft_step: pool_scores must be float32"):
        draft(pool_scores=state["pool_scores"].double())
    with pytest.raises(ValueError, match="graft_draft_step: lineage must have shape"):
        draft(lineage=state["lineage"][:, :, :2])
    with pytest.raises(ValueError, match="graft_draft_step: going must be contiguous"):
        draft(going=torch.zeros(batch, 2, dtype=bool)[:, 0])

    g = torch.Generator().manual_seed(0)
    tree = random_trees(batch, 4, 10, token_range=4, g=g)
    row_topk = steered_row_topk(tree, 10, 2, g)
    out = accept_outputs(batch, 3)
    successors = torch.zeros(20, 2, dtype=torch.int32)

    def greedy(**changes):
        args = dict(tree, row_topk=row_topk, successors=successors, **out)
        args.update(changes)
        graft_accept_greedy_cuda(args["tree_tokens"], args["tree_parents"],
                                 args["tree_valid"], args["tree_source"], args["row_topk"],
                                 args["learn_rows"], 10, args["successors"],
                                 *(args[name] for name in ACCEPT_OUTPUTS))

    with pytest.raises(ValueError, match="graft_accept_greedy: output_tokens must have "
                                         "unit stride"):
        greedy(output_tokens=torch.zeros(batch, 8, dtype=torch.long)[:, ::2])
    with pytest.raises(ValueError, match="graft_accept_greedy: successors has k = 3"):
        greedy(successors=torch.zeros(20, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="graft_accept_greedy: tree_source must be uint8"):
        greedy(tree_source=tree["tree_source"].long())

    logits = torch.zeros(8, 10)
    rows = torch.zeros(batch, 4, dtype=torch.long)
    settings = (torch.ones(batch), torch.zeros(batch, dtype=torch.long), torch.ones(batch))

    def sampled(logits=logits, uniforms=torch.rand(batch, 4, 5)):
        graft_accept_sampled_cuda(logits, rows, tree["tree_tokens"], tree["tree_parents"],
                                  tree["tree_valid"], tree["tree_source"], *settings,
                                  uniforms, row_topk, tree["learn_rows"], 10, successors,
                                  *(out[name] for name in ACCEPT_OUTPUTS))

    with pytest.raises(ValueError, match="graft_accept_sampled: logits must be"):
        sampled(logits=torch.zeros(10, 8).t())
    with pytest.raises(ValueError, match="graft_accept_sampled: uniforms must have shape"):
        sampled(uniforms=torch.rand(batch, 3, 5))
