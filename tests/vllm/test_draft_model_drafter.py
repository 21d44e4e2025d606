"""Graft trees from an ordinary draft model (``"drafter": "draft_model"``). With the
target as its own draft model the drafter is always right: a chain-shaped tree (top_k 1)
must be accepted to its full depth at nearly every step, and the default tree must
stay lossless. (The random target's distributions are flat, so a wide tree spends its
budget on breadth rather than depth.)"""

from __future__ import annotations

from tests.vllm.conftest import graft_spec, mean_accepted, running_llm, spec_metrics
from tests.vllm.test_greedy_lossless import PROMPTS


def test_draft_model_trees_are_lossless_and_accepted(tiny_models, plain_outputs):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    chain = graft_spec(tiny_models.target, drafter="draft_model", variant="dense_tree",
                       top_k=1, budget=8)
    with running_llm(tiny_models.target, chain) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        metrics = spec_metrics(llm)
    assert [list(o.outputs[0].token_ids) for o in outputs] == plain_outputs
    assert mean_accepted(metrics) > 6.0, metrics  # a perfect drafter, depth 7

    tree = graft_spec(tiny_models.target, drafter="draft_model", budget=60)
    with running_llm(tiny_models.target, tree) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        metrics = spec_metrics(llm)
    assert [list(o.outputs[0].token_ids) for o in outputs] == plain_outputs
    assert metrics["graft_accepted_draft"] + metrics["graft_accepted_both"] > 0
