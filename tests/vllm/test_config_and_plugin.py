"""Configuration paths: the plugin's guards, the graft.json forms, and clear start-up
errors for bad keys, values and files (no engine loop is ever reached)."""

from __future__ import annotations

import json
import logging

import pytest

from tests.vllm.conftest import graft_spec, running_llm, spec_metrics
from vllm_graft.core.config import GraftConfigError
from vllm_graft.vllm.config import load_speculative_config_arg, translate_speculative_config
from vllm_graft.vllm.version import UnsupportedVLLMVersion, check_vllm_version


def test_only_the_supported_vllm_is_accepted():
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.0+cpu")
    with pytest.raises(UnsupportedVLLMVersion, match="supports vLLM 0.32.0 only.*found vLLM 0.33.1"):
        check_vllm_version("0.33.1")


def test_patches_are_idempotent_and_listed():
    from vllm_graft.vllm import patches

    patches.apply_all()
    assert patches.apply_all() == 0
    names = {p.name for p in patches.all_patches()}
    assert {"graft.engine_args", "graft.runner", "graft.tree_attention.CPUAttentionBackendImpl",
            "graft.prometheus"} <= names
    for patch in patches.all_patches():  # every patched symbol is in the module's table
        for attr in patch.attributes:
            assert attr in patches.__doc__, attr


def test_translation_to_eagle3_and_additional_config(tiny_models):
    spec, settings = translate_speculative_config(
        graft_spec(tiny_models.head, budget=16, variant="prune_only"),
        target_model=str(tiny_models.target), target_vocab_size=2048)
    assert spec == {"method": "eagle3", "model": str(tiny_models.head),
                    "num_speculative_tokens": 16}
    assert settings["budget"] == 16 and settings["variant"] == "prune_only"


@pytest.mark.parametrize("graft, message", [
    ({"budget": 0}, "speculative_config.graft.budget"),
    ({"variannt": "graft"}, "speculative_config.graft.variannt: unknown key"),
    ({"variant": "beam"}, "speculative_config.graft.variant"),
    ({"thresholds": [0.5]}, "thresholds needs one entry per checkpoint"),
    ({"calibration": "/nonexistent/calib.json"}, "graft.calibration: file '/nonexistent/calib.json' not found"),
    ({"warmup": "/nonexistent/m.bin"}, "graft.warmup: file '/nonexistent/m.bin' not found"),
])
def test_bad_graft_blocks_name_the_key(tiny_models, graft, message):
    with pytest.raises(GraftConfigError, match=message.replace(".", r"\.")):
        translate_speculative_config(graft_spec(tiny_models.head, **graft))


def test_head_and_token_count_are_checked(tiny_models):
    with pytest.raises(GraftConfigError, match="speculative_config.model"):
        translate_speculative_config({"method": "graft"})
    with pytest.raises(GraftConfigError, match="num_speculative_tokens: set by graft.budget"):
        translate_speculative_config({**graft_spec(tiny_models.head), "num_speculative_tokens": 3})


def test_wrong_warmup_vocabulary_is_refused(tiny_models, tmp_path):
    from vllm_graft.core.successor import SuccessorFileError, SuccessorMatrix

    SuccessorMatrix.empty(999, 8).save(tmp_path / "m.bin")
    with pytest.raises(SuccessorFileError, match="m.bin.*vocab_size 999 does not match the model's 2048"):
        translate_speculative_config(graft_spec(tiny_models.head, warmup=str(tmp_path / "m.bin")),
                                     target_vocab_size=2048)


def test_speculative_config_argument_forms(tmp_path):
    inline = load_speculative_config_arg('{"method": "graft", "model": "h"}')
    assert inline == {"method": "graft", "model": "h"}
    (tmp_path / "calib.json").write_text("{}")
    (tmp_path / "graft.json").write_text(json.dumps(
        {"method": "graft", "model": "h", "graft": {"calibration": "calib.json"}}))
    from_file = load_speculative_config_arg(str(tmp_path / "graft.json"))
    assert from_file["graft"]["calibration"] == str(tmp_path / "calib.json")  # file-relative
    (tmp_path / "graft.yaml").write_text("method: graft\nmodel: h\ngraft:\n  budget: 8\n")
    assert load_speculative_config_arg(str(tmp_path / "graft.yaml"))["graft"] == {"budget": 8}
    with pytest.raises(GraftConfigError, match="neither inline JSON nor an existing file"):
        load_speculative_config_arg("missing.json")
    with pytest.raises(GraftConfigError, match="invalid JSON"):
        load_speculative_config_arg("{nope")
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(GraftConfigError, match="bad.json.*must be a JSON object"):
        load_speculative_config_arg(str(tmp_path / "bad.json"))
    (tmp_path / "bad.yaml").write_text("method: graft\ngraft: [budget: 8\n")
    with pytest.raises(GraftConfigError, match="bad.yaml.*invalid YAML"):
        load_speculative_config_arg(str(tmp_path / "bad.yaml"))


def test_llm_refuses_a_bad_config_at_startup(tiny_models):
    from vllm import LLM

    with pytest.raises(GraftConfigError, match="speculative_config.graft.top_k"):
        LLM(model=str(tiny_models.target), dtype="float32", enforce_eager=True,
            speculative_config=graft_spec(tiny_models.head, top_k=0))


def test_llm_refuses_a_corrupt_calibration_at_startup(tiny_models, tmp_path):
    from vllm import LLM

    from vllm_graft.core.calibration import CalibrationError

    bad = tmp_path / "calib.json"
    bad.write_text('{"format_version": 1, "thresholds": "high"}')
    with pytest.raises(CalibrationError, match="calib.json.*calibration.thresholds"):
        LLM(model=str(tiny_models.target), dtype="float32", enforce_eager=True,
            speculative_config=graft_spec(tiny_models.head, calibration=str(bad)))


def test_a_calibration_is_checked_against_a_hub_id_served_from_the_cache(tmp_path,
                                                                         monkeypatch, caplog):
    """A server of a Hub ID checks the calibration's fingerprint against the ID's
    config.json in the Hugging Face cache (vLLM put it there first): a calibration of
    another model stops start-up; one of this model passes; an ID absent from the
    cache is not checked, with a warning, and never fetched."""
    import hashlib

    import huggingface_hub.constants

    from tests.cli.test_cli_conventions import hub_cache
    from vllm_graft.core.calibration import (Calibration, CalibrationError, ModelIdentity,
                                             fingerprint_model)
    from vllm_graft.core.config import GraftConfig
    from vllm_graft.vllm.config import check_files

    cache = tmp_path / "hub"
    target = hub_cache(cache, "acme/target", {"num_hidden_layers": 2})
    head = hub_cache(cache, "acme/head", {"num_hidden_layers": 1})
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))

    def calibration_of(target_fingerprint: str) -> GraftConfig:
        path = tmp_path / f"calib-{target_fingerprint[:8]}.json"
        Calibration(format_version=1, checkpoints=(0, 1, 5), thresholds=(0.3, 0.2, 0.1),
                    budget=60, draft_keep=(8, 24, 40), template="best_first",
                    target=ModelIdentity(name="target", fingerprint=target_fingerprint),
                    drafter=ModelIdentity(name="head", fingerprint=fingerprint_model(
                        head.parent)),
                    warmup_corpus_sha256="0" * 64).save(path)
        return GraftConfig(calibration=str(path))

    served = hashlib.sha256(target.read_bytes()).hexdigest()
    check_files(calibration_of(served), target_model="acme/target",
                drafter_model="acme/head", target_vocab_size=None)
    with pytest.raises(CalibrationError, match="'target.fingerprint' belongs to 'target'"):
        check_files(calibration_of("e" * 64), target_model="acme/target",
                    drafter_model="acme/head", target_vocab_size=None)
    check_files(calibration_of("e" * 64), target_model="acme/elsewhere",
                drafter_model="acme/head", target_vocab_size=None)  # not in the cache
    assert "not checked against acme/elsewhere" in caplog.text


def test_explicit_thresholds_and_calibration_reach_the_runner(tiny_models, tmp_path):
    """A calibration file for these very models is accepted and its thresholds used."""
    from vllm import SamplingParams

    from vllm_graft.core.calibration import Calibration, ModelIdentity, fingerprint_model

    calibration = Calibration(
        format_version=1, checkpoints=(0, 1, 5), thresholds=(1.0, 1.0, 1.0), budget=60,
        draft_keep=(8, 24, 40), template="best_first",
        target=ModelIdentity(name="tiny", fingerprint=fingerprint_model(tiny_models.target)),
        drafter=ModelIdentity(name="head", fingerprint=fingerprint_model(tiny_models.head)),
        warmup_corpus_sha256="0" * 64)
    calibration.save(tmp_path / "calib.json")
    spec = graft_spec(tiny_models.head, calibration=str(tmp_path / "calib.json"))
    with running_llm(tiny_models.target, spec) as llm:
        llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        metrics = spec_metrics(llm)
    # thresholds 1.0 from the file: every tree stopped at the root checkpoint
    assert metrics["graft_stage_0"] == metrics["graft_trees_built"] > 0


def test_cli_parser_takes_a_file_inline_json_and_config_yaml(tmp_path):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    spec = {"method": "graft", "model": "head", "graft": {"budget": 8}}
    (tmp_path / "graft.json").write_text(json.dumps(spec))
    from_file = parser.parse_args(["--speculative-config", str(tmp_path / "graft.json")])
    inline = parser.parse_args(["--speculative-config", json.dumps(spec)])
    (tmp_path / "serve.yaml").write_text(
        "speculative-config:\n  method: graft\n  model: head\n  graft:\n    budget: 8\n")
    from_yaml = parser.parse_args(["--config", str(tmp_path / "serve.yaml")])
    assert from_file.speculative_config == inline.speculative_config == spec
    assert from_yaml.speculative_config == spec


def test_graft_engines_use_the_v1_runner_and_sync_steps(tiny_models, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # even when V2 is asked for
    args = EngineArgs(model=str(tiny_models.target), dtype="float32", enforce_eager=True,
                      speculative_config=graft_spec(tiny_models.head, budget=8))
    config = args.create_engine_config()
    assert config.use_v2_model_runner is False
    assert config.scheduler_config.async_scheduling is False
    assert config.speculative_config.num_speculative_tokens == 8
    assert config.additional_config["graft"]["budget"] == 8


def test_thinking_budgets_are_refused_with_a_clear_error(tiny_models):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    with running_llm(tiny_models.target, graft_spec(tiny_models.head, budget=8)) as llm:
        with pytest.raises(VLLMValidationError, match="thinking_token_budget"):
            llm.generate(["a"], SamplingParams(max_tokens=4, thinking_token_budget=2),
                         use_tqdm=False)
        # min_p and logit_bias, which vLLM refuses under speculation, are accepted
        out = llm.generate(["a"], SamplingParams(max_tokens=4, min_p=0.1, logit_bias={3: 1.0}),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


def test_graft_log_lines_reach_the_handlers_vllm_installs_after_the_plugin_loaded(
        monkeypatch):
    """vLLM installs its log handlers when an engine starts, after plugins load: Graft's
    INFO lines (the cost profile, what budget "auto" learned) must still reach them."""
    from vllm_graft.vllm.plugin import route_logs_through_vllm

    ours, theirs = logging.getLogger("vllm_graft"), logging.getLogger("vllm")
    monkeypatch.setattr(ours, "handlers", [])
    monkeypatch.setattr(ours, "level", logging.NOTSET)
    monkeypatch.setattr(theirs, "handlers", [])
    route_logs_through_vllm()  # the plugin loads first
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    theirs.addHandler(handler)  # then vLLM configures its logging
    logging.getLogger("vllm_graft.vllm.runner").info("Graft: a line")
    logging.getLogger("vllm_graft.vllm.runner").debug("Graft: a debug line")
    assert [record.getMessage() for record in records] == ["Graft: a line"]


def test_on_an_unsupported_vllm_the_plugin_stays_out_of_the_way():
    """vLLM loads every installed plugin in every process without a guard: on a release
    Graft does not support, loading it must not raise (that would break every vLLM user
    of the environment) and must change nothing, saying why once."""
    import subprocess
    import sys

    code = """
import logging, vllm
vllm.__version__ = "0.33.0"
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
before = GPUModelRunner._sample
from vllm_graft.vllm import plugin
records = []
logging.getLogger("vllm_graft").addHandler(type("H", (logging.Handler,), {
    "emit": lambda self, record: records.append(record.getMessage())})())
plugin.register()
plugin.register()
assert GPUModelRunner._sample is before, "patched"
assert len(records) == 1 and "supports vLLM 0.32.0 only" in records[0], records
assert "found vLLM 0.33.0" in plugin.DISABLED[0]
print("silent")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and "silent" in result.stdout, result.stderr[-3000:]
