"""Scheduler situations that cut or drop trees must stay lossless: a small token budget
(chunked prefill of long prompts next to decoding requests, trees truncated to what
fits), requests running into max_model_len (no room for a tree), and preemption under a
tiny KV cache (resumed requests come back with placeholder drafts)."""

from __future__ import annotations

import pytest

from tests.vllm.conftest import graft_spec, running_llm, spec_metrics

PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the nth Fibonacci number.\"\"\"\n" * 4,
           "import os\n", "for i in range(10):\n    print(i)\n" * 6, "class A:\n",
           "x = 1\n" * 30, "while True:\n"]


def _generate(model, spec, max_tokens, **engine):
    from vllm import SamplingParams

    with running_llm(model, spec, **engine) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                       ignore_eos=True), use_tqdm=False)
        metrics = spec_metrics(llm) if spec else {}
    return [list(o.outputs[0].token_ids) for o in outputs], metrics


@pytest.mark.parametrize("engine, max_tokens", [
    (dict(max_num_batched_tokens=96, max_num_seqs=4), 40),  # chunked prefill, cut trees
    (dict(max_model_len=160), 200),  # prompts + outputs run into max_model_len
], ids=["small-token-budget", "max-model-len"])
def test_cut_trees_stay_lossless(tiny_models, engine, max_tokens):
    plain, _ = _generate(tiny_models.target, None, max_tokens, **engine)
    graft, metrics = _generate(tiny_models.target, graft_spec(tiny_models.head, budget=60),
                               max_tokens, **engine)
    assert graft == plain
    assert metrics["graft_verified_trees"] > 0


def test_preemption_stays_lossless(tiny_models):
    from vllm import SamplingParams

    prompts = [p * 2 for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    engine = dict(num_gpu_blocks_override=24, block_size=32, max_num_seqs=6,
                  max_model_len=512)
    with running_llm(tiny_models.target, **engine) as llm:
        plain = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                     use_tqdm=False)]
    with running_llm(tiny_models.target, graft_spec(tiny_models.head, budget=60),
                     **engine) as llm:
        graft = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                     use_tqdm=False)]
        stats = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    assert graft == plain
    assert stats.get("vllm:num_preemptions", 0) > 0, "the KV cache was not small enough"
