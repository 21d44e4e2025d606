"""Sampling features next to Graft trees, in one mixed batch.

Every tree node is sampled by vLLM's own sampler, drawing once per emitted token from
the request's random stream, so with fixed seeds Graft must reproduce plain decoding
token for token, and so must every option that only looks at the node's logits
(temperature, top-k, top-p, min-p, logit bias) and logprobs. Requests whose options
depend on earlier tokens (penalties, bad words, min_tokens, structured outputs) get no
tree and must match plain decoding exactly as well. Trees keep serving the other
requests of the same batch.
"""

from __future__ import annotations

import math

import pytest

from tests.vllm.conftest import graft_spec, running_llm, spec_metrics

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "for i in range(10):\n",
           "class Node:\n", "x = [1, 2, 3]\n", "while True:\n", "print('hello')", "a",
           "def add(a, b):\n", "return self._cache"]


def _params():
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    greedy = dict(temperature=0.0, max_tokens=24)
    return [
        SamplingParams(**greedy, ignore_eos=True),  # tree
        SamplingParams(**greedy, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(**greedy, presence_penalty=0.8, frequency_penalty=0.4, ignore_eos=True),
        SamplingParams(**greedy, logprobs=3, ignore_eos=True),  # tree, with logprobs
        SamplingParams(**greedy, min_tokens=12),
        SamplingParams(**greedy, logit_bias={5: 3.0, 17: -2.0}, ignore_eos=True),
        SamplingParams(**greedy, bad_words=["def"], ignore_eos=True),
        SamplingParams(**greedy, structured_outputs=StructuredOutputsParams(
            choice=["yes", "no", "maybe"])),
        SamplingParams(temperature=0.9, min_p=0.05, seed=5, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=6, max_tokens=24,
                       ignore_eos=True, logprobs=2),
    ]


def _run(tiny_models, spec, alternate_modes=False):
    from tests.vllm.test_draft_model_drafter import install_alternating_guard

    with running_llm(tiny_models.target, spec) as llm:
        if alternate_modes:
            llm.collective_rpc(install_alternating_guard)
        outputs = llm.generate(PROMPTS, _params(), use_tqdm=False)
        metrics = spec_metrics(llm) if spec else {}
    return outputs, metrics


@pytest.mark.parametrize("alternate_modes", [False, True], ids=["trees", "trees-and-plain"])
def test_features_match_plain_decoding_in_a_mixed_batch(tiny_models, alternate_modes):
    """``trees-and-plain``: the throughput guard's plain steps between tree steps (their
    own sampler path, the drafter's inputs deferred to the next tree step)."""
    plain, _ = _run(tiny_models, None)
    graft, metrics = _run(tiny_models, graft_spec(tiny_models.head, budget=60),
                          alternate_modes)
    for prompt, p, g in zip(PROMPTS, plain, graft):
        assert list(g.outputs[0].token_ids) == list(p.outputs[0].token_ids), prompt
        assert g.outputs[0].text == p.outputs[0].text
    assert graft[7].outputs[0].text in ("yes", "no", "maybe")

    # logprobs: same top-3 tokens and values at every position
    for row in (3, 9):
        expected, got = plain[row].outputs[0].logprobs, graft[row].outputs[0].logprobs
        assert len(got) == len(expected) == 24
        for e, g in zip(expected, got):
            assert set(e) == set(g)
            for token, lp in e.items():
                assert math.isclose(g[token].logprob, lp.logprob, abs_tol=1e-4)

    # the tree requests really used trees while the others were decoded plainly
    assert metrics["graft_verified_trees"] > 0
    assert metrics["graft_accepted_retrieved"] + metrics["graft_accepted_draft"] > 0
    if alternate_modes:
        assert metrics["graft_guard_plain_steps"] > metrics["graft_guard_tree_steps"] > 0


def test_seeded_sampling_reproduces_plain_decoding(tiny_models):
    """Peaked target, budget 60: many tokens come from trees, and each must still be the
    one plain decoding draws from the same seed."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=t, top_p=p, seed=s, max_tokens=32, ignore_eos=True)
              for t, p, s in ((1.0, 1.0, 11), (1.6, 0.9, 12), (0.7, 1.0, 13), (1.0, 1.0, 11))]
    prompts = PROMPTS[:4]
    with running_llm(tiny_models.sharp) as llm:
        plain = llm.generate(prompts, params, use_tqdm=False)
    with running_llm(tiny_models.sharp, graft_spec(tiny_models.sharp_head, budget=60)) as llm:
        graft = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts, params, use_tqdm=False)
        metrics = spec_metrics(llm)
    tokens = lambda outs: [list(o.outputs[0].token_ids) for o in outs]
    assert tokens(graft) == tokens(plain)
    assert tokens(again) == tokens(plain)  # the matrix changed, the samples did not
    assert metrics["spec_decode_num_accepted_tokens"] > 40


def test_parallel_samples_stops_and_prompt_logprobs_match_plain_decoding(tiny_models):
    """Beside trees (peaked target, budget 60: long accepted paths): ``n=3`` (each child
    a request of its own, with its own seeded stream), a stop token that plain decoding
    meets mid-way (the tokens of an accepted path past it dropped, its logprobs cut
    with them) and prompt logprobs: every child, finish reason, logprob and prompt
    logprob as plain decoding gives them."""
    from vllm import SamplingParams

    prompts = PROMPTS[:3]
    with running_llm(tiny_models.sharp) as llm:
        probe = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        stop = llm.generate(prompts[1:2], probe, use_tqdm=False)[0].outputs[0].token_ids[10]
        params = [SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=32, ignore_eos=True),
                  SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=[stop],
                                 logprobs=2),
                  SamplingParams(temperature=0.8, seed=9, max_tokens=32, ignore_eos=True,
                                 prompt_logprobs=2)]
        plain = llm.generate(prompts, params, use_tqdm=False)
    with running_llm(tiny_models.sharp, graft_spec(tiny_models.sharp_head, budget=60)) as llm:
        graft = llm.generate(prompts, params, use_tqdm=False)
        metrics = spec_metrics(llm)
    for p, g in zip(plain, graft):
        assert [list(c.token_ids) for c in g.outputs] == [list(c.token_ids) for c in p.outputs]
        assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in p.outputs]
    assert len(graft[0].outputs) == 3
    expected, got = plain[1].outputs[0], graft[1].outputs[0]
    assert got.finish_reason == "stop" and len(got.token_ids) <= 11
    assert len(got.logprobs) == len(got.token_ids) == len(expected.logprobs)
    for e, g in zip(expected.logprobs, got.logprobs):
        assert set(e) == set(g)
        assert all(math.isclose(g[t].logprob, lp.logprob, abs_tol=1e-4) for t, lp in e.items())
    expected, got = plain[2].prompt_logprobs, graft[2].prompt_logprobs
    assert len(got) == len(expected) and got[0] is None
    for e, g in zip(expected[1:], got[1:]):
        assert set(e) == set(g)
        assert all(math.isclose(g[t].logprob, lp.logprob, abs_tol=1e-4) for t, lp in e.items())
    assert metrics["spec_decode_num_accepted_tokens"] > 20, metrics


def test_requests_decoded_plainly_beside_trees_wait_for_the_drafter(tiny_models):
    """A request that may not draft yet (min_tokens) keeps its drafter rows for later
    while the others draft trees: the drafter forward of a tree step carries only the
    rows of the requests drafting in it. It waits, then drafts with every row it kept.
    A request that may never draft (penalties) is not followed by the drafter at all:
    it keeps no rows. Both decode as plain decoding does."""
    from vllm import SamplingParams

    from vllm_graft.vllm.rpc import request_state_counts

    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3,
                             ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, min_tokens=12, ignore_eos=True)]
    prompts = PROMPTS[:3]
    with running_llm(tiny_models.target) as llm:
        plain = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                     use_tqdm=False)]
    with running_llm(tiny_models.target, graft_spec(tiny_models.head, budget=16)) as llm:
        engine, waiting = llm.llm_engine, []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", prompt, p)
        tokens = {f"r{i}": [] for i in range(3)}
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens[output.request_id] = list(output.outputs[0].token_ids)
            waiting.append(llm.collective_rpc(request_state_counts)[0]["deferred_rows"])
        metrics = spec_metrics(llm)
    assert [tokens[f"r{i}"] for i in range(3)] == plain
    assert metrics["graft_verified_trees"] > 0
    # the min_tokens request waits at first, then drafts for several steps with what
    # it kept; the penalised one never waits
    fed = waiting.index(0, 1)
    assert fed >= 6 and set(waiting[1:fed]) == {1} and set(waiting[fed:]) == {0}, waiting
    assert len(waiting) - fed > 3, waiting
