"""``vllm-graft``'s command line follows argparse's conventions: ``--version`` from the
package metadata, every default shown in ``--help``, one meaning per flag name across
commands (``--num-prompts`` counts, ``--prompts-file`` names a file), ``generate`` stops
at the end of an answer unless told otherwise, the engine options reach vLLM's engine
arguments, and a model is a directory or a Hub ID (an unreachable one stops the tool
with its name before any engine starts)."""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
from importlib import metadata

import pytest

from vllm_graft.cli import main as cli_main
from vllm_graft.cli.common import engine_options

COMMANDS = sorted(cli_main.MODULES)


def command_parser(command: str) -> argparse.ArgumentParser:
    return importlib.import_module(f"vllm_graft.cli.{cli_main.MODULES[command]}").build_parser()


def visible_options(parser):
    return [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS
            and not isinstance(a, (argparse._HelpAction, argparse._VersionAction))]


def test_version_comes_from_the_package_metadata(capsys):
    with pytest.raises(SystemExit) as stop:
        cli_main.main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"vllm-graft {metadata.version('vllm-graft')}"


def test_the_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as stop:
        cli_main.main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in cli_main.COMMANDS)
    with pytest.raises(SystemExit) as stop:
        cli_main.main(["no-such-command"])
    assert stop.value.code == 2
    assert "invalid choice: 'no-such-command'" in capsys.readouterr().err


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_every_default(command, capsys, monkeypatch):
    """Each option has help, and each default shows in ``--help`` (an option whose
    default is None, which stands for something computed, says it in its own words)."""
    monkeypatch.setenv("COLUMNS", "10000")  # one line per option
    parser = command_parser(command)
    with pytest.raises(SystemExit) as stop:
        cli_main.main([command, "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    for action in visible_options(parser):
        assert action.help, f"{command} {action.option_strings[0]}: no help text"
        if action.default is not None and not (action.nargs == 0 and action.default is False):
            assert f"(default: {action.default})" in out, (command, action.option_strings)
    if command in ("warmup", "calibrate", "generate", "train-head", "train-dflash"):
        assert "(default: auto)" in out  # --dtype


def test_a_flag_name_means_one_thing_in_every_command():
    """The same spelling has the same type and arity wherever it appears, and a prompt
    count is ``--num-prompts`` everywhere (``--prompts`` was a file in one command and
    a count in others)."""
    meanings: dict[str, set] = {}
    for command in COMMANDS:
        for action in visible_options(command_parser(command)):
            for flag in action.option_strings:
                meanings.setdefault(flag, set()).add((action.type, action.nargs,
                                                      type(action).__name__))
    assert {flag: seen for flag, seen in meanings.items() if len(seen) > 1} == {}
    assert "--prompts" not in meanings  # only as a hidden old spelling
    assert meanings["--num-prompts"] == {(int, None, "_StoreAction")}


def test_the_old_prompts_spellings_say_what_to_use(capsys):
    bench = command_parser("bench")
    with pytest.raises(SystemExit) as stop:
        bench.parse_args(["--out", "o", "--prompts", "4"])
    assert stop.value.code == 2
    assert "--prompts was renamed --num-prompts: pass --num-prompts 4" in capsys.readouterr().err
    generate = command_parser("generate")
    args = generate.parse_args(["m", "--speculative-config", "{}", "--prompts", "p.txt"])
    assert args.prompts_file == "p.txt"
    assert "--prompts is deprecated, use --prompts-file" in capsys.readouterr().err


def test_generate_stops_at_the_end_of_an_answer_by_default():
    from vllm_graft.cli.generate import parse_args

    assert parse_args(["m", "--speculative-config", "{}"]).ignore_eos is False
    assert parse_args(["m", "--speculative-config", "{}", "--ignore-eos"]).ignore_eos is True


@pytest.mark.parametrize("command", ["warmup", "calibrate"])
def test_engine_options_are_passed_to_the_engine_as_given(command):
    parser = command_parser(command)
    required = ["MODEL", "--head", "HEAD", "--out", "out"]
    assert engine_options(parser.parse_args(required)) == {
        "dtype": "auto", "tensor_parallel_size": 1, "max_model_len": 4096,
        "gpu_memory_utilization": 0.9, "max_num_seqs": 16}
    given = parser.parse_args(required + [
        "--tensor-parallel-size", "8", "--max-model-len", "32768", "--dtype", "bfloat16",
        "--gpu-memory-utilization", "0.85", "--max-num-seqs", "64"])
    assert engine_options(given) == {
        "dtype": "bfloat16", "tensor_parallel_size": 8, "max_model_len": 32768,
        "gpu_memory_utilization": 0.85, "max_num_seqs": 64}
    for flag, eager in (("--enforce-eager", True), ("--no-enforce-eager", False)):
        assert engine_options(parser.parse_args(required + [flag]))["enforce_eager"] is eager


def test_the_tools_engines_capture_cuda_graphs_where_there_is_a_gpu(monkeypatch):
    """Unless the command line says otherwise, a tool's engine runs eagerly only where
    there is no GPU: on a GPU it captures CUDA graphs, as ``vllm serve`` does, so a
    benchmark there compares what servers run."""
    from vllm_graft.offline import engine

    for gpu in (False, True):
        monkeypatch.setattr(engine, "has_gpu", lambda gpu=gpu: gpu)
        assert engine.engine_settings(max_num_seqs=4)["enforce_eager"] is not gpu
        assert engine.engine_settings(enforce_eager=False)["enforce_eager"] is False
        assert engine.engine_settings(enforce_eager=True)["enforce_eager"] is True


def test_the_trainers_answer_engine_fits_a_prompt_and_its_answer():
    from vllm_graft.cli.common import answer_engine_options

    args = command_parser("train-head").parse_args(
        ["MODEL", "--out", "o", "--max-prompt-tokens", "100", "--max-tokens", "50",
         "--tensor-parallel-size", "2"])
    options = answer_engine_options(args)
    assert options["max_model_len"] == 150 and options["tensor_parallel_size"] == 2
    assert options["dtype"] == "auto" and options["max_num_seqs"] == 64


def hub_cache(root, repo: str, config: dict):
    """A Hugging Face cache holding ``repo``'s config.json at revision ``main``."""
    folder = root / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("0" * 40)
    (snapshot / "config.json").write_text(json.dumps(config))
    return snapshot / "config.json"


def test_a_model_is_a_directory_or_a_hub_id(tmp_path):
    from vllm_graft.core.calibration import fingerprint_model
    from vllm_graft.offline.models import (ModelNotFoundError, model_config_file,
                                           model_fingerprint, model_name)

    local = tmp_path / "model"
    local.mkdir()
    (local / "config.json").write_text('{"num_hidden_layers": 2}')
    assert model_config_file(str(local)) == local / "config.json"
    assert model_fingerprint(str(local)) == fingerprint_model(local)
    # a Hub ID: its config.json from the Hugging Face cache, the same identity a local
    # snapshot of it has
    cache = tmp_path / "hub"
    cached = hub_cache(cache, "acme/tiny", {"num_hidden_layers": 2})
    assert model_config_file("acme/tiny", cache_dir=cache, local_files_only=True) == cached
    assert model_fingerprint("acme/tiny", cache_dir=cache, local_files_only=True) \
        == hashlib.sha256(cached.read_bytes()).hexdigest()
    assert model_name("acme/tiny") == "tiny" and model_name(str(local) + "/") == "model"
    with pytest.raises(ModelNotFoundError, match="'acme/missing': neither a local model "
                       "directory nor a Hugging Face Hub model ID"):
        model_config_file("acme/missing", cache_dir=cache, local_files_only=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="exists but holds no config.json"):
        model_config_file(str(empty))


@pytest.mark.parametrize("command", ["warmup", "calibrate", "train-head"])
def test_an_unreachable_hub_id_stops_the_tool_before_any_work(command, tmp_path,
                                                              monkeypatch, capsys):
    """Fingerprints were taken at the end, after every engine had run; now the model
    is resolved first and a name that is neither a directory nor a reachable Hub ID is
    a usage error naming it."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("VLLM_GRAFT_CACHE", str(tmp_path / "cache"))
    argv = [command, "acme/no-such-model", "--out", str(tmp_path / "out")]
    if command != "train-head":
        head = tmp_path / "head"
        head.mkdir()
        (head / "config.json").write_text("{}")
        argv += ["--head", str(head)]
    with pytest.raises(SystemExit) as stop:
        cli_main.main(argv)
    assert stop.value.code == 2
    assert "model 'acme/no-such-model': neither a local model directory nor a Hugging " \
        "Face Hub model ID" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
