"""Graft-TAIL on vLLM's own DFlash block drafter (``"drafter": "dflash"``).

No trained DFlash drafter is obtainable offline, so these tests load a randomly
initialised one in the layout vLLM's ``DFlashQwen3ForCausalLM`` loads
(:func:`vllm_graft.testing.tiny_models.build_dflash_drafter`): the mechanics and
losslessness are what they check, not acceptance. vLLM prepares and runs DFlash itself;
Graft keeps each block's confident prefix, grafts the matrix's walk after it, and
verifies the chain losslessly.
"""

from __future__ import annotations

import pytest

from tests.vllm.conftest import assert_greedy_identical, graft_spec, running_llm, spec_metrics
from tests.vllm.test_greedy_lossless import MAX_TOKENS, PROMPTS


@pytest.fixture(scope="module")
def dflash_drafter(tiny_models, tmp_path_factory):
    from vllm_graft.testing.tiny_models import build_dflash_drafter

    return build_dflash_drafter(tiny_models.target, tmp_path_factory.mktemp("dflash"))


def dflash_spec(drafter, **graft) -> dict:
    return graft_spec(drafter, drafter="dflash", variant="tail", **graft)


CASES = [  # (block size, thresholds, max_num_seqs)
    (4, None, 8),
    (8, [1.0, 1.0, 1.0], 4),  # every block cut at once: all retrieved or padding
    (6, [0.0, 0.0, 0.0], 1),  # every block kept whole: vLLM's DFlash proposal as is
]


@pytest.mark.parametrize("block, thresholds, max_num_seqs", CASES,
                         ids=[f"b{b}-{'t' + str(t[0]) if t else 'default'}-bs{s}"
                              for b, t, s in CASES])
def test_dflash_tail_greedy_output_is_identical(tiny_models, plain_outputs, dflash_drafter,
                                                block, thresholds, max_num_seqs):
    graft = {"budget": block}
    if thresholds is not None:
        graft["thresholds"] = thresholds
    with running_llm(tiny_models.target, dflash_spec(dflash_drafter, **graft),
                     max_num_seqs=max_num_seqs) as llm:
        assert_greedy_identical(llm, PROMPTS, plain_outputs, MAX_TOKENS)
        metrics = spec_metrics(llm)
    assert metrics["graft_verified_trees"] > 0
    # one DFlash forward per block, each block a chain of exactly `block` tokens
    assert metrics["graft_draft_forwards"] == metrics["graft_trees_built"]
    assert metrics["spec_decode_num_draft_tokens"] == block * metrics["spec_decode_num_drafts"]
    assert metrics.get("graft_tree_attention_us", 0) == 0  # causal attention verifies
    if thresholds == [1.0, 1.0, 1.0]:
        assert metrics["graft_stage_0"] == metrics["graft_trees_built"]
        assert metrics["graft_draft_nodes"] == 0 and metrics["graft_accepted_retrieved"] > 0
    if thresholds == [0.0, 0.0, 0.0]:
        assert metrics["graft_stage_full"] == metrics["graft_trees_built"]
        assert metrics["graft_retrieved_nodes"] == 0


def test_dflash_config_errors_name_the_key(tiny_models, dflash_drafter):
    from vllm_graft.core.config import GraftConfigError
    from vllm_graft.vllm.config import translate_speculative_config

    spec, _ = translate_speculative_config(dflash_spec(dflash_drafter, budget=4))
    assert spec["method"] == "dflash" and spec["num_speculative_tokens"] == 4
    with pytest.raises(GraftConfigError, match="blocks of a fixed size"):
        translate_speculative_config(graft_spec(dflash_drafter, drafter="dflash",
                                                variant="tail", budget="auto"))
    with pytest.raises(GraftConfigError, match="needs variant 'tail'"):
        translate_speculative_config(graft_spec(dflash_drafter, drafter="dflash", budget=4))
