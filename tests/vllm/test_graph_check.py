"""CUDA graphs that check themselves (vllm_graft/vllm/graph_check.py) and the choice of
CUDA-graph mode for Graft engines (replacements.engine_config.choose_cuda_graphs).

No GPU here has vLLM, so the check runs on the CPU engine with ``always`` set: the
first tree steps' target forwards run twice (both eager here), must agree, and the
output stays plain decoding's; a forward that differs by a little must turn the graphs
off, and the answers are still plain decoding's (the step returns the eager output)."""

from __future__ import annotations

import types

import pytest
import torch

from tests.vllm.conftest import graft_spec, running_llm
from vllm_graft.vllm.graph_check import CHECKED_STEPS, ReplayCheck, difference

PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the nth Fibonacci number.\"\"\"\n",
           "for i in range(10):\n    print(i)\nfor i in range(10):\n",
           "The quick brown fox jumps over the lazy dog. The quick brown"]
MAX_TOKENS = 24


def _generate(model, spec, install=None):
    from vllm import SamplingParams

    with running_llm(model, spec, max_num_seqs=4) as llm:
        if install is not None:
            llm.collective_rpc(install)
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                               use_tqdm=False)
        verdict = llm.collective_rpc(_verdict)[0] if install is not None else None
    return [o.outputs[0].token_ids for o in outputs], verdict


def _verdict(worker):
    check = worker.model_runner._graft_graph_check
    return check.verdict, check.left, check.forwards


class CountingCheck(ReplayCheck):
    """The check as the engine runs it, counting the forwards it makes."""

    forwards = 0

    def run(self, runner, forward, rows):
        def counted():
            self.forwards += 1
            return forward()
        return super().run(runner, counted, rows)


class ShakyCheck(CountingCheck):
    """A 'replayed' forward that differs from the eager one by 1e-3 in one value."""

    def run(self, runner, forward, rows):
        calls = []

        def shaky():
            out = forward()
            if not calls:
                first = out if isinstance(out, torch.Tensor) else out[0]
                first[0, 0] += 1e-3
            calls.append(1)
            return out
        return super().run(runner, shaky, rows)


def install_check(worker):
    worker.model_runner._graft_graph_check = CountingCheck(always=True)


def install_shaky_check(worker):
    worker.model_runner._graft_graph_check = ShakyCheck(always=True)


@pytest.fixture(scope="module")
def plain(tiny_models):
    return _generate(tiny_models.target, None)[0]


def test_checked_tree_steps_agree_and_decode_as_plain(tiny_models, plain):
    got, (verdict, left, forwards) = _generate(
        tiny_models.target, graft_spec(tiny_models.head, budget=60), install_check)
    assert got == plain
    assert verdict == "on" and left == 0
    assert forwards == 2 * CHECKED_STEPS  # replayed and eager, for each checked step


def test_a_replayed_forward_that_differs_turns_graphs_off_and_decodes_as_plain(tiny_models,
                                                                              plain, caplog):
    got, (verdict, left, forwards) = _generate(
        tiny_models.target, graft_spec(tiny_models.head, budget=60), install_shaky_check)
    assert got == plain
    assert verdict.startswith("off: a tree step's forward replayed in CUDA graphs is not the "
                              "eager one: output 0 differs at 1 of"), verdict
    assert left == 0 and forwards == 2  # one checked step, then no more checks


def _capture_in_a_failing_state(worker):
    """The runner's ``capture_model`` called as the worker calls it at start-up, with
    vLLM's capturing flag set as a capture that raised midway leaves it."""
    from vllm.compilation import monitor

    monitor.set_cudagraph_capturing_enabled(True)
    runner = worker.model_runner
    graph_bytes = runner.capture_model()
    check = runner._graft_graph_check
    return (graph_bytes, None if check is None else check.verdict,
            runner.cudagraph_dispatcher.cudagraph_mode.name,
            monitor.cudagraph_capturing_enabled)


def test_a_failed_capture_leaves_the_engine_eager_and_says_why(tiny_models, plain,
                                                               monkeypatch, caplog):
    """Patch 11e: CUDA graph capture that raises at start-up (injected here: the CPU
    worker captures nothing) turns graphs off with one log line naming the error, and
    the engine decodes as plain decoding does."""
    from vllm import SamplingParams

    from vllm_graft.vllm.faults import INJECT_ENV

    monkeypatch.setenv(INJECT_ENV, "rate=1.0,hooks=capture,seed=0")
    with running_llm(tiny_models.target, graft_spec(tiny_models.head, budget=60),
                     max_num_seqs=4) as llm:
        graph_bytes, verdict, mode, capturing = llm.collective_rpc(
            _capture_in_a_failing_state)[0]
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                               use_tqdm=False)
    assert graph_bytes == 0 and mode == "NONE" and capturing is False
    assert verdict == ("off: CUDA graph capture failed at start-up: InjectedFault: "
                       "injected fault in Graft's capture hook"), verdict
    # one log call (pytest's capture may hold the same record twice)
    lines = {(r.created, r.getMessage()) for r in caplog.records
             if "CUDA graphs turned off" in r.getMessage()}
    assert len(lines) == 1 and "capture failed at start-up" in lines.pop()[1], lines
    assert [o.outputs[0].token_ids for o in outputs] == plain


def test_difference_names_the_output_and_ignores_matching_nans():
    a = torch.tensor([[1.0, float("nan")], [2.0, 3.0], [9.0, 9.0]])
    b = torch.tensor([[1.0, float("nan")], [2.0, 3.5], [0.0, 0.0]])
    assert difference((a,), (a.clone(),), rows=3) is None
    assert difference(a, b, rows=1) is None  # rows past the scheduled ones are padding
    assert difference((a, [a]), (a, [b]), rows=2) == ("output 1 differs at 1 of 2 rows "
                                                     "(largest difference 0.5)")
    assert difference((a,), (a, a), rows=2) == "1 output tensors replayed, 2 eager"


class _Args(types.SimpleNamespace):
    pass


@pytest.mark.parametrize("given, wanted, mode, eager", [
    (None, True, "PIECEWISE", False),
    ("FULL_AND_PIECEWISE", True, "PIECEWISE", False),
    ("NONE", True, "NONE", False),
    (None, False, None, True),
])
def test_gpu_engines_run_piecewise_graphs_unless_told_not_to(monkeypatch, given, wanted, mode,
                                                            eager):
    from vllm.config import CompilationConfig, CUDAGraphMode
    from vllm.platforms import current_platform

    from vllm_graft.vllm.replacements.engine_config import choose_cuda_graphs

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    compilation = CompilationConfig()
    compilation.cudagraph_mode = None if given is None else CUDAGraphMode[given]
    args = _Args(enforce_eager=False, compilation_config=compilation)
    target = _Args(enforce_eager=False)
    choose_cuda_graphs(args, target, wanted)
    got = compilation.cudagraph_mode
    assert (None if got is None else got.name) == mode
    assert args.enforce_eager is eager and target.enforce_eager is eager


def test_cpu_engines_keep_their_settings():
    from vllm.config import CompilationConfig

    from vllm_graft.vllm.replacements.engine_config import choose_cuda_graphs

    compilation = CompilationConfig()
    before = compilation.cudagraph_mode
    args = _Args(enforce_eager=False, compilation_config=compilation)
    choose_cuda_graphs(args, _Args(enforce_eager=False), True)
    assert compilation.cudagraph_mode == before and not args.enforce_eager
