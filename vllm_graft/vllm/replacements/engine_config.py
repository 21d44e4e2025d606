"""Patches 1-2c: what a Graft engine configuration turns into, and what it refuses.

1 translates ``"method": "graft"`` into the EAGLE-3 config vLLM knows (plus Graft's
settings in the ``additional_config``) and refuses what tree verification cannot serve;
2 lets ``--speculative-config`` take a file; 2b validates requests of Graft engines
(Graft samples every tree node with the full sampler); 2c keeps Graft engines on the V1
model runner, where tree verification lives."""

from __future__ import annotations

import argparse
import logging

from vllm.config import CUDAGraphMode, VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams

from vllm_graft.vllm.config import (ADDITIONAL_CONFIG_KEY, TokenizerRef, is_graft_spec,
                                    load_speculative_config_arg,
                                    translate_speculative_config)
from vllm_graft.vllm.patching import Patch, call_original
from vllm_graft.vllm.replacements.engine_shutdown import keep_shutdown_grace
from vllm_graft.vllm.replacements.tenants import validate_graft_request_fields

logger = logging.getLogger(__name__)

#: set on the SpeculativeConfig of a Graft engine (it says ``eagle3`` to vLLM)
GRAFT_MARKER = "graft_enabled"
#: set beside it: the request extra argument that names a request's tenant
TENANT_FIELD_ATTR = "graft_tenant_field"

_V1_RUNNER_LOGGED: list[bool] = []


def refuse_watermarking(engine_args) -> None:
    """vLLM 0.32 watermarks only in its V2 model runner; Graft's tree verification lives
    in the V1 runner, where every watermarked request would fail (or, with its draft
    sampling changed, be served unwatermarked)."""
    if getattr(engine_args, "watermark_config", None) is not None:
        raise ValueError("Graft does not support watermarking (watermark_config is set): "
                         "vLLM watermarks only in its V2 model runner, and Graft's tree "
                         "verification runs in the V1 runner")


def refuse_chunked_local_attention(model_config) -> None:
    """Chunked local attention (Llama 4's ``attention_chunk_size``) limits a query to
    its chunk in vLLM's metadata builder, not in the attention implementation: tree rows
    would see the whole prefix, and past the first chunk their logits differ from plain
    decoding's."""
    chunk = getattr(model_config, "attention_chunk_size", None)
    if chunk:
        raise ValueError(f"Graft does not support chunked local attention "
                         f"(attention_chunk_size {chunk}): its tree rows attend to the "
                         f"whole prefix")


def refuse_kv_transfer(engine_args) -> None:
    """KV connectors and KV offloading save a step's K/V when the forward ends, before
    Graft moves the accepted tree path into place: they would store rejected rows."""
    transfer = engine_args.kv_transfer_config
    if isinstance(transfer, dict):
        connector = transfer.get("kv_connector")
    else:
        connector = getattr(transfer, "kv_connector", None)
    if connector:
        raise ValueError(f"Graft does not support KV connectors (kv_transfer_config "
                         f"names {connector!r}): they would save K/V of rejected tree rows")
    if getattr(engine_args, "kv_offloading_size", None):
        raise ValueError("Graft does not support KV offloading (kv_offloading_size is "
                         f"{engine_args.kv_offloading_size}): offloaded blocks would hold "
                         "K/V of rejected tree rows")


def choose_cuda_graphs(engine_args, target_model_config, wanted: bool) -> None:
    """On GPUs, the target runs under piecewise CUDA graphs (tree attention runs eagerly
    between the captured pieces; full graphs would hold a step's attention, tree plan
    and all), checked at the first tree steps (:mod:`vllm_graft.vllm.graph_check`), or
    eagerly when ``graft.cuda_graphs`` is false. The CPU keeps its own settings."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() or engine_args.enforce_eager:
        return
    if not wanted:
        logger.warning("Graft: eager mode (graft.cuda_graphs is false): no CUDA graphs")
        engine_args.enforce_eager = True
        target_model_config.enforce_eager = True
        return
    compilation = engine_args.compilation_config
    mode = compilation.cudagraph_mode
    if mode is not None and mode == CUDAGraphMode.NONE:
        return
    if mode is not None and mode != CUDAGraphMode.PIECEWISE:
        logger.warning("Graft: cudagraph_mode %s becomes PIECEWISE (tree attention runs "
                       "between the captured pieces)", mode.name)
    compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE



def create_speculative_config(self, target_model_config, target_parallel_config):
    """1: ``EngineArgs.create_speculative_config``; a Graft spec becomes vLLM's EAGLE-3
    config, marked as Graft's, with the engine settings tree verification needs."""
    spec = self.speculative_config
    if isinstance(spec, dict):
        spec = {k.replace("-", "_"): v for k, v in spec.items()}
    if is_graft_spec(spec):
        refuse_kv_transfer(self)
        refuse_watermarking(self)
        refuse_chunked_local_attention(target_model_config)
        eagle_spec, settings = translate_speculative_config(
            spec, target_model=target_model_config.model,
            target_vocab_size=target_model_config.get_vocab_size(),
            target_tokenizer=TokenizerRef.of(target_model_config))
        self.speculative_config = eagle_spec
        self.additional_config = {**(self.additional_config or {}),
                                  ADDITIONAL_CONFIG_KEY: settings}
        # Tree verification needs synchronous steps. The V1 runner is chosen by the
        # VllmConfig patch (2c).
        if self.async_scheduling:
            logger.warning("Graft: asynchronous scheduling turned off (tree "
                           "verification needs each step's result before the next)")
        self.async_scheduling = False
        if "successor_state" in settings:
            keep_shutdown_grace(self)
        choose_cuda_graphs(self, target_model_config, settings.get("cuda_graphs", True))
    config = call_original(EngineArgs, "create_speculative_config")(
        self, target_model_config, target_parallel_config)
    graft = (self.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    if config is not None and graft is not None:
        tenant_field = graft["isolation"]["tenant_field"]
        object.__setattr__(config, GRAFT_MARKER, True)
        object.__setattr__(config, TENANT_FIELD_ATTR, tenant_field)
    return config


def _spec_config_type(value: str):
    try:
        return load_speculative_config_arg(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_cli_args(parser, *args, **kwargs):
    """2: ``EngineArgs.add_cli_args`` (a static method); ``--speculative-config`` also
    takes a file."""
    original = Patch.original(EngineArgs, "add_cli_args")
    original = original.__func__ if isinstance(original, staticmethod) else original
    parser = original(parser, *args, **kwargs)
    for action in parser._actions:
        if "--speculative-config" in action.option_strings:
            action.type = _spec_config_type
    return parser


def validate_spec_decode(self, speculative_config):
    """2b: ``SamplingParams._validate_spec_decode``. vLLM refuses min_p and logit_bias
    because its chain rejection sampler skips them at draft positions; Graft samples
    every tree node with the full sampler. Graft's own request fields are checked."""
    if getattr(speculative_config, GRAFT_MARKER, False):
        validate_graft_request_fields(self.extra_args,
                                      getattr(speculative_config, TENANT_FIELD_ATTR))
        if self.thinking_token_budget is not None:
            # vLLM's thinking-budget forcing assumes one sampler row per draft token
            raise VLLMValidationError(
                "thinking_token_budget is not supported with Graft speculative "
                "decoding", parameter="thinking_token_budget",
                value=self.thinking_token_budget)
        return
    return call_original(SamplingParams, "_validate_spec_decode")(self, speculative_config)


def use_v2_model_runner(self):
    """2c: the getter of ``VllmConfig.use_v2_model_runner``; False for Graft engines
    (tree verification lives in the V1 model runner)."""
    if (self.additional_config or {}).get(ADDITIONAL_CONFIG_KEY) is not None:
        if not _V1_RUNNER_LOGGED:
            logger.info("Graft: using vLLM's V1 model runner (tree verification "
                        "lives there)")
            _V1_RUNNER_LOGGED.append(True)
        return False
    return call_original(VllmConfig, "use_v2_model_runner").fget(self)
