"""Addressing the paged KV cache (kernel-block splitting, slots) and the start-up
refusals of what Graft cannot serve: KV sharing, KV connectors, KV offloading,
watermarking (vLLM's V2 runner only) and chunked local attention."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from tests.vllm.conftest import graft_spec, running_llm, spec_metrics
from vllm_graft.vllm.kv_blocks import KVLayoutError, PagedKVLayout
from vllm_graft.vllm.replacements.runner_lifecycle import refuse_kv_sharing
from vllm_graft.vllm.tree_attention import _read_kv_first

HEADS, HEAD, BLOCK, KERNEL_BLOCK = 2, 8, 32, 16


def split_cache_with_writes(length: int, manager_table: torch.Tensor):
    """A FlashAttention-layout cache in manager blocks of 32, written through slots the
    way vLLM writes it, and the same memory viewed in kernel blocks of 16."""
    blocks = 6
    cache = torch.zeros(2, blocks, BLOCK, HEADS, HEAD)
    layout = PagedKVLayout(group_id=0, block_size=BLOCK, kernel_block_size=KERNEL_BLOCK)
    keys, values = torch.randn(length, HEADS, HEAD), torch.randn(length, HEADS, HEAD)
    slots = layout.slots(manager_table, torch.arange(length))
    flat = cache.view(2, blocks * BLOCK, HEADS, HEAD)
    flat[0, slots], flat[1, slots] = keys, values
    kernel_view = cache.view(2, blocks * BLOCK // KERNEL_BLOCK, KERNEL_BLOCK, HEADS, HEAD)
    return layout, kernel_view, keys, values


def test_kernel_block_table_reads_what_vllm_wrote():
    manager_table = torch.tensor([4, 1, 3, 0, 2, 5], dtype=torch.int32)
    length = 2 * BLOCK + 5  # ends inside the third manager block
    layout, kernel_view, keys, values = split_cache_with_writes(length, manager_table)
    got_k, got_v = _read_kv_first(kernel_view, layout.kernel_block_table(manager_table), length)
    assert torch.equal(got_k, keys.transpose(0, 1)) and torch.equal(got_v, values.transpose(0, 1))
    # the bug this guards against: the manager's table indexes the wrong kernel blocks
    wrong_k, _ = _read_kv_first(kernel_view, manager_table, length)
    assert not torch.equal(wrong_k, keys.transpose(0, 1))


def test_kernel_block_table_shapes():
    layout = PagedKVLayout(group_id=0, block_size=64, kernel_block_size=16)
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    assert layout.kernel_block_table(table).tolist() == [[8, 9, 10, 11, 0, 1, 2, 3],
                                                         [4, 5, 6, 7, 12, 13, 14, 15]]
    same = PagedKVLayout(group_id=0, block_size=16, kernel_block_size=16)
    assert same.kernel_block_table(table) is table
    with pytest.raises(KVLayoutError, match="not a multiple of the kernel block size 24"):
        PagedKVLayout(group_id=0, block_size=64, kernel_block_size=24)


def test_slots_follow_the_manager_blocks():
    layout = PagedKVLayout(group_id=0, block_size=16, kernel_block_size=16)
    table = torch.tensor([[5, 2]], dtype=torch.int32)
    assert layout.slots(table, torch.tensor([[0, 15, 16, 20]])).tolist() == [[80, 95, 32, 36]]


def test_kv_sharing_layers_are_refused():
    layers = {"model.layers.0.self_attn.attn": SimpleNamespace(kv_sharing_target_layer_name=None),
              "model.layers.5.self_attn.attn": SimpleNamespace(
                  kv_sharing_target_layer_name="model.layers.0.self_attn.attn")}
    with pytest.raises(ValueError, match="share another layer's KV cache: model.layers.5"):
        refuse_kv_sharing(layers)
    refuse_kv_sharing({"a": layers["model.layers.0.self_attn.attn"]})


@pytest.mark.parametrize("extra, message", [
    ({"kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}},
     "KV connectors .*ExampleConnector"),
    ({"kv_offloading_size": 4.0}, "KV offloading"),
])
def test_kv_transfer_is_refused_at_startup(tiny_models, extra, message):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(tiny_models.target), dtype="float32", enforce_eager=True,
                      speculative_config=graft_spec(tiny_models.head, budget=8), **extra)
    with pytest.raises(ValueError, match=message):
        args.create_engine_config()


def test_watermarking_is_refused_at_startup(tiny_models):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(tiny_models.target), dtype="float32", enforce_eager=True,
                      speculative_config=graft_spec(tiny_models.head, budget=8),
                      watermark_config={"key": 7})
    with pytest.raises(ValueError, match="does not support watermarking"):
        args.create_engine_config()


def test_chunked_local_attention_is_refused_at_startup(tiny_models, tmp_path):
    """Llama 4's chunked local attention is applied by vLLM's metadata builder, which
    tree rows bypass: refused before the engine is built."""
    import json
    import shutil

    from vllm.engine.arg_utils import EngineArgs

    model = tmp_path / "chunked"
    shutil.copytree(tiny_models.target, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "attention_chunk_size": 64}))
    args = EngineArgs(model=str(model), dtype="float32", enforce_eager=True,
                      speculative_config=graft_spec(tiny_models.head, budget=8))
    with pytest.raises(ValueError, match="chunked local attention .*64"):
        args.create_engine_config()


def test_changed_engine_settings_are_logged(tiny_models, caplog):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(tiny_models.target), dtype="float32", enforce_eager=True,
                      async_scheduling=True,
                      speculative_config=graft_spec(tiny_models.head, budget=8))
    with caplog.at_level(logging.WARNING, logger="vllm_graft"):
        config = args.create_engine_config()
    assert config.scheduler_config.async_scheduling is False
    assert "asynchronous scheduling turned off" in caplog.text


def _reader_name(worker) -> str:
    from vllm_graft.vllm.tree_attention import kv_reader

    runner = worker.model_runner
    layer = next(layer for layer in runner.compilation_config.static_forward_context.values()
                 if isinstance(getattr(layer, "kv_cache", None), torch.Tensor))
    reader = kv_reader(layer.impl, layer, layer.kv_cache)
    return getattr(reader, "__name__", type(reader).__name__)


def test_a_bf16_engine_reads_its_cache_whatever_the_cpu_kernels_pack(tiny_models):
    """In bf16 vLLM's CPU backend packs its cache for the CPU's matrix units where it has
    them (AMX), in a layout no reader describes: the layout is probed at start-up, and
    trees are verified (bf16 output equals plain decoding's up to rounding)."""
    from vllm import SamplingParams

    with running_llm(tiny_models.target, graft_spec(tiny_models.head, budget=60),
                     dtype="bfloat16", max_num_seqs=4) as llm:
        outputs = llm.generate(["def fibonacci(n):\n", "for i in range(10):\n"],
                               SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                               use_tqdm=False)
        reader = llm.collective_rpc(_reader_name)[0]
        metrics = spec_metrics(llm)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outputs)
    assert metrics["graft_verified_trees"] > 0, metrics
    assert reader in ("_read_cpu", "ProbedLayout"), reader
