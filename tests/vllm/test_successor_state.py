"""``graft.successor_state``: the learned successor matrix survives a restart, refuses
files that do not fit, and a burst of aborted requests leaves no per-request state."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.vllm.conftest import graft_spec, greedy_token_ids, running_llm, spec_metrics
from vllm_graft.core.config import GraftConfigError, SuccessorStateConfig
from vllm_graft.core.successor import (TOKENIZER_FINGERPRINT_KEY, MatrixSnapshot,
                                       SuccessorFileError, SuccessorMatrix,
                                       read_successor_file, temporary_files)
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
                                           "save_every_s": 300.0, "on_corrupt": "move_aside"}
    with pytest.raises(GraftConfigError, match=r"successor_state\.save_every_s"):
        translate_speculative_config(_state_spec(tiny_models, tmp_path / "s", save_every_s=-1))
    with pytest.raises(GraftConfigError, match=r"successor_state\.on_corrupt"):
        translate_speculative_config(_state_spec(tiny_models, tmp_path / "s",
                                                 on_corrupt="delete"))
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
def test_unfit_state_files_are_refused_at_startup_when_told(tiny_models, tmp_path, problem,
                                                            message):
    """``on_corrupt: "refuse"``: start-up stops with an error naming the file, which is
    left where it is."""
    from vllm import LLM

    path = _unfit_state_file(tmp_path / "graft.sm", problem)
    before = path.read_bytes()
    with pytest.raises(SuccessorFileError, match=f"graft.sm.*{message}"):
        LLM(model=str(tiny_models.target), dtype="float32", enforce_eager=True,
            max_model_len=512, speculative_config=_state_spec(tiny_models, path,
                                                              on_corrupt="refuse"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["graft.sm"]
    assert path.read_bytes() == before


def _records(caplog) -> list[logging.LogRecord]:
    """Each record once: once an engine has started in this process, a Graft record
    reaches the capturing handler both through vLLM's logger and through the root."""
    return list({id(record): record for record in caplog.records}.values())


def _unfit_state_file(path, problem: str, vocab: int = 2048):
    """A state file the tiny target cannot use: ``problem`` names why."""
    fingerprint = "0" * 64 if problem == "tokenizer" else None
    matrix = SuccessorMatrix.empty(77 if problem == "vocabulary" else vocab, 8)
    matrix.update_(torch.arange(5), torch.arange(40).reshape(5, 8))
    matrix.save(path, {TOKENIZER_FINGERPRINT_KEY: fingerprint} if fingerprint else {})
    if problem == "truncated":
        path.write_bytes(path.read_bytes()[:-7])
    elif problem == "corrupt":
        data = bytearray(path.read_bytes())
        data[-3] ^= 0xFF
        path.write_bytes(bytes(data))
    elif problem == "empty":
        path.write_bytes(b"")
    return path


# ---- on_corrupt, stray temporary files, failing saves (no engine) ----------------------
@pytest.mark.parametrize("problem", ["tokenizer", "vocabulary", "truncated", "corrupt",
                                     "empty"])
def test_an_unusable_state_file_is_moved_aside_and_kept(tmp_path, problem, caplog):
    from vllm_graft.vllm.successor_state import load_successor_state

    path = _unfit_state_file(tmp_path / "graft.sm", problem, vocab=100)
    before = path.read_bytes()
    config = SuccessorStateConfig(path=str(path))
    assert config.on_corrupt == "move_aside"
    with caplog.at_level(logging.WARNING):
        assert load_successor_state(config, writer=True, fallback="the warm-up file w.sm",
                                    vocab_size=100, k=8, tokenizer_fingerprint="1" * 64) is None
    (kept,) = tmp_path.iterdir()
    assert kept.name.startswith("graft.sm.corrupt-") and kept.name.endswith("Z")
    assert kept.read_bytes() == before
    assert str(path) in caplog.text and str(kept) in caplog.text
    assert "the warm-up file w.sm" in caplog.text
    # refused when told, the file left in place
    kept.rename(path)
    with pytest.raises(SuccessorFileError, match="graft.sm"):
        load_successor_state(SuccessorStateConfig(path=str(path), on_corrupt="refuse"),
                             writer=True, vocab_size=100, k=8, tokenizer_fingerprint="1" * 64)
    assert [p.name for p in tmp_path.iterdir()] == ["graft.sm"]


def test_every_file_moved_aside_is_kept_and_other_ranks_leave_it(tmp_path, caplog):
    from vllm_graft.vllm.successor_state import load_successor_state

    path = tmp_path / "graft.sm"
    config = SuccessorStateConfig(path=str(path))
    contents = []
    for i in range(3):  # within one second: each keeps its own name
        path.write_bytes(b"not a matrix %d" % i)
        contents.append(path.read_bytes())
        # a rank that does not write leaves the file to the writer
        assert load_successor_state(config, writer=False, vocab_size=100) is None
        assert path.exists()
        assert load_successor_state(config, writer=True, vocab_size=100) is None
        assert not path.exists()
    kept = sorted(tmp_path.iterdir(), key=lambda p: (len(p.name), p.name))
    assert len(kept) == 3 and sorted(p.read_bytes() for p in kept) == sorted(contents)
    # a good file loads; no file is no matrix
    good = SuccessorMatrix.empty(100, 8)
    good.update_(torch.arange(3), torch.arange(24).reshape(3, 8))
    good.save(path)
    loaded = load_successor_state(config, writer=True, vocab_size=100, k=8)
    assert torch.equal(loaded.table, good.table)
    assert load_successor_state(SuccessorStateConfig(path=str(tmp_path / "none.sm")),
                                writer=True) is None


def test_a_file_that_cannot_be_moved_aside_stops_startup(tmp_path, monkeypatch):
    """Else the first save would replace it: a corrupt file is never lost."""
    import vllm_graft.vllm.successor_state as state_module

    path = tmp_path / "graft.sm"
    path.write_bytes(b"garbage")

    def denied(src, dst):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(state_module.os, "rename", denied)
    with pytest.raises(SuccessorFileError, match=r"graft\.sm.*could not be moved aside"):
        state_module.load_successor_state(SuccessorStateConfig(path=str(path)), writer=True)
    assert path.read_bytes() == b"garbage"


def test_the_writer_removes_stray_temporaries_at_startup(tmp_path):
    path = tmp_path / "graft.sm"
    strays = [".graft.sm.0123456789ab.tmp", ".graft.sm.abcdef012345.tmp"]
    kept = ["graft.sm", ".other.sm.0123456789ab.tmp", "graft.sm.corrupt-20250101T000000Z",
            ".graft.sm.notes.tmp.txt"]
    for name in strays + kept:
        (tmp_path / name).write_bytes(b"x")
    matrix = SuccessorMatrix.empty(100, 4)
    config = SuccessorStateConfig(path=str(path))
    SuccessorStateKeeper(config, lambda: matrix, {}, writer=False)  # not its file to tidy
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(strays + kept)
    SuccessorStateKeeper(config, lambda: matrix, {}, writer=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)


def test_failing_saves_are_logged_once_counted_and_retried(tmp_path, caplog):
    """A real write failure: the file-size limit (RLIMIT_FSIZE) below the file's size.
    Python ignores SIGXFSZ, so the write fails with EFBIG; the last good file stays."""
    import resource

    now = [0.0]
    path = tmp_path / "s.sm"
    matrix = SuccessorMatrix.empty(5000, 8)
    matrix.update_(torch.arange(2000), torch.randint(0, 5000, (2000, 8), dtype=torch.int32))
    SuccessorMatrix.empty(5000, 8).save(path)
    good = path.read_bytes()
    keeper = SuccessorStateKeeper(SuccessorStateConfig(path=str(path), save_every_s=10),
                                  lambda: matrix, {}, writer=True, clock=lambda: now[0])
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    caplog.set_level(logging.INFO, logger="vllm_graft.vllm.successor_state")
    resource.setrlimit(resource.RLIMIT_FSIZE, (16_384, hard))
    try:
        for step in range(1, 4):  # three periods, three failures, one error line
            now[0] = 10.0 * step
            keeper.maybe_save()
            keeper.flush()
            keeper.maybe_save()  # within the period: not tried again
        assert keeper.save("shutdown") is None  # a failing shutdown save never raises
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert keeper.failures == 4 and keeper.take_failures() == 4 and keeper.take_failures() == 0
    errors = [r for r in _records(caplog) if r.levelno == logging.ERROR]
    assert len(errors) == 2  # once for the periodic saves' kind, once at shutdown
    assert "EFBIG" in errors[0].getMessage() and "s.sm" in errors[0].getMessage()
    assert path.read_bytes() == good and sorted(p.name for p in tmp_path.iterdir()) == ["s.sm"]
    now[0] = 50.0
    keeper.maybe_save()  # the limit lifted: the next period's save goes through
    keeper.flush()
    assert keeper.saves == 1 and keeper.take_failures() == 0
    assert torch.equal(read_successor_file(path)[0], matrix.table)
    assert "saved to" in caplog.text and "after 4 failed save(s)" in caplog.text


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


def test_an_unusable_state_file_is_moved_aside_and_the_warmup_used(tiny_models, tmp_path,
                                                                    caplog):
    """The default ``on_corrupt``: start-up goes on from the warm-up file, the corrupt
    file kept beside under another name, and the next save writes a good one."""
    from vllm import SamplingParams

    from vllm_graft.vllm.rpc import matrix_digest

    warmup = tmp_path / "warm.sm"
    matrix = SuccessorMatrix.empty(2048, 8)
    matrix.update_(torch.arange(10, 20), torch.arange(80).reshape(10, 8))
    matrix.save(warmup, {TOKENIZER_FINGERPRINT_KEY: tokenizer_fingerprint(
        str(tiny_models.target))})
    path = _unfit_state_file(tmp_path / "graft.sm", "truncated")
    corrupt = path.read_bytes()
    spec = _state_spec(tiny_models, path, save_every_s=0)
    spec["graft"]["warmup"] = str(warmup)
    with caplog.at_level(logging.WARNING, logger="vllm_graft"):
        with running_llm(tiny_models.target, spec) as llm:
            assert llm.collective_rpc(matrix_digest)[0] == _digest(matrix.table)
            (kept,) = tmp_path.glob("graft.sm.corrupt-*")
            assert kept.read_bytes() == corrupt and not path.exists()
            llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8),
                         use_tqdm=False)
    warning = next(r.getMessage() for r in caplog.records if "moved it aside" in r.getMessage())
    assert str(path) in warning and str(kept) in warning and str(warmup) in warning
    assert read_successor_file(path)[1]["reason"] == "shutdown"  # written anew
    assert kept.read_bytes() == corrupt


def test_failing_saves_never_stop_serving(tiny_models, plain_outputs, tmp_path, monkeypatch,
                                          caplog):
    """Every save fails (the disk full): each is counted, one error line says so, the
    answers are plain decoding's; once the disk has room, the next period's save
    writes the file."""
    from tests.vllm.test_greedy_lossless import MAX_TOKENS
    from tests.vllm.test_greedy_lossless import PROMPTS as LOSSLESS_PROMPTS

    write, full = MatrixSnapshot.write, [True]

    def disk_full(self, target, metadata=None):
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, target, metadata)
    monkeypatch.setattr(MatrixSnapshot, "write", disk_full)
    path = tmp_path / "graft.sm"
    with caplog.at_level(logging.INFO, logger="vllm_graft"):
        with running_llm(tiny_models.target, _state_spec(tiny_models, path,
                                                         save_every_s=1e-6)) as llm:
            assert greedy_token_ids(llm, LOSSLESS_PROMPTS, MAX_TOKENS) == plain_outputs
            llm.collective_rpc(flush_successor_state)
            assert spec_metrics(llm)["graft_successor_state_save_failures"] >= 3
            assert not path.exists()
            full[0] = False
            assert greedy_token_ids(llm, LOSSLESS_PROMPTS[:2], 8) == [
                out[:8] for out in plain_outputs[:2]]
            llm.collective_rpc(flush_successor_state)
            assert read_successor_file(path)[1]["reason"] == "periodic"
    errors = [r.getMessage() for r in _records(caplog) if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "could not save the successor state" in errors[0]
    assert "ENOSPC" in errors[0] and str(path) in errors[0]
    assert "failed save(s)" in caplog.text


# ---- SIGKILL during saves --------------------------------------------------------------
_SAVING_CHILD = """
import json, os, sys
from tests.vllm.conftest import graft_spec, running_llm
from vllm import SamplingParams

target, head, path, every, mode, marker = sys.argv[1:7]
if mode == "forever":  # slow writes (4 KB, then 2 ms): a kill lands mid-save often
    import time
    from vllm_graft.core import successor
    def slow_write_all(fd, data, write_all=successor._write_all):
        for start in range(0, len(data), 4096):
            write_all(fd, data[start:start + 4096])
            time.sleep(0.002)
    successor._write_all = slow_write_all
spec = graft_spec(head, budget=16, isolation="global",
                  successor_state={"path": path, "save_every_s": float(every)})
with running_llm(target, spec) as llm:
    listing = sorted(os.listdir(os.path.dirname(path)))
    with open(marker + ".part", "w") as f:
        json.dump(listing, f)
    os.rename(marker + ".part", marker)
    prompts = ["def fib(n):", "The capital of France is", "for i in range(10):\\n"]
    params = SamplingParams(temperature=0.8, max_tokens=48, ignore_eos=True)
    while True:
        llm.generate(prompts, params, use_tqdm=False)
        if mode == "once":
            break
"""


def _start_saving_engine(tiny_models, path: Path, markers: Path, log, every: float,
                         mode: str) -> tuple[subprocess.Popen, list[str]]:
    """A child process running an in-process engine that saves ``path`` every ``every``
    seconds while generating (forever, or once); returns it with the state folder's
    listing it saw right after start-up."""
    marker = markers / f"started-{time.monotonic_ns()}.json"
    child = subprocess.Popen(
        [sys.executable, "-c", _SAVING_CHILD, str(tiny_models.target), str(tiny_models.head),
         str(path), str(every), mode, str(marker)],
        cwd=Path(__file__).resolve().parents[2], stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, start_new_session=True)
    deadline = time.monotonic() + 180
    while not marker.exists():
        if child.poll() is not None or time.monotonic() > deadline:
            _kill(child)
            raise AssertionError("the engine did not start: "
                                 + Path(log.name).read_text()[-3000:])
        time.sleep(0.05)
    return child, json.loads(marker.read_text())


def _kill(child: subprocess.Popen) -> None:
    if child.poll() is None:
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def test_sigkill_during_saves_always_leaves_a_loadable_file(tiny_models, tmp_path):
    """An engine saving at every step (its writes slowed down, so that saves fill most
    of its time) is SIGKILLed at random moments, again and again, half the time while
    a temporary file is seen: the file always loads (its checksum valid) and was written
    by the killed engine; the temporary files the kills left are gone after the next
    start, and only they."""
    state, markers = tmp_path / "state", tmp_path / "markers"
    state.mkdir()
    markers.mkdir()
    path = state / "graft.sm"
    rng = random.Random(0)
    left = []  # temporary files each kill left
    with open(tmp_path / "engine.log", "w") as log:
        for kill in range(4):
            child, listing = _start_saving_engine(tiny_models, path, markers, log, 1e-6,
                                                  "forever")
            try:
                assert not [n for n in listing if n.endswith(".tmp")], listing
                deadline = time.monotonic() + 60
                while True:  # the first save of this engine (each read a whole file)
                    if path.exists() and read_successor_file(path)[1]["pid"] == child.pid:
                        break
                    assert child.poll() is None and time.monotonic() < deadline
                    time.sleep(0.01)
                time.sleep(rng.uniform(0.0, 0.5))
                while kill % 2 and not temporary_files(path):  # mid-save
                    assert child.poll() is None and time.monotonic() < deadline
                    time.sleep(0.001)
            finally:
                _kill(child)
            table, metadata = read_successor_file(path)  # the last complete save
            assert metadata["pid"] == child.pid and int((table[:, 0] >= 0).sum()) > 0
            left.append(len(temporary_files(path)))
        assert sum(left) > 0, left
        # a stray for sure, and files that are not the writer's own
        (state / ".graft.sm.0123456789ab.tmp").write_bytes(b"half a save")
        others = ["notes.tmp", ".other.sm.0123456789ab.tmp", "graft.sm.corrupt-20250101T000000Z"]
        for name in others:
            (state / name).write_bytes(b"x")
        child, listing = _start_saving_engine(tiny_models, path, markers, log, 0, "once")
        assert child.wait(timeout=120) == 0
    assert listing == sorted(["graft.sm", *others])
    assert sorted(os.listdir(state)) == sorted(["graft.sm", *others])
    assert read_successor_file(path)[1]["reason"] == "shutdown"


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
