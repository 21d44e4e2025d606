import json

import pytest

from vllm_graft.core.calibration import (Calibration, CalibrationError, ModelIdentity,
                                         fingerprint_model, load_calibration)
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
])
def test_malformed_fields_are_named(tmp_path, edit, field):
    data = _valid()
    edit(data)
    with pytest.raises(CalibrationError, match=field.replace(".", r"\.")) as err:
        load_calibration(_write(tmp_path, data))
    assert "calib.json" in str(err.value)


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
