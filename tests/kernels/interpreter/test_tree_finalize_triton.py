"""The Triton ``graft_tree_finalize`` against the op's CPU kernel, under Triton's
interpreter (collected only with TRITON_INTERPRET=1; see ../conftest.py).

Inputs are realistic: a fused :class:`GraftTreeBuilder` drafts on the CPU (the bench's
bank drafter) and fills the pool and stage buffers; both implementations then finalize
the same inputs into fresh output buffers, poisoned so that an unwritten element fails.
Cases cover the graft variant (retrieval and spare candidates, low-confidence
replacement on and off), ``dense_tree`` (no retrieval), ``retrieval_only`` (no
drafter), dynamic and fixed shapes, budgets 8, 60 and 100 (two ancestor words), batches
1, 3 and 8, context parts of width 0 and 16 copying drafted and retrieved paths,
partitions including -1, tiny vocabularies (frequent merges), every stage, tied
scores, forced hash collisions (the exact fallback), outputs that are column slices
of a wider buffer and edge inputs. Last, the kernel as the launcher calls it is compiled
for an H100 (sm_90) in a process without the interpreter: no GPU runs it here.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_graft import ops
from vllm_graft.core.config import GraftConfig
from vllm_graft.kernels import tree_finalize_triton
from vllm_graft.kernels.tree_finalize_triton import graft_tree_finalize_cuda

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("bench_core",
                                               ROOT / "scripts" / "bench_core.py")
bench_core = importlib.util.module_from_spec(_spec)  # BankDrafter, build_inputs
_spec.loader.exec_module(bench_core)

# small trees (pool 3 + 2 * 9 = 21), the middle size (pool 6 + 4 * 36 = 150), and the
# paper's (pool 610) for budget 60
SHAPES = {
    8: dict(top_k=3, max_depth=3, checkpoints=(0, 1), draft_keep=(2, 5), successor_k=4,
            retrieval_depth=3, retrieval_width=3, retrieval_slack=2),
    60: dict(top_k=6, max_depth=5, checkpoints=(0, 1, 3), draft_keep=(4, 20, 40),
             successor_k=6, retrieval_depth=5, retrieval_width=6),
    100: dict(top_k=6, max_depth=5, checkpoints=(0, 1, 3), draft_keep=(5, 30, 70),
              successor_k=6, retrieval_depth=6, retrieval_width=6),
}


class Case:
    """The finalize inputs of one batch: ``args`` in the schema's order."""

    def __init__(self, variant="graft", shape="dynamic", batch=3, vocab=16, budget=8,
                 context_width=0, partitions=None, replace=True, random_stage=False,
                 tied_scores=False, paper=False, seed=0):
        settings = {} if paper else SHAPES[budget]
        config = GraftConfig(variant=variant, tree_shape=shape, budget=budget, **settings)
        generator = torch.Generator().manual_seed(seed)
        builder, drafter, _ = bench_core.build_inputs(batch, vocab, "compiled", config,
                                                      torch.device("cpu"), fused_ops=True)
        roots = torch.randint(0, vocab, (batch,), generator=generator)
        fused = builder.fused
        buffers = fused.build(roots, drafter, successors=builder.matrix.table)
        recipe = fused.recipe
        self.recipe, self.batch, self.vocab = recipe, batch, vocab
        pool_scores = buffers.pool_scores.clone()
        if tied_scores:  # coarse scores: many ties, still never rising along a path,
            pool_scores = torch.floor(pool_scores * 2) / 2  # and -0.0 tied with 0.0
            pool_scores[::2, 0], pool_scores[::2, 1] = -0.0, 0.0
        stage = buffers.stage.clone()
        if random_stage and recipe.keep_by_stage.numel():
            stage = torch.randint(0, recipe.keep_by_stage.numel(), (batch,),
                                  generator=generator)
        parts = 1 if partitions is None else 3
        successors = torch.randint(-1, vocab, (parts * vocab, recipe.successor_k),
                                   generator=generator, dtype=torch.int32)
        if partitions == "some":
            partitions = torch.randint(-1, parts, (batch,), generator=generator)
            partitions[0] = -1
        else:
            partitions = torch.empty(0, dtype=torch.long)
        empty = torch.empty((0, 0), dtype=torch.long)
        self.args = [
            roots, buffers.pool_tokens.clone(), buffers.pool_parents.clone(), pool_scores,
            stage, recipe.keep_by_stage, recipe.retrieval_keep, successors, partitions,
            recipe.template_parents, recipe.template_ranks, recipe.template_scores,
            empty, empty, empty, recipe.top_k, recipe.draft_capacity,
            recipe.replace_below if replace else 0.0, recipe.replace_keep, recipe.spare,
            recipe.fixed_shape, vocab]
        if context_width:
            self.args[12:15] = self.context(context_width, generator)

    def context(self, width, generator):
        """Context parts copying paths of the tree built without them (so they merge
        with drafted and retrieved nodes), a branch, mutated tokens, a hole (a -1 token
        whose descendants are invalid), then -1 padding."""
        tree = self.expected()
        tokens = torch.full((self.batch, width), -1, dtype=torch.long)
        parents = torch.full((self.batch, width), -1, dtype=torch.long)
        depths = torch.zeros((self.batch, width), dtype=torch.long)
        for b in range(self.batch):
            rows = int(tree["num_nodes"][b])
            nodes = []  # (token, parent index in the part, depth)
            while len(nodes) < width:
                row = int(torch.randint(0, rows, (1,), generator=generator))
                path = []
                while row > 0:
                    path.append(int(tree["tree_tokens"][b, row]))
                    row = int(tree["tree_parents"][b, row])
                path.reverse()
                path += torch.randint(0, self.vocab, (int(torch.randint(0, 4, (1,),
                                      generator=generator)),), generator=generator).tolist()
                attach = -1
                if nodes and bool(torch.rand(1, generator=generator) < 0.3):
                    attach = int(torch.randint(0, len(nodes), (1,), generator=generator))
                depth = 0 if attach < 0 else nodes[attach][2]
                for token in path:
                    if len(nodes) == width:
                        break
                    depth += 1
                    if bool(torch.rand(1, generator=generator) < 0.1):
                        token = int(torch.randint(0, self.vocab, (1,), generator=generator))
                    nodes.append((token, attach, depth))
                    attach = len(nodes) - 1
            used = int(torch.randint(width // 2, width + 1, (1,), generator=generator))
            for i, (token, parent, depth) in enumerate(nodes[:used]):
                tokens[b, i], parents[b, i], depths[b, i] = token, parent, depth
            if b % 2 == 1:
                tokens[b, 2] = -1  # a hole
        return [tokens, parents, depths]

    def outputs(self, packed: bool = False):
        """Fresh, poisoned output buffers (``packed``: tree_tokens, num_nodes and stats
        as column slices of one wider buffer, as the step buffers lay them out)."""
        b, rows = self.batch, self.recipe.rows
        words = (rows + 63) // 64

        def full(shape, value, dtype=torch.long):
            return torch.full(shape, value, dtype=dtype)

        out = {"tree_tokens": full((b, rows), -7), "tree_parents": full((b, rows), -7),
               "tree_depths": full((b, rows), -7),
               "tree_valid": torch.ones((b, rows), dtype=torch.bool),
               "tree_source": full((b, rows), 77, torch.uint8),
               "tree_score": full((b, rows), float("nan"), torch.float32),
               "num_nodes": full((b,), -7), "ancestor_bits": full((b, rows, words), -7),
               "learn_rows": full((b, rows), -7), "stats": full((b, 8), -7)}
        if packed:
            wide = full((b, 3 + rows + 8 + 2), -9)
            out["packed"] = wide
            out["num_nodes"] = wide[:, 1]
            out["tree_tokens"] = wide[:, 2:2 + rows]
            out["stats"] = wide[:, 3 + rows:11 + rows]
        return out

    def expected(self):
        out = self.outputs()
        torch.ops.vllm_graft.graft_tree_finalize.default(
            *self.args, *(out[name] for name in ops.TREE_OUTPUTS))
        return out

    def triton(self, packed: bool = False, **tuning):
        out = self.outputs(packed)
        graft_tree_finalize_cuda(*self.args, *(out[name] for name in ops.TREE_OUTPUTS),
                                 **tuning)
        return out


def assert_same(got, expected):
    for name in ops.TREE_OUTPUTS:
        if name == "tree_score":
            torch.testing.assert_close(got[name], expected[name], rtol=1e-6, atol=1e-6,
                                       msg=lambda m: f"{name}: {m}")
        else:
            assert torch.equal(got[name], expected[name]), \
                f"{name} differs:\n{got[name]}\nexpected\n{expected[name]}"


CASES = [
    # variant, shape, batch, vocab, budget, context width, partitions, extra
    ("graft", "dynamic", 3, 6, 8, 0, None, {}),
    ("graft", "fixed", 8, 9, 8, 16, "some", {}),
    ("graft", "fixed", 3, 8, 8, 0, None, dict(replace=False, random_stage=True)),
    ("graft", "dynamic", 8, 7, 8, 16, None, dict(random_stage=True, tied_scores=True)),
    ("graft", "fixed", 1, 60, 60, 16, None, dict(random_stage=True)),
    ("graft", "dynamic", 3, 20, 60, 16, "some", dict(tied_scores=True)),
    ("graft", "fixed", 3, 100, 100, 16, None, dict(random_stage=True)),
    ("graft", "dynamic", 1, 24, 100, 0, None, {}),
    ("dense_tree", "dynamic", 3, 5, 8, 16, None, {}),
    ("dense_tree", "fixed", 8, 12, 8, 0, None, dict(tied_scores=True)),
    ("dense_tree", "fixed", 1, 100, 100, 16, None, {}),
    ("retrieval_only", "dynamic", 8, 6, 8, 16, "some", {}),
    ("retrieval_only", "fixed", 3, 60, 60, 0, None, {}),
    ("retrieval_only", "fixed", 1, 100, 100, 16, "some", {}),
    ("prune_only", "fixed", 3, 10, 8, 16, None, dict(random_stage=True)),
]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("variant, shape, batch, vocab, budget, width, partitions, extra",
                         CASES, ids=lambda v: str(v) if not isinstance(v, dict) else
                         "-".join(sorted(v)) or "plain")
def test_matches_cpu_kernel(variant, shape, batch, vocab, budget, width, partitions,
                            extra, seed):
    case = Case(variant, shape, batch, vocab, budget, width, partitions, seed=seed, **extra)
    assert_same(case.triton(), case.expected())


def test_paper_sized_pool():
    # top_k 10, 7 steps: a pool of 610 slots (tl.topk over 1024 keys, slow here)
    case = Case("graft", "fixed", 2, 64, 60, 16, "some", paper=True, seed=15)
    assert case.recipe.pool == 610
    assert_same(case.triton(), case.expected())


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_every_stage_and_merges(seed):
    # a tiny vocabulary and random stages: each request keeps a different number of
    # drafted and retrieved nodes, most of them merge
    case = Case("graft", "fixed", 8, 8, 8, 16, "some", random_stage=True, seed=seed)
    source = case.expected()["tree_source"]
    assert ((source & (source - 1)) != 0).sum() >= 8, "few nodes merged from two parts"
    assert_same(case.triton(), case.expected())


def test_hash_collisions_resolve_exactly(monkeypatch):
    # every path hashes alike: the exact fixed point must undo the hash's groups
    for mask in (0, 1):
        monkeypatch.setattr(tree_finalize_triton, "_HASH_MASK", mask)
        for case in (Case("graft", "fixed", 3, 8, 8, 16, "some", seed=5),
                     Case("graft", "dynamic", 1, 12, 60, 16, None, seed=6)):
            assert_same(case.triton(), case.expected())


@pytest.mark.parametrize("tuning", [dict(block=16), dict(block=64, num_warps=8)])
def test_tuning_does_not_change_the_tree(tuning):
    case = Case("graft", "dynamic", 3, 9, 60, 16, "some", random_stage=True, seed=7)
    assert_same(case.triton(**tuning), case.expected())


def test_outputs_as_column_slices():
    case = Case("graft", "fixed", 3, 10, 8, 16, None, seed=8)
    got = case.triton(packed=True)
    assert_same(got, case.expected())
    wide, rows = got["packed"], case.recipe.rows
    untouched = torch.cat([wide[:, :1], wide[:, 2 + rows:3 + rows], wide[:, 11 + rows:]], 1)
    assert torch.equal(untouched, torch.full_like(untouched, -9)), "other columns written"


def test_refuses_bad_arguments_by_name():
    case = Case("graft", "fixed", 3, 9, 8, 0, None, seed=9)
    out = case.outputs()

    def call(index=None, value=None, **changed):
        args = list(case.args)
        if index is not None:
            args[index] = value
        outputs = dict(out, **changed)
        graft_tree_finalize_cuda(*args, *(outputs[name] for name in ops.TREE_OUTPUTS))

    with pytest.raises(ValueError, match="graft_tree_finalize: pool_scores must be"):
        call(3, case.args[3].double())
    with pytest.raises(ValueError, match="graft_tree_finalize: stage must have shape"):
        call(4, case.args[4][:1])
    with pytest.raises(ValueError, match="graft_tree_finalize: successors must be"):
        call(7, case.args[7].t())
    with pytest.raises(ValueError, match="graft_tree_finalize: tree_valid must be"):
        call(tree_valid=out["tree_valid"].long())
    with pytest.raises(ValueError, match="graft_tree_finalize: ancestor_bits must be"):
        call(ancestor_bits=out["ancestor_bits"][:, :, :0])
    with pytest.raises(ValueError, match="graft_tree_finalize: tree_tokens must have unit "
                                         "stride"):
        call(tree_tokens=torch.full((3, 2 * case.recipe.rows), -7)[:, ::2])
    with pytest.raises(ValueError, match="graft_tree_finalize: draft_capacity"):
        call(16, 10_000)
    with pytest.raises(ValueError, match="graft_tree_finalize: a fixed-shape tree"):
        call(21, 3)


def test_edge_inputs():
    # no drafted slot kept (capacity 0), an empty template, a root without a token,
    # a one-slot pool (top_k 1, one step), a tree of the root alone, an empty batch
    case = Case("graft", "fixed", 2, 9, 8, 4, "some", seed=10)
    case.args[16] = 0
    assert_same(case.triton(), case.expected())
    case = Case("graft", "dynamic", 2, 9, 8, 4, "some", seed=11)
    case.args[9:12] = [part[:0] for part in case.args[9:12]]
    assert_same(case.triton(), case.expected())
    for shape in ("dynamic", "fixed"):
        case = Case("graft", shape, 2, 9, 8, 4, None, seed=12)
        case.args[0] = torch.tensor([-1, 3])
        assert_same(case.triton(), case.expected())
    SHAPES[4] = dict(top_k=1, max_depth=1, checkpoints=(), draft_keep=(), successor_k=2,
                     retrieval_depth=2, retrieval_width=2, retrieval_slack=1)
    try:
        case = Case("graft", "fixed", 3, 5, 4, 3, "some", seed=13)
        assert case.recipe.pool == 1
        assert_same(case.triton(), case.expected())
    finally:
        del SHAPES[4]
    for shape in ("dynamic", "fixed"):  # nothing but the root
        case = Case("dense_tree", shape, 2, 9, 8, 0, None, seed=14)
        case.args[1:4] = [part[:, :0] for part in case.args[1:4]]
        assert_same(case.triton(), case.expected())
    case = Case("dense_tree", "fixed", 1, 9, 8, 0, None, seed=14)
    case.batch = 0
    case.args[:5] = [part[:0] for part in case.args[:5]]
    assert_same(case.triton(), case.expected())


COMPILE_FOR_HOPPER = """
import inspect
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vllm_graft.kernels import tree_finalize_triton as module
from tests.kernels.interpreter.test_tree_finalize_triton import Case

calls = []


class Capture:  # the launch the launcher makes, not run
    def __getitem__(self, grid):
        return lambda *args, **kwargs: calls.append((args, kwargs))


kernel, module._tree_finalize_kernel = module._tree_finalize_kernel, Capture()
Case("graft", "fixed", 2, 64, 60, 16, "some", paper=True).triton()
(args, kwargs), = calls
pointers = {torch.int64: "*i64", torch.int32: "*i32", torch.float32: "*fp32",
            torch.bool: "*i1", torch.uint8: "*u8"}
signature = {}
for name, value in zip(inspect.signature(kernel.fn).parameters, args):
    if isinstance(value, torch.Tensor):
        signature[name] = pointers[value.dtype]
    else:
        signature[name] = "fp32" if isinstance(value, float) else "i32"
options = {"num_warps": kwargs.pop("num_warps")}
signature.update({name: "constexpr" for name in kwargs})
compiled = triton.compile(ASTSource(kernel, signature, kwargs),
                          target=GPUTarget("cuda", 90, 32), options=options)
assert compiled.asm["cubin"]
print("compiled for sm_90")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None,
                    reason="this Triton has no NVIDIA backend")
def test_compiles_for_hopper():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", COMPILE_FOR_HOPPER], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "compiled for sm_90" in result.stdout, \
        result.stdout + result.stderr
