"""A fault in Graft never takes the engine down (vllm_graft/vllm/faults.py): faults
injected at random steps into every Graft hook leave every answer exactly plain
decoding's, greedy and seeded, in the engine and over HTTP under concurrent streaming
load; each is counted in vllm:graft_errors_total; after max_consecutive_errors failing
steps in a row Graft turns itself off and the engine decodes plainly."""

from __future__ import annotations

import json
import threading

import pytest

from tests.vllm.conftest import graft_spec, running_llm, server_env, spec_metrics
from tests.vllm.served import ServedModel, http_get, http_post, open_stream, read_stream_chunks
from vllm_graft.vllm.faults import INJECT_ENV

PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the nth Fibonacci number.\"\"\"\n",
           "for i in range(10):\n    print(i)\nfor i in range(10):\n",
           "The quick brown fox jumps over the lazy dog. The quick brown",
           "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n"]
MAX_TOKENS = 40


def _generate(model, spec, params=None):
    from vllm import SamplingParams

    params = params or SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    with running_llm(model, spec, max_num_seqs=4) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        again = llm.generate(PROMPTS[:1], params if not isinstance(params, list)
                             else params[:1], use_tqdm=False)  # the engine serves on
        metrics = spec_metrics(llm)
    return [o.outputs[0].token_ids for o in outputs], again[0].outputs[0].token_ids, metrics


@pytest.fixture(scope="module")
def plain(tiny_models):
    return _generate(tiny_models.target, None)[0]


@pytest.mark.parametrize("hooks", ["prepare+forward+sample+propose+forget+after", "forward"])
def test_faults_in_graft_hooks_leave_greedy_output_plain(tiny_models, plain, monkeypatch,
                                                         hooks):
    monkeypatch.setenv(INJECT_ENV, f"rate={0.3 if '+' in hooks else 1.0},hooks={hooks},seed=1")
    got, again, metrics = _generate(tiny_models.target, graft_spec(tiny_models.head, budget=60,
                                                                   max_consecutive_errors=10**6))
    assert got == plain
    assert again == plain[0]
    assert metrics["graft_errors"] > 5, metrics
    if "+" in hooks:  # trees ran between the faults
        assert metrics["graft_verified_trees"] > 0, metrics
    else:  # every tree's forward failed: every step was sampled from its roots
        assert metrics["spec_decode_num_accepted_tokens"] == 0, metrics


def test_seeded_sampling_stays_plain_decodings_under_faults_in_acceptance(tiny_models,
                                                                          monkeypatch):
    """A failed acceptance may have drawn from a seeded request's random stream; the
    stream is put back before its root is sampled plainly."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0.9, top_k=30, seed=11 + i, max_tokens=MAX_TOKENS,
                             ignore_eos=True) for i in range(len(PROMPTS))]
    expected = _generate(tiny_models.sharp, None, params)[0]
    # the faults strike after the walk drew its random numbers: the last hook before
    # the walk's end, the matrix update, raises
    import vllm_graft.vllm.matrix_learning as learning_module
    import vllm_graft.vllm.tree_sampling as sampling_module

    original = learning_module.learn
    calls = {"n": 0}

    def failing_learn(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] % 2:
            raise RuntimeError("a fault after the walk")
        return original(*args, **kwargs)

    monkeypatch.setattr(learning_module, "learn", failing_learn)
    monkeypatch.setattr(sampling_module, "filters_are_plain_sampling", lambda metadata: False)
    got, _, metrics = _generate(tiny_models.sharp, graft_spec(tiny_models.sharp_head,
                                                              budget=60), params)
    assert got == expected
    assert metrics["graft_errors"] > 0, metrics


def test_graft_turns_itself_off_after_failing_steps_in_a_row(tiny_models, plain, monkeypatch,
                                                             caplog):
    monkeypatch.setenv(INJECT_ENV, "rate=1.0,hooks=propose,seed=0")
    got, again, metrics = _generate(tiny_models.target, graft_spec(
        tiny_models.head, budget=60, max_consecutive_errors=3))
    assert got == plain and again == plain[0]
    assert metrics["graft_errors"] == 3, metrics  # then no more drafting rounds
    assert metrics.get("graft_verified_trees", 0) == 0


def test_the_server_serves_through_faults_under_streaming_load(tiny_models, plain, tmp_path):
    """A real server with faults injected into every hook at random steps, eight clients
    streaming at once: every answer is plain decoding's, the errors are counted on
    /metrics, and the server is healthy afterwards."""
    config = tmp_path / "graft.json"
    config.write_text(json.dumps(graft_spec(tiny_models.head, budget=60,
                                            max_consecutive_errors=10**6)))
    with ServedModel(tiny_models.target, tmp_path / "serve.log", config, "--max-num-seqs", "8",
                     env=server_env(**{INJECT_ENV: "rate=0.2,seed=3"})) as server:
        base = server.base
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tiny_models.target))
        expected = [tokenizer.decode(tokens) for tokens in plain]
        answers: dict[int, str] = {}

        def client(index: int) -> None:
            prompt = PROMPTS[index % len(PROMPTS)]
            stream = open_stream(f"{base}/v1/completions", {
                "model": str(tiny_models.target), "prompt": prompt, "temperature": 0,
                "max_tokens": MAX_TOKENS, "ignore_eos": True})
            answers[index] = "".join(read_stream_chunks(stream))

        for _ in range(2):
            threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=300)
            assert len(answers) == 8, answers
            for index, text in answers.items():
                assert text == expected[index % len(PROMPTS)], (index, text)
            answers.clear()
        assert http_get(f"{base}/health")[0] == 200
        _, metrics = http_get(f"{base}/metrics")
        errors = [float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith("vllm:graft_errors_total")]
        assert errors and errors[0] > 0, errors
        reply = http_post(f"{base}/v1/completions", {
            "model": str(tiny_models.target), "prompt": PROMPTS[0], "temperature": 0,
            "max_tokens": MAX_TOKENS, "ignore_eos": True})
        assert reply["choices"][0]["text"] == expected[0]
