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
| 11b | ``GPUModelRunner.shutdown`` | save the successor state (``graft.successor_state``) |
| 11c | ``v1.engine.core.EngineCoreProc._handle_shutdown`` | save the successor state when a shutdown is requested, before draining |
| 11d | ``GPUModelRunner._dummy_sampler_run`` | the start-up memory profile includes a full step of trees (logits of every tree row, their top-k, the fused step's buffers) |
| 12 | ``v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward`` (on GPUs: the ``forward`` of the attention implementation in use, patched when the KV cache is created) | tree mask |
| 13 | ``v1.core.sched.scheduler.Scheduler.update_from_output`` / ``make_stats`` | sum counters |
| 14 | ``v1.engine.EngineCoreOutputs.__annotations__`` (``scheduler_stats``) | carry counters |
| 15 | ``v1.metrics.loggers.PrometheusStatLogger.__init__`` / ``record`` | export counters |

Every Graft hook of the runner (5-11) is contained (:mod:`vllm_graft.vllm.faults`): an
exception in one makes its step decode plainly, and enough failing steps in a row turn
Graft off for the engine.

Outside this list, and not through :func:`apply_all`: the benchmark's worker times the
target on one in-process CPU engine by wrapping that engine's runner instance's
``_model_forward`` and its model's ``compute_logits``
(:class:`vllm_graft.vllm.timing.TargetComputeClock`); no class is changed.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import logging
from collections import Counter

from vllm_graft.core.config import StepMode
from vllm_graft.vllm.patching import Patch, call_original

logger = logging.getLogger(__name__)

#: set on the SpeculativeConfig of a Graft engine (it says ``eagle3`` to vLLM)
GRAFT_MARKER = "graft_enabled"
#: set beside it: the request extra argument that names a request's tenant
TENANT_FIELD_ATTR = "graft_tenant_field"
GRAFT_REQUEST_PREFIX = "graft_"
MAX_TENANT_LENGTH = 256
#: the attribute of a ``SamplingParams`` holding the tenant an OpenAI handler read (2d):
#: an instance attribute, which vLLM neither copies nor sends, so no client can set it
FRONT_END_TENANT_ATTR = "_graft_front_end_tenant"
#: while an OpenAI handler runs (2d): the tenant it read for its request
_HANDLER_TENANT: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "graft_handler_tenant", default=None)


def tenant_name(value: str | None) -> str | None:
    """The tenant a user field, header or cache salt names: none when empty or absent,
    the SHA-256 of one too long for a tenant field (any value the API accepts stays a
    valid request)."""
    if not value:
        return None
    if len(value) > MAX_TENANT_LENGTH:
        import hashlib

        return "sha256:" + hashlib.sha256(value.encode()).hexdigest()
    return value


def graft_isolation(vllm_config) -> dict | None:
    """The ``graft.isolation`` settings of a Graft engine's config; None for others."""
    from vllm_graft.vllm.config import ADDITIONAL_CONFIG_KEY

    additional = getattr(vllm_config, "additional_config", None) or {}
    graft = additional.get(ADDITIONAL_CONFIG_KEY) if isinstance(additional, dict) else None
    return None if graft is None else graft["isolation"]


def handler_tenant(source: str, user: str | None, headers) -> str | None:
    """The tenant an OpenAI handler reads for its request under ``tenant_source``: the
    ``user`` field, or the named header (``headers``: the HTTP request's, None outside
    HTTP), which must come once; None for the other sources (read by 2e)."""
    from vllm.exceptions import VLLMValidationError

    if source == "user":
        return tenant_name(user)
    kind, _, name = source.partition(":")
    if kind != "header" or headers is None:
        return None
    values = headers.getlist(name)
    if len(values) > 1:
        raise VLLMValidationError(
            f"the header {name} names this request's tenant (graft.isolation."
            f"tenant_source) and must come once, got it {len(values)} times",
            parameter=name)
    return tenant_name(values[0]) if values else None


def request_tenant(isolation: dict, extra_args: dict | None, cache_salt: str | None,
                   handler: str | None) -> str | None:
    """A request's tenant, from the one source the operator chose: the Graft extra
    argument, the request's ``cache_salt``, or what the OpenAI handler read (the ``user``
    field or a header; None outside the OpenAI handlers). Nothing else counts."""
    source = isolation["tenant_source"]
    if source == "extra":
        tenant = (extra_args or {}).get(isolation["tenant_field"])
        return None if tenant is None else str(tenant)
    if source == "cache_salt":
        return tenant_name(cache_salt)
    return handler


def with_tenant(extra_args: dict | None, field: str, tenant: str | None) -> dict | None:
    """``extra_args`` (a new dict) whose ``field`` holds ``tenant``, or lacks it."""
    extra = {k: v for k, v in (extra_args or {}).items() if k != field}
    if tenant is not None:
        extra[field] = tenant
    return extra or None


def validate_graft_request_fields(extra_args: dict | None, tenant_field: str) -> None:
    """A request's Graft fields (its extra arguments named ``graft_*``): only the tenant
    field exists, and it holds a short non-empty string. Checked in the front end,
    so a bad request gets a 400 and never reaches the engine."""
    from vllm.exceptions import VLLMValidationError

    for key, value in (extra_args or {}).items():
        if not key.startswith(GRAFT_REQUEST_PREFIX):
            continue
        if key != tenant_field:
            raise VLLMValidationError(f"unknown Graft request field {key!r} (Graft reads "
                                      f"{tenant_field!r} only)", parameter=key, value=value)
        if not isinstance(value, str) or not 1 <= len(value) <= MAX_TENANT_LENGTH:
            raise VLLMValidationError(
                f"{key} must be a non-empty string of at most {MAX_TENANT_LENGTH} "
                f"characters", parameter=key, value=value)


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


def refuse_kv_sharing(layers: dict) -> None:
    """Layers that reuse another layer's KV cache (``kv_sharing_target_layer_name``) get
    no K/V written for their own rows, so Graft's KV move would skip them."""
    sharing = sorted(name for name, layer in layers.items()
                     if getattr(layer, "kv_sharing_target_layer_name", None))
    if sharing:
        raise ValueError(f"Graft does not support layers that share another layer's KV "
                         f"cache: {', '.join(sharing[:4])}{' ...' if len(sharing) > 4 else ''}")


#: seconds vLLM lets the engine process shut down when Graft saves state at shutdown
STATE_SAVE_SHUTDOWN_S = 10
#: the ``reason`` of the save made when a shutdown is requested (before draining)
SHUTDOWN_REQUESTED_REASON = "shutdown requested"


def choose_cuda_graphs(engine_args, target_model_config, wanted: bool) -> None:
    """On GPUs, the target runs under piecewise CUDA graphs (tree attention runs eagerly
    between the captured pieces; full graphs would hold a step's attention, tree plan
    and all), checked at the first tree steps (:mod:`vllm_graft.vllm.graph_check`), or
    eagerly when ``graft.cuda_graphs`` is false. The CPU keeps its own settings."""
    from vllm.config import CUDAGraphMode
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


def keep_shutdown_grace(engine_args) -> None:
    """vLLM's ``--shutdown-timeout 0`` (its default, and indistinguishable from an
    explicit 0) kills the engine process right after SIGTERM, before the model runner's
    shutdown could save the successor state. With ``graft.successor_state`` it becomes
    a few seconds. That one budget covers draining in-flight requests and tearing the
    engine down: when draining takes all of it the engine is killed before the runner's
    final save, and the save made when SIGTERM arrived (11c) is what survives."""
    if not getattr(engine_args, "shutdown_timeout", None):
        logger.warning("Graft: --shutdown-timeout %d s, so that the successor state is saved "
                       "at shutdown", STATE_SAVE_SHUTDOWN_S)
        engine_args.shutdown_timeout = STATE_SAVE_SHUTDOWN_S


# ---- 1, 2: configuration ----------------------------------------------------------------
def _patch_engine_args() -> list[Patch]:
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    from vllm_graft.vllm.config import (ADDITIONAL_CONFIG_KEY, TokenizerRef, is_graft_spec,
                                        load_speculative_config_arg,
                                        translate_speculative_config)

    def create_speculative_config(self, target_model_config, target_parallel_config):
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
            # VllmConfig patch below.
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

    def spec_config_type(value: str):
        try:
            return load_speculative_config_arg(value)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    def add_cli_args(parser, *args, **kwargs):
        original = Patch.original(EngineArgs, "add_cli_args")
        original = original.__func__ if isinstance(original, staticmethod) else original
        parser = original(parser, *args, **kwargs)
        for action in parser._actions:
            if "--speculative-config" in action.option_strings:
                action.type = spec_config_type
        return parser

    def _validate_spec_decode(self, speculative_config):
        # vLLM refuses min_p and logit_bias because its chain rejection sampler skips
        # them at draft positions; Graft samples every tree node with the full sampler.
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
        # Graft's tree verification lives in the V1 model runner
        if (self.additional_config or {}).get(ADDITIONAL_CONFIG_KEY) is not None:
            if not _V1_RUNNER_LOGGED:
                logger.info("Graft: using vLLM's V1 model runner (tree verification "
                            "lives there)")
                _V1_RUNNER_LOGGED.append(True)
            return False
        return call_original(VllmConfig, "use_v2_model_runner").fget(self)

    return [
        Patch("graft.engine_args", EngineArgs, {
            "create_speculative_config": create_speculative_config,
            "add_cli_args": staticmethod(add_cli_args),
        }, must_exist=frozenset({"create_speculative_config", "add_cli_args"})),
        Patch("graft.sampling_params", SamplingParams,
              {"_validate_spec_decode": _validate_spec_decode},
              must_exist=frozenset({"_validate_spec_decode"})),
        Patch("graft.model_runner_choice", VllmConfig,
              {"use_v2_model_runner": property(use_v2_model_runner)},
              must_exist=frozenset({"use_v2_model_runner"})),
    ]


# ---- 2d, 2e: the tenant comes from where the operator said -----------------------------
def _patch_openai_user() -> list[Patch]:
    """2d: the chat and completion handlers read the tenant from the ``user`` field or
    a header (as ``graft.isolation.tenant_source`` says) while they build the request's
    ``SamplingParams``, which carry it to 2e. 2e: where every request of every entry
    point (and of the offline ``LLM``) becomes an engine request, its tenant field is
    set from the chosen source only."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    def wrap_request(cls):
        def to_sampling_params(self, *args, **kwargs):
            params = call_original(cls, "to_sampling_params")(self, *args, **kwargs)
            tenant = _HANDLER_TENANT.get()
            if tenant is not None:
                setattr(params, FRONT_END_TENANT_ATTR, tenant)
            return params

        return Patch(f"graft.openai_user.{cls.__name__}", cls,
                     {"to_sampling_params": to_sampling_params},
                     must_exist=frozenset({"to_sampling_params"}))

    def wrap_handler(cls, name: str):
        async def handler(self, request, raw_request=None, *args, **kwargs):
            original = call_original(cls, name)
            engine = getattr(self, "engine_client", None)
            isolation = graft_isolation(getattr(engine, "vllm_config", None))
            if isolation is None:
                return await original(self, request, raw_request, *args, **kwargs)
            try:
                tenant = handler_tenant(isolation["tenant_source"],
                                        getattr(request, "user", None),
                                        None if raw_request is None else raw_request.headers)
            except VLLMValidationError as err:
                return self.create_error_response(err)
            token = _HANDLER_TENANT.set(tenant)
            try:
                return await original(self, request, raw_request, *args, **kwargs)
            finally:
                _HANDLER_TENANT.reset(token)

        return Patch(f"graft.openai_tenant.{cls.__name__}", cls, {name: handler},
                     must_exist=frozenset({name}))

    def process_inputs(self, request_id, prompt, params, *args, **kwargs):
        request = call_original(InputProcessor, "process_inputs")(
            self, request_id, prompt, params, *args, **kwargs)
        isolation = graft_isolation(self.vllm_config)
        sampling = request.sampling_params
        if isolation is not None and sampling is not None:
            tenant = request_tenant(isolation, sampling.extra_args, request.cache_salt,
                                    getattr(params, FRONT_END_TENANT_ATTR, None))
            sampling.extra_args = with_tenant(sampling.extra_args, isolation["tenant_field"],
                                              tenant)
        return request

    return [wrap_request(ChatCompletionRequest), wrap_request(CompletionRequest),
            wrap_handler(OpenAIServingChat, "create_chat_completion"),
            wrap_handler(OpenAIServingCompletion, "create_completion"),
            Patch("graft.request_tenant", InputProcessor, {"process_inputs": process_inputs},
                  must_exist=frozenset({"process_inputs"}))]


# ---- 3-11: the V1 model runner ----------------------------------------------------------
def takes_plain_path(runner, scheduler_output) -> bool:
    """Whether a Graft runner's step may take vLLM's path without speculation: the
    throughput guard decodes plainly and no request carries drafts, so the step has
    nothing to verify and nothing to teach the successor matrix (Graft's sampling
    would call vLLM's sampler on the same rows). vLLM 0.32 otherwise computes
    speculative metadata every step (per-request draft counts, logits indices, a device
    copy) only to sample one row per request, as its plain path does. Models with
    recurrent layers keep the speculative path: their attention metadata reads the
    draft counts that path writes."""
    from vllm_graft.vllm.proposal import last_proposal

    return (last_proposal(runner).mode is StepMode.PLAIN
            and not scheduler_output.scheduled_spec_decode_tokens
            and not runner.model_config.is_hybrid)


@contextlib.contextmanager
def speculation_hidden(runner):
    """``runner.speculative_config`` reads None inside the block: vLLM's
    ``_prepare_inputs`` tests it once, to choose between its speculative path and the
    plain one (its source is fingerprinted). The step's sampling then gets no
    speculative metadata, and vLLM's own sampler samples it (patch 8 passes it on)."""
    config = runner.speculative_config
    runner.speculative_config = None
    try:
        yield
    finally:
        runner.speculative_config = config


def _patch_runner() -> list[Patch]:
    import vllm.v1.worker.gpu_model_runner as runner_module
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_graft.vllm import runner as graft_runner
    from vllm_graft.vllm.config import ADDITIONAL_CONFIG_KEY, cuda_graphs_enabled
    from vllm_graft.vllm.faults import FaultContainment
    from vllm_graft.vllm.graph_check import ReplayCheck
    from vllm_graft.vllm.proposer import (GraftDFlashProposer, GraftDraftModelProposer,
                                          GraftProposer)
    from vllm_graft.vllm.kv_blocks import PagedKVLayout
    from vllm_graft.vllm.timing import SpanTimer
    from vllm_graft.vllm.tree_attention import active_plan, check_impl_supported, kv_reader

    import torch

    cls = GPUModelRunner

    def on(self) -> bool:
        return getattr(self, "_graft_stats", None) is not None

    def __init__(self, vllm_config, device, *args, **kwargs):
        call_original(cls, "__init__")(self, vllm_config, device, *args, **kwargs)
        self._graft_stats = None
        self._graft_step = None
        self._graft_graph_check = None
        self._graft_proposal = None  # the last drafting round's (vllm_graft.vllm.proposal)
        if (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY) is None:
            return
        if vllm_config.model_config.uses_mrope:
            raise ValueError("Graft does not support M-RoPE models")
        parallel = vllm_config.parallel_config
        if (parallel.pipeline_parallel_size > 1 or parallel.decode_context_parallel_size > 1
                or parallel.use_ubatching):
            raise ValueError("Graft supports tensor parallelism only (no pipeline "
                             "parallelism, decode context parallelism or micro-batching)")
        proposer = {"draft_model": GraftDraftModelProposer, "dflash": GraftDFlashProposer}.get(
            vllm_config.speculative_config.method, GraftProposer)
        self.drafter = proposer(self.vllm_config, self.device, self)
        self._graft_stats = graft_runner.GraftStats()
        self._graft_faults = FaultContainment(
            self.drafter.settings.config.max_consecutive_errors)
        if cuda_graphs_enabled(vllm_config):
            self._graft_graph_check = ReplayCheck()

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        out = call_original(cls, "initialize_kv_cache")(self, kv_cache_config, *args, **kwargs)
        if on(self):
            self._graft_kv_layout = PagedKVLayout.from_runner(self)
            layers = self.compilation_config.static_forward_context
            refuse_kv_sharing(layers)
            for name, layer in layers.items():
                impl = getattr(layer, "impl", None)
                kv_cache = getattr(layer, "kv_cache", None)
                if impl is None or not isinstance(kv_cache, torch.Tensor):
                    continue
                if not hasattr(impl, "do_kv_cache_update"):
                    raise ValueError(f"Graft needs an attention backend with a separate KV "
                                     f"cache update; {type(impl).__name__} has none")
                check_impl_supported(impl)
                kv_reader(impl, layer, kv_cache)  # refuses a layout it cannot read
                tree_attention_patch(type(impl)).apply()
            if self.drafter.auto_size:
                from vllm_graft.core.budget import (AcceptanceModel, ChainScout,
                                                    ThroughputGuard, TreeSizer)
                from vllm_graft.core.config import StepMode
                from vllm_graft.vllm.cost_profile import load_or_measure

                acceptance, chain_acceptance = AcceptanceModel(), AcceptanceModel()
                calibration = self.drafter.settings.calibration
                if calibration is not None and calibration.acceptance is not None:
                    acceptance.seed(calibration.acceptance)
                if calibration is not None and calibration.chain_acceptance is not None:
                    chain_acceptance.seed(calibration.chain_acceptance)
                self.drafter.sizer = TreeSizer(load_or_measure(self), acceptance,
                                               chain_acceptance)
                config = self.drafter.settings.config
                if config.auto_guard:
                    self.drafter.guard = ThroughputGuard(modes=config.guard_modes)
                    scouts = {StepMode.CHAIN, StepMode.PLAIN} <= set(config.guard_modes)
                    if scouts and config.chain_scout_every:
                        self.drafter.scout = ChainScout(every=config.chain_scout_every)
        return out

    def _update_states(self, scheduler_output, *args, **kwargs):
        if on(self):
            finished = set(scheduler_output.finished_req_ids)
            try:
                self._graft_faults.inject("forget")
                self.drafter.forget(finished | set(scheduler_output.preempted_req_ids or ()),
                                    finished=finished)
            except Exception as error:  # what was not forgotten costs memory, not tokens
                self._graft_faults.failed("forget", error, self._graft_stats)
        return call_original(cls, "_update_states")(self, scheduler_output, *args, **kwargs)

    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        original = call_original(cls, "_prepare_inputs")
        if on(self) and takes_plain_path(self, scheduler_output):
            with speculation_hidden(self):
                out = original(self, scheduler_output, *args, **kwargs)
        else:
            out = original(self, scheduler_output, *args, **kwargs)
        if on(self):
            try:
                self._graft_faults.inject("prepare")
                step = graft_runner.prepare_tree_verification(self, scheduler_output)
            except Exception as error:
                self._graft_faults.failed("prepare", error, self._graft_stats)
                step = graft_runner.GraftStep(trees=[], plan=None, failed=True)
            step.num_tokens = scheduler_output.total_num_scheduled_tokens
            self._graft_step = step
        return out

    def _model_forward(self, *args, **kwargs):
        step = self._graft_step if on(self) else None
        sizer = self.drafter.sizer if step is not None else None
        if step is None or (step.plan is None and sizer is None):
            return call_original(cls, "_model_forward")(self, *args, **kwargs)
        # with budget "auto", timed without waiting for the device: read after the
        # proposal's device clock
        step.forward_timer = None if sizer is None else SpanTimer(self.device)
        timed = contextlib.nullcontext() if sizer is None else step.forward_timer.span()
        forward = call_original(cls, "_model_forward")
        try:
            with active_plan(step.plan), timed:
                if step.plan is not None:
                    self._graft_faults.inject("forward")
                check = self._graft_graph_check
                if step.plan is not None and check is not None and check.due():
                    return check.run(self, lambda: forward(self, *args, **kwargs),
                                     step.num_tokens)
                return forward(self, *args, **kwargs)
        except Exception as error:
            if step.plan is None:  # not Graft's: the plain forward itself failed
                raise
            # the tree attention failed: the forward again, causally; the roots' rows
            # see only the prefix, and the step is sampled from them
            self._graft_faults.failed("forward", error, self._graft_stats)
            step.failed, step.plan, step.forward_timer = True, None, None
            return forward(self, *args, **kwargs)

    def _sample(self, logits, spec_decode_metadata):
        if on(self) and spec_decode_metadata is not None:
            return graft_runner.sample_contained(self, logits, spec_decode_metadata)
        return call_original(cls, "_sample")(self, logits, spec_decode_metadata)

    def _input_fits_in_drafter(self, common_attn_metadata):
        if on(self):
            return True
        return call_original(cls, "_input_fits_in_drafter")(self, common_attn_metadata)

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, sample_hidden_states, aux_hidden_states,
                                *args, **kwargs):
        if on(self):
            faults = self._graft_faults
            if faults.off:
                return graft_runner.propose_nothing(self)
            try:
                faults.inject("propose")
                if isinstance(self.drafter, GraftDFlashProposer):
                    return graft_runner.propose_with_blocks(
                        self, sampled_token_ids, lambda: call_original(
                            cls, "propose_draft_token_ids")(
                            self, scheduler_output, sampled_token_ids, sampling_metadata,
                            hidden_states, sample_hidden_states, aux_hidden_states, *args,
                            **kwargs))
                return graft_runner.propose_with_trees(self, scheduler_output,
                                                       sampled_token_ids,
                                                       aux_hidden_states or [hidden_states])
            except Exception as error:
                faults.failed("propose", error, self._graft_stats)
                return graft_runner.propose_nothing(self)
        return call_original(cls, "propose_draft_token_ids")(
            self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
            sample_hidden_states, aux_hidden_states, *args, **kwargs)

    def sample_tokens(self, *args, **kwargs):
        output = call_original(cls, "sample_tokens")(self, *args, **kwargs)
        if on(self) and output is not None:
            try:
                self._graft_faults.inject("after")
                trimmed = self.drafter.heap_trimmer.maybe_trim()
                if trimmed is not None:
                    self._graft_stats.counts["heap_trims"] += 1
                    self._graft_stats.add_seconds("heap_trim", trimmed)
                if self.drafter.state_keeper is not None:
                    self.drafter.state_keeper.maybe_save()
                    failed = self.drafter.state_keeper.take_failures()
                    if failed:
                        self._graft_stats.counts["successor_state_save_failures"] += failed
            except Exception as error:
                self._graft_faults.failed("after", error, self._graft_stats)
            self._graft_faults.end_step()
            counts = self._graft_stats.take()
            if counts:
                output.graft_stats = counts
        return output

    def _dummy_sampler_run(self, hidden_states, *args, **kwargs):
        out = call_original(cls, "_dummy_sampler_run")(self, hidden_states, *args, **kwargs)
        if on(self):
            graft_runner.profile_tree_step(self, hidden_states)
        return out

    def shutdown(self, *args, **kwargs):
        if on(self) and self.drafter.state_keeper is not None:
            try:
                self.drafter.state_keeper.save("shutdown")
            except Exception:  # vLLM's own shutdown must run whatever the save did
                logger.exception("Graft: the successor state was not saved at shutdown")
        return call_original(cls, "shutdown")(self, *args, **kwargs)

    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model,
                          custom_logitsprocs=(), *args, **kwargs):
        # vLLM builds only MinTokens under speculative decoding (its chain sampler skips
        # the others at draft positions). Graft samples every node with the full
        # sampler, so the built-in processors (min_p, logit_bias) work.
        graft = (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        if graft is not None and not is_pooling_model and not custom_logitsprocs:
            from vllm.v1.sample.logits_processor import (BUILTIN_LOGITS_PROCESSORS,
                                                         LogitsProcessors)

            return LogitsProcessors(ctor(vllm_config, device, is_pin_memory)
                                    for ctor in BUILTIN_LOGITS_PROCESSORS)
        return call_original(runner_module, "build_logitsprocs")(
            vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs,
            *args, **kwargs)

    names = ["__init__", "initialize_kv_cache", "_update_states", "_prepare_inputs",
             "_model_forward", "_sample", "_input_fits_in_drafter", "propose_draft_token_ids",
             "sample_tokens", "_dummy_sampler_run", "shutdown"]
    local = locals()
    return [Patch("graft.runner", cls, {name: local[name] for name in names},
                  must_exist=frozenset(names)),
            Patch("graft.logitsprocs", runner_module, {"build_logitsprocs": build_logitsprocs},
                  must_exist=frozenset({"build_logitsprocs"}))]


# ---- 12: tree attention ----------------------------------------------------------------
def tree_attention_patch(impl_cls) -> Patch:
    """Tree attention on an attention implementation's ``forward`` (inert without an
    active tree plan). The CPU backend is patched at plugin load; on other platforms the
    implementation in use is patched when a Graft runner creates its KV cache."""
    from vllm_graft.vllm.tree_attention import tree_attention_forward

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                *args, **kwargs):
        original = call_original(impl_cls, "forward")
        return tree_attention_forward(original, self, layer, query, key, value, kv_cache,
                                      attn_metadata, output, *args, **kwargs)

    return Patch(f"graft.tree_attention.{impl_cls.__name__}", impl_cls, {"forward": forward},
                 must_exist=frozenset({"forward", "do_kv_cache_update"}))


def _patch_cpu_attention() -> list[Patch]:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    return [tree_attention_patch(CPUAttentionBackendImpl)]


# ---- 11c: a first shutdown save, before draining --------------------------------------
def _patch_engine_shutdown() -> list[Patch]:
    """The runner's shutdown save (11b) comes last: after draining in-flight requests
    and after the executor has told its workers to exit. When that takes longer than
    vLLM's shutdown budget (long requests still draining, a loaded host), the engine is
    killed first and nothing is saved. So the engine process also asks its workers
    for a save the moment SIGTERM is seen, while they are idle between steps; the
    runner's save then adds what draining taught."""
    from vllm.v1.engine.core import EngineCoreProc, EngineShutdownState

    from vllm_graft.vllm.config import ADDITIONAL_CONFIG_KEY
    from vllm_graft.vllm.rpc import save_successor_state

    def _handle_shutdown(self):
        # runs every engine step: the state test first, the config only at a shutdown
        graft = None
        if self.shutdown_state == EngineShutdownState.REQUESTED:
            graft = (self.vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        if graft is not None and graft.get("successor_state") is not None:
            try:
                self.model_executor.collective_rpc(
                    save_successor_state, timeout=STATE_SAVE_SHUTDOWN_S,
                    args=(SHUTDOWN_REQUESTED_REASON,))
            except Exception:  # the shutdown must go on whatever the save did
                logger.exception("Graft: the successor state was not saved when the "
                                 "shutdown was requested")
        return call_original(EngineCoreProc, "_handle_shutdown")(self)

    return [Patch("graft.engine_shutdown", EngineCoreProc,
                  {"_handle_shutdown": _handle_shutdown},
                  must_exist=frozenset({"_handle_shutdown"}))]


# ---- 13-15: metrics ---------------------------------------------------------------------
def _patch_metrics() -> list[Patch]:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    from vllm_graft.vllm.config import ADDITIONAL_CONFIG_KEY
    from vllm_graft.vllm.metrics import (GRAFT_COUNTERS, GraftPrometheus,
                                         GraftSchedulerStats, with_graft_stats)

    def update_from_output(self, scheduler_output, model_runner_output):
        counts = getattr(model_runner_output, "graft_stats", None)
        if counts:
            self.__dict__.setdefault("_graft_counts", Counter()).update(counts)
        return call_original(Scheduler, "update_from_output")(
            self, scheduler_output, model_runner_output)

    def make_stats(self, *args, **kwargs):
        stats = call_original(Scheduler, "make_stats")(self, *args, **kwargs)
        return with_graft_stats(stats, self.__dict__.get("_graft_counts", Counter()))

    def prometheus_init(self, vllm_config, *args, **kwargs):
        call_original(PrometheusStatLogger, "__init__")(self, vllm_config, *args, **kwargs)
        self.graft_prom = None
        graft = (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        if graft is not None:
            self.graft_prom = GraftPrometheus(self.per_engine_labelvalues)
            stages = [f"stage_{cp}" for cp in graft.get("checkpoints", (0, 1, 5))]
            self.graft_prom.declare([*GRAFT_COUNTERS, *stages])

    def prometheus_record(self, scheduler_stats, *args, **kwargs):
        call_original(PrometheusStatLogger, "record")(self, scheduler_stats, *args, **kwargs)
        if getattr(self, "graft_prom", None) is not None and scheduler_stats is not None:
            engine_idx = kwargs.get("engine_idx", args[2] if len(args) > 2 else 0)
            self.graft_prom.observe(scheduler_stats, engine_idx)

    annotations = {"scheduler_stats": GraftSchedulerStats | None}
    return [
        Patch("graft.scheduler_stats", Scheduler,
              {"update_from_output": update_from_output, "make_stats": make_stats},
              must_exist=frozenset({"update_from_output", "make_stats"})),
        Patch("graft.core_outputs", EngineCoreOutputs,
              {"__annotations__": {**EngineCoreOutputs.__annotations__, **annotations}},
              must_exist=frozenset({"__annotations__"})),
        Patch("graft.prometheus", PrometheusStatLogger,
              {"__init__": prometheus_init, "record": prometheus_record},
              must_exist=frozenset({"__init__", "record"})),
    ]


def all_patches() -> list[Patch]:
    """Every patch, in the order they are applied."""
    return [*_patch_engine_args(), *_patch_openai_user(), *_patch_runner(),
            *_patch_engine_shutdown(), *_patch_cpu_attention(), *_patch_metrics()]


def apply_all() -> int:
    """Apply every patch not yet applied in this process; returns how many were new."""
    applied = sum(patch.apply() for patch in all_patches())
    if applied:
        logger.info("vllm-graft: applied %d patch groups to vLLM", applied)
    return applied
