"""Scheduler situations that cut or drop trees must stay lossless: a small token budget
(chunked prefill of long prompts next to decoding requests, trees truncated to what
fits), requests running into max_model_len (no room for a tree), and preemption under a
tiny KV cache (resumed requests come back with placeholder drafts)."""

from __future__ import annotations

import pytest

from tests.vllm.conftest import engine_stats, graft_spec, running_llm, spec_metrics

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
        stats = engine_stats(llm)
    assert graft == plain
    assert stats.get("vllm:num_preemptions", 0) > 0, "the KV cache was not small enough"


def test_prefix_cache_hits_stay_lossless(tiny_models):
    """Requests sharing a long prefix reuse its cached KV under Graft as under plain
    decoding, minus the one block EAGLE-style speculation drops from every hit (the
    drafter's KV at a block's last position was computed with the token after it),
    and the outputs after a hit are still plain decoding's."""
    import random

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    block, followers = 32, 3
    rng = random.Random(0)
    shared = [rng.randrange(5, 2000) for _ in range(300)]
    prompts = [TokensPrompt(prompt_token_ids=shared + [rng.randrange(5, 2000)
                                                       for _ in range(20)])
               for _ in range(1 + followers)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def generate(spec):
        with running_llm(tiny_models.target, spec, block_size=block) as llm:
            # the first request fills the cache, the others then share its prefix
            outputs = [llm.generate(batch, params, use_tqdm=False)
                       for batch in (prompts[:1], prompts[1:])]
            stats = engine_stats(llm)
            metrics = spec_metrics(llm) if spec else {}
        return [list(o.outputs[0].token_ids) for batch in outputs for o in batch], \
            stats["vllm:prefix_cache_hits"], metrics

    plain, plain_hits, _ = generate(None)
    graft, graft_hits, metrics = generate(graft_spec(tiny_models.head, budget=60))
    assert graft == plain
    assert plain_hits == followers * (len(shared) // block) * block
    assert graft_hits == plain_hits - followers * block
    assert metrics["graft_verified_trees"] > 0
