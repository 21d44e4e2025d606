"""The trainers' work directories: cached answers and features are reused only for the
settings that made them (a rerun with other prompts, lengths, dtype, model or chunking
stops, naming what changed, instead of training on the old data)."""

from __future__ import annotations

import json

import pytest

from vllm_graft.training.data import WorkDirError, check_work_settings


def test_a_work_directory_serves_only_the_settings_it_was_made_with(tmp_path):
    settings = {"model": "/m", "prompts": 100, "max_tokens": 256, "dtype": "float32"}
    check_work_settings(tmp_path, settings)  # the first run records them
    check_work_settings(tmp_path, dict(settings))  # the same: reused
    with pytest.raises(WorkDirError, match=r"max_tokens 256 -> 128.*another --work-dir"):
        check_work_settings(tmp_path, {**settings, "max_tokens": 128})
    with pytest.raises(WorkDirError, match=r"model '/m' -> '/other'"):
        check_work_settings(tmp_path, {**settings, "model": "/other"})
    check_work_settings(tmp_path, {"chunk": 200}, name="chunks.json")
    with pytest.raises(WorkDirError, match="chunk 200 -> 400"):
        check_work_settings(tmp_path, {"chunk": 400}, name="chunks.json")


@pytest.mark.parametrize("command", ["train_head", "train_dflash"])
def test_a_trainer_rerun_with_other_settings_stops_before_any_work(tmp_path, command,
                                                                     capsys):
    import importlib

    main = importlib.import_module(f"vllm_graft.cli.{command}").main
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    work = tmp_path / "work"
    work.mkdir()
    (work / "settings.json").write_text(json.dumps(
        {"model": str(model), "prompts": 1600, "prompt_offset": 200,
         "max_prompt_tokens": 384, "max_tokens": 512, "dtype": "float32"}))
    with pytest.raises(SystemExit) as stop:
        main([str(model), "--out", str(tmp_path / "out"), "--work-dir", str(work)])
    assert stop.value.code == 2
    assert "max_tokens 512 -> 256" in capsys.readouterr().err
