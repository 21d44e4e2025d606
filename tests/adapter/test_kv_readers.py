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
