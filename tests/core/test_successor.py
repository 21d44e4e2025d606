import json
import struct

import pytest
import torch

from vllm_graft.core.successor import (EMPTY, FILE_MAGIC, SuccessorFileError, SuccessorMatrix,
                                       read_successor_file)

BACKENDS = ["compiled", "reference"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_matrix_and_memory_figure(backend):
    m = SuccessorMatrix.empty(151_936, 8, backend=backend)
    assert m.table.dtype == torch.int32 and m.table.shape == (151_936, 8)
    assert bool((m.table == EMPTY).all())
    assert m.nbytes == 151_936 * 8 * 4  # 4.9 MB
    assert m.touched_rows().numel() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_update_from_logits_writes_topk_and_skips_padding(backend):
    m = SuccessorMatrix.empty(50, 3, backend=backend)
    logits = torch.randn(4, 50)
    m.update_from_logits_(torch.tensor([7, -1, 49, 7]), logits)
    assert m.table[7].tolist() == logits[3].topk(3).indices.tolist()  # last duplicate wins
    assert m.table[49].tolist() == logits[2].topk(3).indices.tolist()
    assert m.touched_rows().tolist() == [7, 49]
    gathered = m.gather(torch.tensor([7, 49, -1, 3]), torch.tensor([0, 2, 1, 0]))
    assert gathered.tolist() == [m.table[7, 0].item(), m.table[49, 2].item(), -1, -1]


def _warm_matrix(vocab=1000, k=4, rows=37):
    m = SuccessorMatrix.empty(vocab, k)
    ids = torch.randperm(vocab)[:rows]
    m.update_(ids, torch.randint(0, vocab, (rows, k)))
    return m


def test_save_load_roundtrip_is_compact(tmp_path):
    m = _warm_matrix()
    path = tmp_path / "succ.bin"
    size = m.save(path, metadata={"rounds": 5})
    assert size < 1000 + 37 * 4 * 5  # header + touched rows only, not vocab x k
    loaded = SuccessorMatrix.load(path, vocab_size=1000, k=4)
    assert torch.equal(loaded.table, m.table)
    _, meta = read_successor_file(path)
    assert meta == {"rounds": 5}


def test_empty_matrix_roundtrip(tmp_path):
    m = SuccessorMatrix.empty(10, 2)
    m.save(tmp_path / "e.bin")
    assert torch.equal(SuccessorMatrix.load(tmp_path / "e.bin").table, m.table)


def test_the_engine_skips_the_facade_checks_and_the_cpu_kernels_still_refuse(tmp_path):
    """``check`` reaches the matrix from :meth:`empty` and :meth:`load` (a table off the
    CPU keeps it; on the CPU the facade never checks, the kernel always does). Graft's
    engine builds its matrix unchecked: on a GPU each check is a device sync. Unchecked
    on the CPU, a bad id is still refused."""
    _warm_matrix().save(tmp_path / "m.bin")
    for check in (True, False):
        assert SuccessorMatrix.empty(10, 2, device="meta", check=check).check is check
        assert SuccessorMatrix.load(tmp_path / "m.bin", device="meta", check=check).check \
            is check
    unchecked = SuccessorMatrix.load(tmp_path / "m.bin", check=False)
    with pytest.raises(ValueError, match="parent_tokens"):
        unchecked.gather(torch.tensor([1000]), torch.tensor([0]))
    with pytest.raises(ValueError, match="tokens"):
        unchecked.update_(torch.tensor([1000]), torch.zeros(1, 4, dtype=torch.long))


def _rewrite(path, mutate_header=None, payload_edit=None):
    data = path.read_bytes()
    (hlen,) = struct.unpack_from("<I", data, len(FILE_MAGIC))
    start = len(FILE_MAGIC) + 4
    header = json.loads(data[start:start + hlen])
    payload = bytearray(data[start + hlen:])
    if mutate_header:
        mutate_header(header)
    if payload_edit:
        payload_edit(payload)
    hb = json.dumps(header).encode()
    path.write_bytes(FILE_MAGIC + struct.pack("<I", len(hb)) + hb + bytes(payload))


@pytest.mark.parametrize("corrupt, message", [
    (lambda p: p.write_bytes(b"hello world"), "bad magic"),
    (lambda p: p.write_bytes(p.read_bytes()[:-8]), "truncated"),
    (lambda p: _rewrite(p, payload_edit=lambda b: b.__setitem__(-1, b[-1] ^ 1)), "checksum"),
    (lambda p: _rewrite(p, lambda h: h.update(format_version=99)), "format_version 99"),
    (lambda p: _rewrite(p, lambda h: h.update(k="eight")), "'k'"),
    (lambda p: p.write_bytes(FILE_MAGIC + struct.pack("<I", 3) + b"{{{"), "not valid JSON"),
])
def test_corrupt_files_raise_naming_the_file(tmp_path, corrupt, message):
    path = tmp_path / "bad.bin"
    _warm_matrix().save(path)
    corrupt(path)
    with pytest.raises(SuccessorFileError, match=message) as err:
        SuccessorMatrix.load(path)
    assert "bad.bin" in str(err.value)


def test_out_of_range_rows_are_rejected(tmp_path):
    path = tmp_path / "m.bin"
    _warm_matrix(vocab=1000).save(path)

    def shrink_vocab(h):
        h["vocab_size"] = 5
    _rewrite(path, shrink_vocab)
    with pytest.raises(SuccessorFileError, match="inside the vocabulary|outside"):
        SuccessorMatrix.load(path)


def test_model_mismatch_and_missing_file(tmp_path):
    path = tmp_path / "m.bin"
    _warm_matrix(vocab=1000, k=4).save(path)
    with pytest.raises(SuccessorFileError, match="vocab_size 1000 does not match the model's 999"):
        SuccessorMatrix.load(path, vocab_size=999)
    with pytest.raises(SuccessorFileError, match="k 4 does not match successor_k 8"):
        SuccessorMatrix.load(path, k=8)
    with pytest.raises(SuccessorFileError, match="nope.bin.*cannot be read"):
        SuccessorMatrix.load(tmp_path / "nope.bin")


def test_bad_table_is_refused():
    with pytest.raises(ValueError, match="int32"):
        SuccessorMatrix(torch.zeros(4, 2, dtype=torch.int64))


def test_tokenizer_fingerprint_mismatch_is_refused(tmp_path):
    from vllm_graft.core.successor import TOKENIZER_FINGERPRINT_KEY

    path = tmp_path / "m.bin"
    _warm_matrix(vocab=1000, k=4).save(path, {TOKENIZER_FINGERPRINT_KEY: "a" * 64})
    SuccessorMatrix.load(path, tokenizer_fingerprint="a" * 64)
    SuccessorMatrix.load(path)  # no fingerprint to compare with: the size checks only
    with pytest.raises(SuccessorFileError, match="m.bin.*learned with another tokenizer"):
        SuccessorMatrix.load(path, tokenizer_fingerprint="b" * 64)


def test_save_replaces_atomically_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "m.bin"
    _warm_matrix(vocab=1000, k=4).save(path)
    first = path.read_bytes()
    SuccessorMatrix.empty(1000, 4).save(path)
    assert path.read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.bin"]


@pytest.mark.parametrize("umask", [0o022, 0o000, 0o077, 0o277])
def test_saved_file_and_its_temporary_are_private_whatever_the_umask(tmp_path, umask,
                                                                     monkeypatch):
    """0600: the file holds what serving learned from users' text. The temporary file
    is created so (never readable by others, even for an instant), and a file replaced
    at 0644 comes back 0600."""
    import os
    import stat

    from vllm_graft.core import successor

    path = tmp_path / "m.bin"
    path.write_bytes(b"old")
    path.chmod(0o644)
    modes = []
    write_all = successor._write_all

    def spy(fd, data):  # the temporary file's mode while it is written
        modes.append(stat.S_IMODE(os.fstat(fd).st_mode))
        write_all(fd, data)
    monkeypatch.setattr(successor, "_write_all", spy)
    old = os.umask(umask)
    try:
        _warm_matrix().save(path)
    finally:
        os.umask(old)
    assert modes == [0o600]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.bin"]


def test_a_failed_write_leaves_the_last_file_and_no_temporary(tmp_path, monkeypatch):
    import errno

    from vllm_graft.core import successor

    path = tmp_path / "m.bin"
    _warm_matrix().save(path)
    before = path.read_bytes()

    def full(fd, data):
        successor.os.write(fd, data[:100])
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(successor, "_write_all", full)
    with pytest.raises(OSError, match="No space"):
        SuccessorMatrix.empty(1000, 4).save(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.bin"]


def test_temporary_files_match_the_writers_naming_only(tmp_path):
    from vllm_graft.core.successor import temporary_files

    path = tmp_path / "graft.sm"
    mine = [".graft.sm.0123456789ab.tmp", ".graft.sm.k3j_x9q2.tmp"]  # now, earlier versions
    others = ["graft.sm", ".graft.sm.tmp", ".graft.sm..tmp", ".graft.sm.0123456789ab.tmp~",
              ".graft.sm.ABCDEF012345.tmp", ".other.sm.0123456789ab.tmp",
              ".graft.sm.0123456789ab.tmp.keep", "graft.sm.corrupt-20250101T000000Z",
              ".xgraft.sm.0123456789ab.tmp", ".graft.smx.0123456789ab.tmp"]
    for name in mine + others:
        (tmp_path / name).write_bytes(b"x")
    assert [p.name for p in temporary_files(path)] == sorted(mine)
    assert temporary_files(tmp_path / "missing/graft.sm") == []
