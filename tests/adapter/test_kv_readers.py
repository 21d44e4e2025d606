"""The paged-KV readers of tree attention against the layouts they describe, and the
start-up detection that must refuse a layout none of them reads."""

import pytest
import torch

from vllm_graft.vllm import tree_attention as ta


class _Layer:
    num_kv_heads, head_size, layer_name = 2, 8, "toy"


class _WriterNHD:
    """Writes like a [blocks, heads, block, 2 * head] cache with K and V side by side."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slots):
        block = kv_cache.shape[2]
        for i, slot in enumerate(slots.tolist()):
            kv_cache[slot // block, :, slot % block, :8] = key[i]
            kv_cache[slot // block, :, slot % block, 8:] = value[i]


class _WriterKVFirst:
    def do_kv_cache_update(self, layer, key, value, kv_cache, slots):
        block = kv_cache.shape[2]
        for i, slot in enumerate(slots.tolist()):
            kv_cache[0, slot // block, slot % block] = key[i]
            kv_cache[1, slot // block, slot % block] = value[i]


class _WriterScrambled:
    def do_kv_cache_update(self, layer, key, value, kv_cache, slots):
        kv_cache.normal_()


@pytest.mark.parametrize("writer, shape, reader", [
    (_WriterNHD(), (6, 2, 16, 16), ta._read_heads_kv_last),
    (_WriterKVFirst(), (2, 6, 16, 2, 8), ta._read_kv_first),
])
def test_detection_picks_the_matching_reader(writer, shape, reader):
    cache = torch.zeros(shape)
    assert ta.kv_reader(writer, _Layer(), cache) is reader
    # and the reader reads a real request across a block boundary
    keys, values = torch.randn(20, 2, 8), torch.randn(20, 2, 8)
    table = torch.tensor([4, 1], dtype=torch.int32)
    slots = torch.cat([torch.arange(16) + 64, torch.arange(4) + 16])
    writer.do_kv_cache_update(_Layer(), keys, values, cache, slots)
    k, v = reader(cache, table, 20)
    assert torch.equal(k, keys.transpose(0, 1)) and torch.equal(v, values.transpose(0, 1))


def test_an_unknown_layout_is_refused():
    with pytest.raises(ta.TreeAttentionError, match="cannot read the paged KV cache"):
        ta.kv_reader(_WriterScrambled(), _Layer(), torch.zeros(6, 2, 16, 16))


def _cpu_layout_cache(keys, values, slots, blocks=6, block=16):
    """The CPU backend's layout written by hand: per (block, head), K transposed then V."""
    heads, head = keys.shape[1], keys.shape[2]
    cache = torch.zeros(blocks, heads, block, 2 * head)
    flat = cache.view(blocks, heads, 2, block * head)
    for i, slot in enumerate(slots.tolist()):
        b, o = divmod(slot, block)
        flat[b, :, 0].view(heads, head, block)[:, :, o] = keys[i]
        flat[b, :, 1].view(heads, block, head)[:, o] = values[i]
    return cache


@pytest.mark.parametrize("layout", ["cpu", "heads_kv_last", "kv_first", "kv_second"])
def test_slot_readers_read_what_was_written(layout):
    generator = torch.Generator().manual_seed(2)
    keys, values = torch.randn(9, 2, 8, generator=generator), torch.randn(9, 2, 8, generator=generator)
    slots = torch.tensor([70, 3, 16, 95, 17, 0, 64, 31, 48])
    if layout == "cpu":
        cache, reader = _cpu_layout_cache(keys, values, slots), ta._read_cpu
    elif layout == "heads_kv_last":
        cache, reader = torch.zeros(6, 2, 16, 16), ta._read_heads_kv_last
        _WriterNHD().do_kv_cache_update(_Layer(), keys, values, cache, slots)
    elif layout == "kv_first":
        cache, reader = torch.zeros(2, 6, 16, 2, 8), ta._read_kv_first
        _WriterKVFirst().do_kv_cache_update(_Layer(), keys, values, cache, slots)
    else:
        cache, reader = torch.zeros(6, 2, 16, 2, 8), ta._read_kv_second
        for i, slot in enumerate(slots.tolist()):
            cache[slot // 16, 0, slot % 16], cache[slot // 16, 1, slot % 16] = keys[i], values[i]
    order = torch.tensor([3, 0, 8, 5])
    got_k, got_v = ta.read_slots(reader, cache, slots[order])
    assert torch.equal(got_k, keys[order]) and torch.equal(got_v, values[order])
    # the sequence readers agree with the slot readers on a request's positions
    table = torch.tensor([1, 0], dtype=torch.int32)
    seq_k, seq_v = reader(cache, table, 20)
    positions = torch.tensor([0, 5, 16, 19])
    by_slot_k, by_slot_v = ta.read_slots(reader, cache, table[positions // 16] * 16 + positions % 16)
    assert torch.equal(seq_k[:, positions].transpose(0, 1), by_slot_k)
    assert torch.equal(seq_v[:, positions].transpose(0, 1), by_slot_v)


class _WriterPacked:
    """A layout none of the known readers reads, as vLLM's CPU backend with its AMX kernels
    packs a block: per (block, head), K in pairs of dimensions interleaved over the
    block's positions (``[head / 2, block, 2]``), then V position-major."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slots):
        blocks, heads, block, two_head = kv_cache.shape
        head = two_head // 2
        flat = kv_cache.view(blocks, heads, 2, block * head)
        for i, slot in enumerate(slots.tolist()):
            b, o = divmod(slot, block)
            packed = flat[b, :, 0].view(heads, head // 2, block, 2)
            packed[:, :, o, :] = key[i].view(heads, head // 2, 2)
            flat[b, :, 1].view(heads, block, head)[:, o] = value[i]


class _WriterLossy:
    """Writes V over K: no reader can read it back."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slots):
        block = kv_cache.shape[2]
        for i, slot in enumerate(slots.tolist()):
            kv_cache[slot // block, :, slot % block, :8] = value[i]
            kv_cache[slot // block, :, slot % block, 8:] = value[i]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_unknown_packed_layout_is_probed_and_read_exactly(dtype):
    writer, cache = _WriterPacked(), torch.zeros(6, 2, 16, 16, dtype=dtype)
    reader = ta.kv_reader(writer, _Layer(), cache)
    assert isinstance(reader, ta.ProbedLayout)
    generator = torch.Generator().manual_seed(4)
    keys = torch.randn(20, 2, 8, generator=generator).to(dtype)
    values = torch.randn(20, 2, 8, generator=generator).to(dtype)
    table = torch.tensor([4, 1], dtype=torch.int32)
    slots = torch.cat([torch.arange(16) + 64, torch.arange(4) + 16])
    writer.do_kv_cache_update(_Layer(), keys, values, cache, slots)
    k, v = reader(cache, table, 20)
    assert torch.equal(k, keys.transpose(0, 1)) and torch.equal(v, values.transpose(0, 1))
    picked = torch.tensor([19, 0, 16, 5])
    slot_k, slot_v = ta.read_slots(reader, cache, slots[picked])
    assert torch.equal(slot_k, keys[picked]) and torch.equal(slot_v, values[picked])


def test_a_layout_that_loses_elements_is_refused_even_by_the_probe():
    with pytest.raises(ta.TreeAttentionError, match="cannot read the paged KV cache"):
        ta.kv_reader(_WriterLossy(), _Layer(), torch.zeros(6, 2, 16, 16))
