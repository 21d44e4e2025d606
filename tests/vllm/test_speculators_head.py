"""Public EAGLE-3 heads ship in the speculators format (a ``config.json`` with
``speculators_config``, such as RedHatAI/Qwen3-8B-speculator.eagle3): Graft serves them
unchanged, through vLLM's own reader, drafting exactly what the same weights in vLLM's
native EAGLE-3 layout draft."""

from __future__ import annotations

import logging

import pytest

from tests.vllm.conftest import graft_spec, greedy_token_ids, running_llm, spec_metrics
from vllm_graft.core.config import GraftConfigError
from vllm_graft.vllm.config import translate_speculative_config

@pytest.fixture(scope="module")
def heads(tiny_models, tmp_path_factory):
    """Peaked heads (large weights: drafts run deep), the same weights in both formats,
    and a speculators head of other weights as the control the comparison must tell
    apart."""
    from vllm_graft.testing.tiny_models import build_eagle3_head, build_speculators_eagle3_head

    root = tmp_path_factory.mktemp("speculators")
    target = tiny_models.target
    return {"native": build_eagle3_head(target, root / "native", scale=1.0),
            "speculators": build_speculators_eagle3_head(target, root / "speculators",
                                                         scale=1.0),
            "other": build_speculators_eagle3_head(target, root / "other", scale=1.0, seed=2)}


def _drafting_counters(llm) -> dict:
    """What was drafted and accepted (counts only: times differ run to run)."""
    return {name: value for name, value in spec_metrics(llm).items()
            if (name.startswith("spec_decode_") or "accepted" in name or "draft" in name)
            and not name.endswith(("_us", "_ms", "_seconds"))}


def test_a_speculators_head_serves_losslessly_and_drafts_as_its_native_twin(
        tiny_models, heads, plain_outputs):
    from tests.vllm.test_greedy_lossless import MAX_TOKENS as SHARED_TOKENS
    from tests.vllm.test_greedy_lossless import PROMPTS as SHARED_PROMPTS

    runs = {}
    for name, head in heads.items():  # the same requests in each engine
        with running_llm(tiny_models.target, graft_spec(head)) as llm:
            outputs = greedy_token_ids(llm, SHARED_PROMPTS[:6], SHARED_TOKENS)
            runs[name] = _drafting_counters(llm)
        if name == "speculators":
            assert outputs == plain_outputs[:6]
    assert runs["speculators"] == runs["native"], runs
    assert runs["native"]["spec_decode_num_draft_tokens"] > 0
    assert runs["other"] != runs["speculators"], "the comparison cannot tell heads apart"


def test_a_speculators_head_of_another_kind_is_refused_naming_the_file(tiny_models,
                                                                        tmp_path):
    from vllm_graft.testing.tiny_models import build_speculators_eagle3_head

    head = build_speculators_eagle3_head(tiny_models.target, tmp_path / "medusa",
                                         speculators_model_type="medusa")
    with pytest.raises(GraftConfigError, match=r"speculative_config\.model: .*config\.json.*"
                                               r"speculators_model_type 'medusa'"):
        translate_speculative_config(graft_spec(head))
    (head / "config.json").write_text("{not json")
    with pytest.raises(GraftConfigError, match=r"speculative_config\.model: .*config\.json"):
        translate_speculative_config(graft_spec(head))


def test_thresholds_beside_a_calibration_file_warn_that_they_win(tiny_models, tmp_path,
                                                                  caplog):
    from vllm_graft.core.calibration import Calibration, ModelIdentity, fingerprint_model

    Calibration(
        format_version=1, checkpoints=(0, 1, 5), thresholds=(0.3, 0.2, 0.1), budget=60,
        draft_keep=(8, 24, 40), template="best_first",
        target=ModelIdentity(name="tiny", fingerprint=fingerprint_model(tiny_models.target)),
        drafter=ModelIdentity(name="head", fingerprint=fingerprint_model(tiny_models.head)),
        warmup_corpus_sha256="0" * 64).save(tmp_path / "calibration.json")
    calibrated = graft_spec(tiny_models.head, calibration=str(tmp_path / "calibration.json"))
    with caplog.at_level(logging.WARNING, logger="vllm_graft.vllm.config"):
        translate_speculative_config(calibrated, target_model=str(tiny_models.target))
        assert not any("thresholds win" in r.getMessage() for r in caplog.records)
        translate_speculative_config({**calibrated, "graft": {
            **calibrated["graft"], "thresholds": [0.5, 0.4, 0.3]}},
            target_model=str(tiny_models.target))
    assert any("thresholds win" in r.getMessage() for r in caplog.records)
