"""Every change vllm-graft makes to vLLM 0.32.0, in one ordered list.

Each entry below names the vLLM symbol it patches and why. All runner-side patches are
inert unless the engine was configured with ``"method": "graft"`` (the runner then has
a ``_graft_stats`` attribute); the front-end patches only act on Graft configs or add
Graft's own metrics. :func:`apply_all` is idempotent and runs in every vLLM process
through the general-plugin entry point.

| # | vLLM symbol | change |
|---|---|---|
| 1 | ``engine.arg_utils.EngineArgs.create_speculative_config`` | translate ``method: graft``; refuse KV transfer, watermarking, chunked local attention; asynchronous scheduling off; on GPUs piecewise CUDA graphs (or eager with ``graft.cuda_graphs: false``) |
| 2 | ``engine.arg_utils.EngineArgs.add_cli_args`` | ``--speculative-config`` takes a file |
| 2b | ``sampling_params.SamplingParams._validate_spec_decode`` | allow min_p, logit_bias; refuse thinking budgets; check Graft request fields (400) |
| 2c | ``config.VllmConfig.use_v2_model_runner`` | Graft engines use the V1 runner |
| 2d | ``entrypoints.openai.chat_completion.serving.OpenAIServingChat.create_chat_completion``, ``entrypoints.openai.completion.serving.OpenAIServingCompletion.create_completion``, ``entrypoints.openai.{chat_completion,completion}.protocol.*Request.to_sampling_params`` | the handler reads the tenant from the OpenAI ``user`` field or the HTTP header ``graft.isolation.tenant_source`` names; it rides on the request's ``SamplingParams`` (an attribute vLLM never copies or sends) |
| 2e | ``v1.engine.input_processor.InputProcessor.process_inputs`` | every request's tenant comes from the one source the operator chose (2d's, ``cache_salt`` or the Graft extra argument), written into its extra arguments for the engine; any other field's tenant is dropped |
| 3 | ``v1.worker.gpu_model_runner.GPUModelRunner.__init__`` | GraftProposer (or its draft-model / DFlash form) as drafter |
| 3b | ``v1.worker.gpu_model_runner.build_logitsprocs`` | built-in logits processors on |
| 4 | ``GPUModelRunner.initialize_kv_cache`` | start-up checks of tree attention |
| 5 | ``GPUModelRunner._update_states`` | forget finished / preempted requests |
| 6 | ``GPUModelRunner._prepare_inputs`` | tree positions + attention plan; vLLM's plain path on steps without drafts |
| 7 | ``GPUModelRunner._model_forward`` | tree plan active in the target forward; the first tree steps replayed in CUDA graphs checked against eager ones |
| 8 | ``GPUModelRunner._sample`` | lossless tree acceptance, KV move, matrix update |
| 9 | ``GPUModelRunner._input_fits_in_drafter`` | per-request fit is Graft's job |
| 10 | ``GPUModelRunner.propose_draft_token_ids`` | catch-up + tree drafting (DFlash: vLLM's block proposal, then Graft-TAIL) |
| 11 | ``GPUModelRunner.sample_tokens`` | ship Graft counters with the output; periodic successor-state save and heap trim |
| 11a | ``GPUModelRunner.execute_model`` | a step that only retires requests still ships Graft's gauges (the per-request tables drain to zero) |
| 11b | ``GPUModelRunner.shutdown`` | save the successor state (``graft.successor_state``) |
| 11c | ``v1.engine.core.EngineCoreProc._handle_shutdown`` | save the successor state when a shutdown is requested, before draining |
| 11d | ``GPUModelRunner._dummy_sampler_run`` | the start-up memory profile includes a full step of trees (logits of every tree row, their top-k, the fused step's buffers) |
| 11e | ``GPUModelRunner.capture_model`` | a failed CUDA graph capture leaves the engine eager, with one log line saying why |
| 12 | ``v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward`` (on GPUs: the ``forward`` of the attention implementation in use, patched when the KV cache is created) | tree mask |
| 13 | ``v1.core.sched.scheduler.Scheduler.update_from_output`` / ``make_stats`` | sum counters |
| 14 | ``v1.engine.EngineCoreOutputs.__annotations__`` (``scheduler_stats``) | carry counters |
| 15 | ``v1.metrics.loggers.PrometheusStatLogger.__init__`` / ``record`` | export counters |

The replacements live in :mod:`vllm_graft.vllm.replacements`, one module per vLLM area:
``engine_config`` (1-2c), ``tenants`` (2d, 2e), ``runner_lifecycle`` (3, 3b, 4, 11b,
11d, 11e), ``runner_steps`` (5-11), ``engine_shutdown`` (11c), ``attention`` (12) and
``counters`` (13-15). :func:`all_patches` below is the one list of what is patched, in
the order it is applied.

Every Graft hook of the runner (5-11) is contained (:mod:`vllm_graft.vllm.faults`): an
exception in one makes its step decode plainly, and enough failing steps in a row turn
Graft off for the engine.

Outside this list, and not through :func:`apply_all`: the benchmark's worker times the
target on one in-process CPU engine by wrapping that engine's runner instance's
``_model_forward`` and its model's ``compute_logits``
(:class:`vllm_graft.vllm.timing.TargetComputeClock`); no class is changed.
"""

from __future__ import annotations

import logging

from vllm_graft.vllm.patching import Patch

logger = logging.getLogger(__name__)


def _replace(name: str, target, attributes: dict) -> Patch:
    """A patch that replaces ``attributes`` of ``target``, every one of which must exist."""
    return Patch(name, target, attributes, must_exist=frozenset(attributes))


def all_patches() -> list[Patch]:
    """Every patch, in the order they are applied."""
    import vllm.v1.worker.gpu_model_runner as runner_module
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.sampling_params import SamplingParams
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_graft.vllm.replacements import (attention, counters, engine_config,
                                              engine_shutdown, runner_lifecycle,
                                              runner_steps, tenants)

    return [
        # 1, 2, 2b, 2c: configuration
        _replace("graft.engine_args", EngineArgs, {
            "create_speculative_config": engine_config.create_speculative_config,
            "add_cli_args": staticmethod(engine_config.add_cli_args)}),
        _replace("graft.sampling_params", SamplingParams,
                 {"_validate_spec_decode": engine_config.validate_spec_decode}),
        _replace("graft.model_runner_choice", VllmConfig,
                 {"use_v2_model_runner": property(engine_config.use_v2_model_runner)}),
        # 2d, 2e: the tenant comes from where the operator said
        *(_replace(f"graft.openai_user.{request.__name__}", request, {
            "to_sampling_params": tenants.to_sampling_params_carrying_tenant(request)})
          for request in (ChatCompletionRequest, CompletionRequest)),
        *(_replace(f"graft.openai_tenant.{handler.__name__}", handler,
                   {name: tenants.handler_reading_tenant(handler, name)})
          for handler, name in ((OpenAIServingChat, "create_chat_completion"),
                                (OpenAIServingCompletion, "create_completion"))),
        _replace("graft.request_tenant", InputProcessor,
                 {"process_inputs": tenants.process_inputs}),
        # 3-11d: the V1 model runner
        _replace("graft.runner", GPUModelRunner, {
            "__init__": runner_lifecycle.init_runner,
            "initialize_kv_cache": runner_lifecycle.initialize_kv_cache,
            "_update_states": runner_steps.update_states,
            "_prepare_inputs": runner_steps.prepare_inputs,
            "_model_forward": runner_steps.model_forward,
            "_sample": runner_steps.sample,
            "_input_fits_in_drafter": runner_steps.input_fits_in_drafter,
            "propose_draft_token_ids": runner_steps.propose_draft_token_ids,
            "sample_tokens": runner_steps.sample_tokens,
            "execute_model": runner_steps.execute_model,
            "_dummy_sampler_run": runner_lifecycle.dummy_sampler_run,
            "capture_model": runner_lifecycle.capture_model,
            "shutdown": runner_lifecycle.shutdown_runner}),
        _replace("graft.logitsprocs", runner_module,
                 {"build_logitsprocs": runner_lifecycle.build_logitsprocs}),
        # 11c: a first shutdown save, before draining
        _replace("graft.engine_shutdown", EngineCoreProc,
                 {"_handle_shutdown": engine_shutdown.handle_shutdown}),
        # 12: tree attention (on GPUs, also patched when the KV cache is created)
        attention.tree_attention_patch(CPUAttentionBackendImpl),
        # 13-15: metrics
        _replace("graft.scheduler_stats", Scheduler,
                 {"update_from_output": counters.update_from_output,
                  "make_stats": counters.make_stats}),
        _replace("graft.core_outputs", EngineCoreOutputs, {"__annotations__": {
            **EngineCoreOutputs.__annotations__, **counters.SCHEDULER_STATS_ANNOTATION}}),
        _replace("graft.prometheus", PrometheusStatLogger,
                 {"__init__": counters.prometheus_init, "record": counters.prometheus_record}),
    ]


def apply_all() -> int:
    """Apply every patch not yet applied in this process; returns how many were new."""
    applied = sum(patch.apply() for patch in all_patches())
    if applied:
        logger.info("vllm-graft: applied %d patch groups to vLLM", applied)
    return applied
