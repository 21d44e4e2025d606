"""Patches 5-11: the per-step hooks of a Graft model runner.

5 forgets finished and preempted requests; 6 prepares tree positions and the attention
plan (vLLM's plain path on steps without drafts); 7 runs the target forward with the
tree plan active; 8 accepts tree paths losslessly; 9 leaves the per-request fit to
Graft; 10 drafts the next trees; 11 ships Graft's counters with the step's output.

Every hook is contained (:mod:`vllm_graft.vllm.faults`): an exception in one makes its
step decode plainly, and enough failing steps in a row turn Graft off for the engine."""

from __future__ import annotations

import contextlib
import copy

import vllm.v1.worker.gpu_model_runner as runner_module
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_graft.core.config import StepMode
from vllm_graft.step_clock import SpanTimer
from vllm_graft.vllm import runner as graft_runner
from vllm_graft.vllm.metrics import request_table_values
from vllm_graft.vllm.patching import call_original
from vllm_graft.vllm.proposal import last_proposal
from vllm_graft.vllm.proposer import GraftDFlashProposer
from vllm_graft.vllm.replacements.runner_lifecycle import graft_on
from vllm_graft.vllm.tree_attention import active_plan


def takes_plain_path(runner, scheduler_output) -> bool:
    """Whether a Graft runner's step may take vLLM's path without speculation: the
    throughput guard decodes plainly and no request carries drafts, so the step has
    nothing to verify and nothing to teach the successor matrix (Graft's sampling
    would call vLLM's sampler on the same rows). vLLM 0.32 otherwise computes
    speculative metadata every step (per-request draft counts, logits indices, a device
    copy) only to sample one row per request, as its plain path does. Models with
    recurrent layers keep the speculative path: their attention metadata reads the
    draft counts that path writes."""
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


def with_step_stats(self, output):
    """``output`` (a copy of vLLM's shared empty output) carrying the step's counts
    and the gauges (vllm_graft.vllm.metrics)."""
    if output is runner_module.EMPTY_MODEL_RUNNER_OUTPUT:
        output = copy.copy(output)
    self._graft_clock.settle()  # the step's times its device work has passed
    output.graft_stats = {**self._graft_stats.take(), **request_table_values(
        self.drafter.request_state_counts())}
    return output


def update_states(self, scheduler_output, *args, **kwargs):
    """5: ``GPUModelRunner._update_states``; the drafter forgets finished and preempted
    requests."""
    if graft_on(self):
        finished = set(scheduler_output.finished_req_ids)
        try:
            self._graft_faults.inject("forget")
            self.drafter.forget(finished | set(scheduler_output.preempted_req_ids or ()),
                                finished=finished)
        except Exception as error:  # what was not forgotten costs memory, not tokens
            self._graft_faults.failed("forget", error, self._graft_stats)
    return call_original(GPUModelRunner, "_update_states")(self, scheduler_output, *args,
                                                           **kwargs)


def prepare_inputs(self, scheduler_output, *args, **kwargs):
    """6: ``GPUModelRunner._prepare_inputs``; tree positions and the attention plan, or
    vLLM's plain path on a step without drafts."""
    original = call_original(GPUModelRunner, "_prepare_inputs")
    if graft_on(self) and takes_plain_path(self, scheduler_output):
        with speculation_hidden(self):
            out = original(self, scheduler_output, *args, **kwargs)
    else:
        out = original(self, scheduler_output, *args, **kwargs)
    if graft_on(self):
        try:
            self._graft_faults.inject("prepare")
            step = graft_runner.prepare_tree_verification(self, scheduler_output)
        except Exception as error:
            self._graft_faults.failed("prepare", error, self._graft_stats)
            step = graft_runner.GraftStep(trees=[], plan=None, failed=True)
        step.num_tokens = scheduler_output.total_num_scheduled_tokens
        self._graft_step = step
    return out


def model_forward(self, *args, **kwargs):
    """7: ``GPUModelRunner._model_forward``; the tree plan is active in the target
    forward, whose first tree steps in CUDA graphs are checked against eager ones."""
    step = self._graft_step if graft_on(self) else None
    sizer = self.drafter.sizer if step is not None else None
    if step is None or (step.plan is None and sizer is None):
        return call_original(GPUModelRunner, "_model_forward")(self, *args, **kwargs)
    # with budget "auto", timed without waiting for the device: read once it has passed
    step.forward_timer = None if sizer is None else SpanTimer(self.device)
    timed = contextlib.nullcontext() if sizer is None else step.forward_timer.span()
    forward = call_original(GPUModelRunner, "_model_forward")
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


def sample(self, logits, spec_decode_metadata):
    """8: ``GPUModelRunner._sample``; lossless tree acceptance, KV move, matrix update."""
    if graft_on(self) and spec_decode_metadata is not None:
        return graft_runner.sample_contained(self, logits, spec_decode_metadata)
    return call_original(GPUModelRunner, "_sample")(self, logits, spec_decode_metadata)


def input_fits_in_drafter(self, common_attn_metadata):
    """9: ``GPUModelRunner._input_fits_in_drafter``; the per-request fit is Graft's job."""
    if graft_on(self):
        return True
    return call_original(GPUModelRunner, "_input_fits_in_drafter")(self, common_attn_metadata)


def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                            hidden_states, sample_hidden_states, aux_hidden_states,
                            *args, **kwargs):
    """10: ``GPUModelRunner.propose_draft_token_ids``; catch-up and tree drafting (DFlash:
    vLLM's block proposal, then Graft-TAIL)."""
    if graft_on(self):
        faults = self._graft_faults
        if faults.off:
            return graft_runner.propose_nothing(self)
        try:
            faults.inject("propose")
            if isinstance(self.drafter, GraftDFlashProposer):
                return graft_runner.propose_with_blocks(
                    self, sampled_token_ids, lambda: call_original(
                        GPUModelRunner, "propose_draft_token_ids")(
                        self, scheduler_output, sampled_token_ids, sampling_metadata,
                        hidden_states, sample_hidden_states, aux_hidden_states, *args,
                        **kwargs))
            return graft_runner.propose_with_trees(self, scheduler_output,
                                                   sampled_token_ids,
                                                   aux_hidden_states or [hidden_states])
        except Exception as error:
            faults.failed("propose", error, self._graft_stats)
            return graft_runner.propose_nothing(self)
    return call_original(GPUModelRunner, "propose_draft_token_ids")(
        self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
        sample_hidden_states, aux_hidden_states, *args, **kwargs)


def sample_tokens(self, *args, **kwargs):
    """11: ``GPUModelRunner.sample_tokens``; Graft's counters ride on the output, and the
    periodic successor-state save and heap trim run."""
    output = call_original(GPUModelRunner, "sample_tokens")(self, *args, **kwargs)
    if graft_on(self) and output is not None:
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
        output = with_step_stats(self, output)
    return output


def execute_model(self, scheduler_output, *args, **kwargs):
    output = call_original(GPUModelRunner, "execute_model")(self, scheduler_output, *args,
                                                            **kwargs)
    if graft_on(self) and output is runner_module.EMPTY_MODEL_RUNNER_OUTPUT:
        # a step that only retired requests (the last ones of a load): their
        # entries were dropped in _update_states, and the gauge says so
        output = with_step_stats(self, output)
    return output
