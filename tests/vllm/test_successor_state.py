"""``graft.successor_state``: the learned successor matrix survives a restart, refuses
files that do not fit, and a burst of aborted requests leaves no per-request state."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from tests.vllm.conftest import graft_spec, running_llm, spec_metrics
from vllm_graft.core.config import GraftConfigError, SuccessorStateConfig
from vllm_graft.core.successor import (TOKENIZER_FINGERPRINT_KEY, SuccessorFileError,
                                       SuccessorMatrix, read_successor_file)
from vllm_graft.vllm.config import (load_speculative_config_arg, tokenizer_fingerprint,
                                    translate_speculative_config)
from vllm_graft.vllm.successor_state import SuccessorStateKeeper

PROMPTS = ["def fib(n):", "The capital of France is", "for i in range(10):\n"]


def flush_successor_state(worker) -> None:
    """Wait for a periodic save's background write (runs in the worker)."""
    from vllm_graft.vllm.rpc import _proposer

    _proposer(worker).state_keeper.flush()


def _digest(table: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(table.cpu().numpy().tobytes()).hexdigest()


def _state_spec(tiny_models, path, **state) -> dict:
    return graft_spec(tiny_models.head, budget=16, isolation="global",
                      successor_state={"path": str(path), **state})


# ---- configuration ------------------------------------------------------------------
def test_state_path_is_resolved_and_its_folder_checked(tiny_models, tmp_path):
    (tmp_path / "graft.json").write_text(json.dumps(
        {"method": "graft", "model": str(tiny_models.head),
         "graft": {"isolation": "global", "successor_state": {"path": "state/graft.sm"}}}))
    spec = load_speculative_config_arg(str(tmp_path / "graft.json"))
    assert spec["graft"]["successor_state"]["path"] == str(tmp_path / "state/graft.sm")
    with pytest.raises(GraftConfigError, match=r"graft\.successor_state\.path: folder .*state"):
        translate_speculative_config(spec)
    (tmp_path / "state").mkdir()
    _, settings = translate_speculative_config(spec)
    assert settings["successor_state"] == {"path": str(tmp_path / "state/graft.sm"),
                                           "save_every_s": 300.0}
    with pytest.raises(GraftConfigError, match=r"successor_state\.save_every_s"):
        translate_speculative_config(_state_spec(tiny_models, tmp_path / "s", save_every_s=-1))
    with pytest.raises(GraftConfigError, match=r"successor_state\.paht: unknown key"):
        translate_speculative_config(graft_spec(tiny_models.head,
                                                successor_state={"path": "x", "paht": "y"}))
    with pytest.raises(GraftConfigError, match="successor_state saves one shared matrix"):
        translate_speculative_config(graft_spec(tiny_models.head, isolation="tenant",
                                                successor_state={"path": "x"}))


def test_a_state_path_that_cannot_be_written_is_refused_at_startup(tiny_models, tmp_path,
                                                                   monkeypatch):
    """Found at start-up, not at the first save minutes into serving. (The suite runs
    as root, which writes anywhere: the permission answer is what changes here.)"""
    import os

    import vllm_graft.vllm.config as config_module

    spec = _state_spec(tiny_models, tmp_path / "graft.sm")
    translate_speculative_config(spec)
    monkeypatch.setattr(config_module.os, "access", lambda path, mode: False)
    with pytest.raises(GraftConfigError, match=r"successor_state\.path: .*graft\.sm.* cannot "
                                               r"be written"):
        translate_speculative_config(spec)
    monkeypatch.setattr(config_module.os, "access", os.access)


def test_a_home_relative_path_in_a_config_file_is_the_home_folders(tiny_models, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf/graft.json").write_text(json.dumps(
        {"method": "graft", "model": str(tiny_models.head),
         "graft": {"isolation": "global", "successor_state": {"path": "~/graft.sm"}}}))
    spec = load_speculative_config_arg(str(tmp_path / "conf/graft.json"))
    assert spec["graft"]["successor_state"]["path"] == str(tmp_path / "graft.sm")
    _, settings = translate_speculative_config(spec)
    assert settings["successor_state"]["path"] == str(tmp_path / "graft.sm")


@pytest.mark.parametrize("rank, index, writes", [(0, 0, True), (0, 1, False), (1, 1, False),
                                                 (0, None, True), (1, None, False)])
def test_one_data_parallel_engine_writes_the_state(rank, index, writes):
    """vLLM 0.32 runs each data-parallel engine of a dense model as an independent one,
    with ``data_parallel_rank`` 0 in every engine; ``data_parallel_index`` keeps its
    place. Read from the rank, every engine wrote the one file, each over the others'."""
    from types import SimpleNamespace

    from vllm_graft.vllm.successor_state import is_first_data_parallel_engine

    config = SimpleNamespace(data_parallel_rank=rank)
    if index is not None:
        config.data_parallel_index = index
    assert is_first_data_parallel_engine(config) is writes


@pytest.mark.parametrize("problem, message", [
    ("tokenizer", "learned with another tokenizer"),
    ("vocabulary", "vocab_size 77 does not match the model's"),
    ("truncated", "truncated"),
])
def test_unfit_state_files_are_refused_at_startup(tiny_models, tmp_path, problem, message):
    from vllm import LLM

    path = tmp_path / "graft.sm"
    vocab = 77 if problem == "vocabulary" else 2048
    fingerprint = "0" * 64 if problem == "tokenizer" else None
    matrix = SuccessorMatrix.empty(vocab, 8)
    matrix.update_(torch.arange(5), torch.arange(40).reshape(5, 8))
    matrix.save(path, {TOKENIZER_FINGERPRINT_KEY: fingerprint} if fingerprint else {})
    if problem == "truncated":
        path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(SuccessorFileError, match=f"graft.sm.*{message}"):
        LLM(model=str(tiny_models.target), dtype="float32", enforce_eager=True,
            max_model_len=512, speculative_config=_state_spec(tiny_models, path))


def test_keeper_saves_on_its_period_only_as_the_writer(tmp_path, caplog):
    now = [0.0]
    matrix = SuccessorMatrix.empty(100, 4)
    config = SuccessorStateConfig(path=str(tmp_path / "s.sm"), save_every_s=10)
    keeper = SuccessorStateKeeper(config, lambda: matrix, {"k": 1}, writer=True,
                                  clock=lambda: now[0])
    keeper.maybe_save()
    assert keeper.saves == 0
    now[0] = 10.0
    keeper.maybe_save()  # written on a background thread
    keeper.flush()
    assert keeper.saves == 1
    _, metadata = read_successor_file(tmp_path / "s.sm")
    assert metadata["reason"] == "periodic" and metadata["k"] == 1
    silent = SuccessorStateKeeper(SuccessorStateConfig(path=str(tmp_path / "t.sm")),
                                  lambda: matrix, {}, writer=False)
    assert silent.save("shutdown") is None and not (tmp_path / "t.sm").exists()
    broken = SuccessorStateKeeper(SuccessorStateConfig(path=str(tmp_path / "gone/u.sm")),
                                  lambda: matrix, {}, writer=True)
    with caplog.at_level(logging.ERROR):
        assert broken.save("periodic") is None  # logged, never raised into the engine loop
    assert "could not save the successor state" in caplog.text


# ---- the real engine ------------------------------------------------------------------
def test_state_survives_a_restart(tiny_models, tmp_path):
    from vllm import SamplingParams

    from vllm_graft.vllm.rpc import matrix_digest

    path = tmp_path / "graft.sm"
    spec = _state_spec(tiny_models, path, save_every_s=0)
    greedy = SamplingParams(temperature=0, max_tokens=32)
    with running_llm(tiny_models.target, spec) as llm:
        llm.generate(PROMPTS, greedy, use_tqdm=False)
        learned = llm.collective_rpc(matrix_digest)[0]
        assert not path.exists()  # save_every_s 0: saved only at shutdown
    table, metadata = read_successor_file(path)
    assert _digest(table) == learned and metadata["reason"] == "shutdown"
    assert metadata[TOKENIZER_FINGERPRINT_KEY] == tokenizer_fingerprint(str(tiny_models.target))
    assert int((table[:, 0] >= 0).sum()) > 0

    with running_llm(tiny_models.target, spec) as llm:
        assert llm.collective_rpc(matrix_digest)[0] == learned  # loaded, not the warm-up
        llm.generate(["while True:"], greedy, use_tqdm=False)
    table_after, _ = read_successor_file(path)
    assert _digest(table_after) != learned  # the second run's learning was saved too


def test_periodic_saves_while_serving(tiny_models, tmp_path):
    from vllm import SamplingParams

    path = tmp_path / "graft.sm"
    with running_llm(tiny_models.target, _state_spec(tiny_models, path, save_every_s=1e-6)) \
            as llm:
        llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        llm.collective_rpc(flush_successor_state)
        assert read_successor_file(path)[1]["reason"] == "periodic"


def test_aborted_requests_leave_no_request_state(tiny_models):
    """Requests aborted mid-generation (a client gone) are forgotten like finished ones."""
    from vllm import SamplingParams

    from vllm_graft.vllm.rpc import request_state_counts

    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    with running_llm(tiny_models.target, graft_spec(tiny_models.head, budget=16)) as llm:
        engine = llm.llm_engine
        ids = [f"burst-{i}" for i in range(8)]
        for i, req_id in enumerate(ids):
            engine.add_request(req_id, PROMPTS[i % len(PROMPTS)] * (1 + i % 3), long)
        for _ in range(4):  # prefill, then tree steps: every request holds state
            engine.step()
        held = llm.collective_rpc(request_state_counts)[0]
        assert held["pending_trees"] > 0 and held["context_indexes"] == len(ids)
        engine.abort_request(ids[::2])
        for _ in range(2):
            engine.step()
        assert llm.collective_rpc(request_state_counts)[0]["context_indexes"] == len(ids) // 2
        engine.abort_request(ids[1::2])
        while engine.has_unfinished_requests():
            engine.step()
        engine.step()  # the step after the aborts tells the runner which requests left
        assert llm.collective_rpc(request_state_counts)[0] == dict.fromkeys(held, 0)
        # and the engine still serves, greedy as ever
        out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 8


def test_worker_hands_kept_heap_back_on_its_period(tiny_models):
    """``graft.heap_trim_s``: the worker trims its heap between steps, at most once per
    period, and counts it (a period shorter than a step: every step)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with running_llm(tiny_models.target, graft_spec(tiny_models.head, budget=16,
                                                    heap_trim_s=1e-6)) as llm:
        llm.generate(PROMPTS[:2], params, use_tqdm=False)
        metrics = spec_metrics(llm)
    assert metrics["graft_heap_trims"] >= 8
    assert metrics["graft_heap_trim_us"] > 0
