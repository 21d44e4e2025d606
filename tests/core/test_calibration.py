import json

import pytest

from vllm_graft.core.calibration import (Calibration, CalibrationError, ModelIdentity,
                                         SourceAcceptance, fingerprint_model,
                                         load_calibration, tally_acceptance)
from vllm_graft.core.config import GraftConfig

FP_T, FP_D = "a" * 64, "b" * 64


def _valid():
    return {
        "format_version": 1, "checkpoints": [0, 1, 5], "thresholds": [0.3, 0.2, 0.1],
        "budget": 60, "draft_keep": [8, 24, 40], "template": "best_first",
        "target": {"name": "qwen-1.5b", "fingerprint": FP_T},
        "drafter": {"name": "eagle3-head", "fingerprint": FP_D},
        "warmup_corpus_sha256": "c" * 64,
    }


def _tally(**sources):
    return {"score_buckets": 4, "sources": sources}


def _write(tmp_path, data, name="calib.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_roundtrip_and_config_check(tmp_path):
    path = _write(tmp_path, _valid())
    cal = load_calibration(path, GraftConfig(), target_fingerprint=FP_T, drafter_fingerprint=FP_D)
    assert cal.thresholds == (0.3, 0.2, 0.1)
    cal.save(tmp_path / "again.json")
    assert load_calibration(tmp_path / "again.json") == cal


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.pop("thresholds"), "calibration.thresholds"),
    (lambda d: d.update(format_version=2), "calibration.format_version"),
    (lambda d: d.update(thresholds=[0.3, 1.2, 0.1]), "calibration.thresholds"),
    (lambda d: d.update(thresholds=[0.3, 0.2]), "must have the same length"),
    (lambda d: d["target"].update(fingerprint="xyz"), "calibration.target.fingerprint"),
    (lambda d: d.update(extra_field=1), "calibration.extra_field: unknown key"),
    (lambda d: d.update(budget="sixty"), "calibration.budget"),
    (lambda d: d.update(acceptance=_tally(draft={"trials": [[3, 0, 0, 0]],
                                                  "accepts": [[4, 0, 0, 0]]})),
     "calibration.acceptance.sources.draft: at depth 1, score bucket 0, 4 accepts exceed 3"),
    (lambda d: d.update(acceptance=_tally(drafted={"trials": [[3, 0, 0, 0]],
                                                    "accepts": [[1, 0, 0, 0]]})),
     "calibration.acceptance.sources.drafted"),
    (lambda d: d.update(acceptance=_tally(context={"trials": [[3, 0, 0, 0], [1, 0, 0, 0]],
                                                    "accepts": [[1, 0, 0, 0]]})),
     "calibration.acceptance.sources.context: trials and accepts must have the same shape"),
    (lambda d: d.update(acceptance=_tally(both={"trials": [[-1, 0, 0, 0]],
                                                 "accepts": [[0, 0, 0, 0]]})),
     "calibration.acceptance.sources.both.trials.0.0"),
    (lambda d: d.update(acceptance=_tally(both={"trials": [[1, 0]], "accepts": [[0, 0]]})),
     "calibration.acceptance: every depth of source 'both' needs 4 score buckets"),
    (lambda d: d.update(acceptance={"score_buckets": 2, "sources": {}}),
     "calibration.acceptance.score_buckets: 2 score buckets, but the acceptance model has 4"),
    (lambda d: d.update(chain_acceptance=_tally(context={"trials": [[3, 0, 0, 0]],
                                                          "accepts": [[5, 0, 0, 0]]})),
     "calibration.chain_acceptance.sources.context: at depth 1, score bucket 0, 5 accepts "
     "exceed 3"),
])
def test_malformed_fields_are_named(tmp_path, edit, field):
    data = _valid()
    edit(data)
    with pytest.raises(CalibrationError, match=field.replace(".", r"\.")) as err:
        load_calibration(_write(tmp_path, data))
    assert "calib.json" in str(err.value)


def test_tally_counts_the_nodes_whose_parent_was_accepted():
    """Root 0; depth 1: 1 drafted (accepted, score 0.9), 2 retrieved (score 0.3); depth
    2: 3 drafted under 1 (accepted), 4 copied under 2 (its parent rejected: no trial),
    5 both under 1. Unscored trees count as the unknown score's bucket (2 of 4)."""
    tree = {"parents": [-1, 0, 0, 1, 2, 1], "depths": [0, 1, 1, 2, 2, 2],
            "source": [0, 1, 2, 1, 2 | 4, 3], "accepted_rows": [1, 3]}
    scored = {**tree, "score": [0.0, 0.9, 0.3, 0.6, 1.0, 0.1]}
    tally = tally_acceptance([scored, {**tree, "score": None}])
    assert tally.score_buckets == 4
    assert tally.sources == {
        "draft": SourceAcceptance(trials=((0, 0, 1, 1), (0, 0, 2, 0)),
                                  accepts=((0, 0, 1, 1), (0, 0, 2, 0))),
        "retrieved": SourceAcceptance(trials=((0, 1, 1, 0),), accepts=((0, 0, 0, 0),)),
        "both": SourceAcceptance(trials=((0, 0, 0, 0), (1, 0, 1, 0)),
                                 accepts=((0, 0, 0, 0), (0, 0, 0, 0)))}
    assert tally_acceptance([]).sources == {}


def test_a_calibration_keeps_its_acceptance_and_older_files_have_none(tmp_path):
    older = load_calibration(_write(tmp_path, _valid()))
    assert older.acceptance is None and older.chain_acceptance is None
    data = {**_valid(), "acceptance": _tally(draft={"trials": [[10, 0, 0, 2], [4, 0, 0, 0]],
                                                    "accepts": [[6, 0, 0, 1], [1, 0, 0, 0]]}),
            "chain_acceptance": _tally(context={"trials": [[0, 0, 0, 9]],
                                                "accepts": [[0, 0, 0, 7]]})}
    cal = load_calibration(_write(tmp_path, data))
    assert cal.acceptance.sources["draft"].trials == ((10, 0, 0, 2), (4, 0, 0, 0))
    assert cal.chain_acceptance.sources["context"].accepts == ((0, 0, 0, 7),)
    cal.save(tmp_path / "again.json")
    assert load_calibration(tmp_path / "again.json") == cal


def test_unreadable_and_non_json(tmp_path):
    with pytest.raises(CalibrationError, match="missing.json.*cannot be read"):
        load_calibration(tmp_path / "missing.json")
    with pytest.raises(CalibrationError, match="not valid JSON"):
        load_calibration(_write(tmp_path, "{nope"))
    with pytest.raises(CalibrationError, match="top level must be a JSON object"):
        load_calibration(_write(tmp_path, "[1, 2]"))


def test_layout_and_model_mismatch(tmp_path):
    path = _write(tmp_path, _valid())
    with pytest.raises(CalibrationError, match="field 'draft_keep'.*graft.draft_keep"):
        load_calibration(path, GraftConfig(draft_keep=(8, 24, 30)))
    with pytest.raises(CalibrationError, match="'target.fingerprint' belongs to 'qwen-1.5b'"):
        load_calibration(path, target_fingerprint="d" * 64)
    with pytest.raises(CalibrationError, match="'drafter.fingerprint'"):
        load_calibration(path, drafter_fingerprint="d" * 64)


def test_fingerprint_is_path_independent(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"hidden_size": 8}')
    assert fingerprint_model(tmp_path / "a") == fingerprint_model(tmp_path / "b")
    ModelIdentity(name="x", fingerprint=fingerprint_model(tmp_path / "a"))
    assert isinstance(Calibration.model_validate(_valid()), Calibration)


def test_record_from_a_dense_tree():
    from vllm_graft.core.calibration import TreeRecord

    # rows in score order: 1,2 at depth 1; 3 at depth 2 (child of 1); 4 at depth 3
    depths = [0, 1, 1, 2, 3]
    record = TreeRecord.from_dense_tree(depths, accepted_rows=[1, 3, 4],
                                        confidence=[0.9, 0.5, 0.2], checkpoints=(0, 1),
                                        draft_keep=(1, 3))
    # stop at 0 keeps row 1 only -> 1 accepted; stop at 1 keeps rows 1,2,3 -> 2 accepted
    assert record.kept_accepted == (1, 2) and record.full_accepted == 3


def test_fit_prefers_pruning_unsure_trees():
    from vllm_graft.core.calibration import TreeRecord, fit_thresholds, simulate

    sure = [TreeRecord((0.9, 0.8, 0.7), (1, 2), 5) for _ in range(10)]
    unsure = [TreeRecord((0.1, 0.05, 0.01), (0, 0), 0) for _ in range(10)]
    thresholds, fit = fit_thresholds(sure + unsure, (0, 1), retrieval_gain=(1.5, 1.0),
                                     max_depth=3, draft_cost=0.1)
    assert 0.1 < thresholds[0] <= 0.9  # unsure trees stop at the root, sure ones go on
    tokens, steps, _ = simulate(sure + unsure, thresholds, (0, 1), (1.5, 1.0), 3, 0.1)
    assert tokens == (10 * 6 + 10 * 2.5) / 20 and steps == (10 * 3 + 10 * 1) / 20
    assert fit["predicted"]["tokens_per_cost"] > fit["dense"]["tokens_per_cost"]
    with pytest.raises(ValueError, match="no dense-tree records"):
        fit_thresholds([], (0,), (1.0,), 3)


def test_chain_calibration_checks_its_shape(tmp_path):
    tree = _write(tmp_path, _valid())
    tail = GraftConfig(variant="tail", budget=5)
    with pytest.raises(CalibrationError, match="'shape' is 'tree'.*--variant tail"):
        load_calibration(tree, tail)
    chain = _write(tmp_path, {**_valid(), "shape": "chain", "budget": 5}, "chain.json")
    assert load_calibration(chain, tail).shape == "chain"  # draft_keep does not apply
    with pytest.raises(CalibrationError, match="field 'budget' is 5"):
        load_calibration(chain, GraftConfig(variant="tail", budget=3))
    with pytest.raises(CalibrationError, match="'shape' is 'chain'"):
        load_calibration(chain, GraftConfig(budget=5))


def test_chain_fit_stops_unsure_chains_where_their_confidence_falls():
    from vllm_graft.core.calibration import (ChainRecord, fit_chain_thresholds,
                                             simulate_chains)

    # sure chains: confident throughout, all 5 drafted tokens accepted; unsure ones
    # fall to 0.1 at step 1 and get nothing from their drafted tokens
    sure = [ChainRecord((0.95, 0.9, 0.85, 0.8, 0.75), 5) for _ in range(10)]
    unsure = [ChainRecord((0.6, 0.1, 0.05, 0.02, 0.01), 0) for _ in range(10)]
    gain = (0.5, 0.5, 0.0)
    thresholds, fit = fit_chain_thresholds(sure + unsure, (0, 1, 5), gain, length=5,
                                           draft_cost=0.2)
    assert thresholds[2] == 0.0  # checkpoint 5 lies past a 5-token chain
    # sure chains draft on to the end; unsure ones stop at step 0, where 0.6 < 0.95
    # already tells them apart: nothing drafted kept, gain 0.5, one draft step
    assert thresholds[0] > 0.6
    tokens, steps, _ = simulate_chains(sure + unsure, thresholds, (0, 1, 5), gain, 5, 0.2)
    assert tokens == (10 * 6 + 10 * 1.5) / 20 and steps == (10 * 5 + 10 * 1) / 20
    assert fit["predicted"]["tokens_per_cost"] > fit["dense"]["tokens_per_cost"]
    # a chain stopped at step 3 keeps at most 3 drafted tokens
    stopped, _, _ = simulate_chains([ChainRecord((0.9, 0.9, 0.9, 0.1, 0.1), 5)],
                                    (0.0, 0.5, 0.5), (0, 1, 5), (0.0, 0.0, 0.0), 5, 0.1)
    assert stopped == 1 + 3
    with pytest.raises(ValueError, match="no chain records"):
        fit_chain_thresholds([], (0,), (1.0,), 3)
    with pytest.raises(ValueError, match="checkpoint at step 0"):
        fit_chain_thresholds(sure, (1,), (1.0,), 3)
