"""The engine options of ``vllm-graft warmup`` / ``calibrate`` reach vLLM: the engine the
tools start is configured as the command line says (the tools used to hard-code fp32,
a 4,096-token context and 16 sequences, whatever a deployment needed)."""

from __future__ import annotations

import torch

from vllm_graft.cli.common import engine_options
from vllm_graft.cli.warmup import build_parser


def test_the_command_lines_engine_options_configure_the_engine(tiny_models):
    from vllm_graft.offline.engine import engine

    args = build_parser().parse_args([
        str(tiny_models.target), "--head", str(tiny_models.head), "--out", "unused",
        "--dtype", "bfloat16", "--max-model-len", "384", "--max-num-seqs", "3",
        "--gpu-memory-utilization", "0.5", "--tensor-parallel-size", "1"])
    with engine(str(tiny_models.target), **engine_options(args)) as llm:
        config = llm.llm_engine.vllm_config
        assert config.model_config.dtype == torch.bfloat16
        assert config.model_config.max_model_len == 384
        assert config.scheduler_config.max_num_seqs == 3
        assert config.cache_config.gpu_memory_utilization == 0.5
        assert config.parallel_config.tensor_parallel_size == 1
