"""Patches 3, 3b, 4, 11b, 11d and 11e: a Graft model runner from its construction to
its shutdown.

3 gives vLLM's V1 model runner Graft's proposer (or its draft-model / DFlash form) as
drafter and refuses parallelism Graft does not support; 3b turns vLLM's built-in logits
processors on; 4 checks at KV cache creation that tree attention can serve every layer
(and patches the GPU attention implementation in use); 11d makes the start-up memory
profile include a full step of trees; 11e keeps the engine up, eager, when its CUDA
graph capture fails; 11b saves the successor state at shutdown.

A runner is a Graft runner when it has ``_graft_stats`` (:func:`graft_on`); every hook
is inert on others."""

from __future__ import annotations

import logging

import torch
import vllm.v1.worker.gpu_model_runner as runner_module
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_graft.step_clock import StepClock
from vllm_graft.vllm import runner as graft_runner
from vllm_graft.vllm.config import ADDITIONAL_CONFIG_KEY, cuda_graphs_enabled
from vllm_graft.vllm.faults import FaultContainment
from vllm_graft.vllm.graph_check import ReplayCheck, run_eagerly_after_failed_capture
from vllm_graft.vllm.kv_blocks import PagedKVLayout
from vllm_graft.vllm.patching import call_original
from vllm_graft.vllm.proposer import (GraftDFlashProposer, GraftDraftModelProposer,
                                      GraftProposer)
from vllm_graft.vllm.replacements.attention import tree_attention_patch
from vllm_graft.vllm.tree_attention import check_impl_supported, kv_reader

logger = logging.getLogger(__name__)


def graft_on(runner) -> bool:
    """Whether ``runner`` is a Graft runner (set up by :func:`init_runner`)."""
    return getattr(runner, "_graft_stats", None) is not None


def refuse_kv_sharing(layers: dict) -> None:
    """Layers that reuse another layer's KV cache (``kv_sharing_target_layer_name``) get
    no K/V written for their own rows, so Graft's KV move would skip them."""
    sharing = sorted(name for name, layer in layers.items()
                     if getattr(layer, "kv_sharing_target_layer_name", None))
    if sharing:
        raise ValueError(f"Graft does not support layers that share another layer's KV "
                         f"cache: {', '.join(sharing[:4])}{' ...' if len(sharing) > 4 else ''}")


def init_runner(self, vllm_config, device, *args, **kwargs):
    """3: ``GPUModelRunner.__init__``; a Graft engine's runner gets Graft's proposer as
    drafter, its counters and its fault containment."""
    call_original(GPUModelRunner, "__init__")(self, vllm_config, device, *args, **kwargs)
    self._graft_stats = None
    self._graft_clock = None
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
    self._graft_clock = StepClock(self.device)
    self._graft_faults = FaultContainment(
        self.drafter.settings.config.max_consecutive_errors)
    if cuda_graphs_enabled(vllm_config):
        self._graft_graph_check = ReplayCheck()


def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model,
                      custom_logitsprocs=(), *args, **kwargs):
    """3b: ``gpu_model_runner.build_logitsprocs``; the built-in logits processors of a
    Graft engine."""
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


def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
    """4: ``GPUModelRunner.initialize_kv_cache``; start-up checks of tree attention on
    every layer, and the tree sizer of budget ``auto``."""
    out = call_original(GPUModelRunner, "initialize_kv_cache")(self, kv_cache_config, *args,
                                                               **kwargs)
    if graft_on(self):
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
            from vllm_graft.core.budget import build_budget_systems
            from vllm_graft.vllm.cost_profile import load_or_measure

            settings = self.drafter.settings
            self.drafter.sizer, self.drafter.guard, self.drafter.scout = \
                build_budget_systems(settings.config, load_or_measure(self),
                                     settings.calibration)
    return out


def dummy_sampler_run(self, hidden_states, *args, **kwargs):
    """11d: ``GPUModelRunner._dummy_sampler_run``; the start-up memory profile includes a
    full step of trees."""
    out = call_original(GPUModelRunner, "_dummy_sampler_run")(self, hidden_states, *args,
                                                              **kwargs)
    if graft_on(self):
        graft_runner.profile_tree_step(self, hidden_states)
    return out


def capture_model(self, *args, **kwargs) -> int:
    """11e: ``GPUModelRunner.capture_model``; if capturing the target's CUDA graphs fails
    in a Graft engine, it runs eagerly and says why in one log line
    (:func:`vllm_graft.vllm.graph_check.run_eagerly_after_failed_capture`)."""
    original = call_original(GPUModelRunner, "capture_model")
    if not graft_on(self):
        return original(self, *args, **kwargs)
    try:
        self._graft_faults.inject("capture")
        return original(self, *args, **kwargs)
    except Exception as error:
        run_eagerly_after_failed_capture(self, error)
        return 0  # no graph memory for the KV cache to leave room for


def shutdown_runner(self, *args, **kwargs):
    """11b: ``GPUModelRunner.shutdown``; the successor state is saved first."""
    if graft_on(self) and self.drafter.state_keeper is not None:
        try:
            self.drafter.state_keeper.save("shutdown")
        except Exception:  # vLLM's own shutdown must run whatever the save did
            logger.exception("Graft: the successor state was not saved at shutdown")
    return call_original(GPUModelRunner, "shutdown")(self, *args, **kwargs)
