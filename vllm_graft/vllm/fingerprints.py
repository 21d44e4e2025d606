"""Fingerprints of the vLLM code that Graft patches or relies on, checked at plugin load.

Graft replaces or wraps private vLLM methods (the table in
:mod:`vllm_graft.vllm.patches`). A vLLM whose methods take other arguments, or whose
bodies do something else, would not fail: Graft would call them wrongly or skip what
they now do, and decode wrongly. So every such function is recorded in the table below
with its parameter names and, for the functions whose body Graft reimplements or
depends on line by line, the sha256 of its source (what a fingerprint holds and how it
is taken: :mod:`vllm_graft.vllm.fingerprinting`).

:func:`verify_installed_vllm` compares the installed vLLM with the table once per
process and raises :class:`~vllm_graft.vllm.fingerprinting.VLLMFingerprintMismatch`
naming every symbol that differs, so a changed vLLM stops at start-up instead of
mis-decoding. ``scripts/check_vllm_release.py`` compares a release's source files with
the same table without installing it.

The values are never typed by hand. To follow a new vLLM, re-verify each patch that
differs, then rewrite the table from the installed vLLM::

    python -m vllm_graft.vllm.fingerprints            # compare, print a status table
    python -m vllm_graft.vllm.fingerprints --print    # the table's values, as Python
    python -m vllm_graft.vllm.fingerprints --update   # rewrite the table in this file

To watch a new symbol, add an entry with ``params=()`` (and ``source_sha256=""`` when
its body matters) and run ``--update``.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
import textwrap
from pathlib import Path
from typing import Callable, Iterable

from vllm_graft.vllm.fingerprinting import (Fingerprint, Mismatch, Observed, SymbolMissing,
                                            find_mismatches, mismatch_error,
                                            observe_installed, regenerate)


# ---- the start-up check ----------------------------------------------------------------
def check_fingerprints(fingerprints: Iterable[Fingerprint] | None = None,
                       observe: Callable[[Fingerprint], Observed] = observe_installed) -> None:
    """Raise :class:`~vllm_graft.vllm.fingerprinting.VLLMFingerprintMismatch` listing
    every symbol that differs."""
    mismatches = find_mismatches(FINGERPRINTS if fingerprints is None else fingerprints,
                                 observe)
    if mismatches:
        raise mismatch_error(mismatches, FINGERPRINTS_VLLM_VERSION)


@functools.lru_cache(maxsize=None)
def _installed_mismatches(fingerprints: tuple[Fingerprint, ...]) -> tuple[Mismatch, ...]:
    return tuple(find_mismatches(fingerprints))


def verify_installed_vllm() -> None:
    """The start-up check (plugin load): cached per process, because vLLM loads general
    plugins several times; a failure is raised again on every call."""
    mismatches = _installed_mismatches(tuple(FINGERPRINTS))
    if mismatches:
        raise mismatch_error(list(mismatches), FINGERPRINTS_VLLM_VERSION)


# ---- (re)generating the table ----------------------------------------------------------
_BEGIN = "# BEGIN GENERATED FINGERPRINTS"
_END = "# END GENERATED FINGERPRINTS"


def _wrapped_tuple(items: list[str], indent: str, width: int = 92) -> str:
    text = "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if len(indent) + len("params=") + len(text) + 1 <= width:
        return text
    lines, line = [], ""
    for item in items:
        candidate = f"{line} {item}," if line else f"{item},"
        if line and len(indent) + 4 + len(candidate) > width:
            lines.append(line)
            candidate = f"{item},"
        line = candidate
    lines.append(line)
    inner = "\n".join(f"{indent}    {chunk}" for chunk in lines)
    return f"(\n{inner}\n{indent})"


def render_table(fingerprints: Iterable[Fingerprint], vllm_version: str) -> str:
    """The generated block of this module, as Python source."""
    indent = " " * 8
    parts = [_BEGIN + " (python -m vllm_graft.vllm.fingerprints --update)",
             f"FINGERPRINTS_VLLM_VERSION = {vllm_version!r}",
             "FINGERPRINTS: tuple[Fingerprint, ...] = ("]
    for fp in fingerprints:
        lines = ["    Fingerprint(",
                 f"{indent}{fp.module!r}, {fp.qualname!r},",
                 f"{indent}patched_by={fp.patched_by!r},"]
        why = textwrap.wrap(fp.why, 92 - len(indent) - len("why=()") - 2)
        if len(why) <= 1:
            lines.append(f"{indent}why={fp.why!r},")
        else:
            chunks = [repr(chunk + (" " if i < len(why) - 1 else ""))
                      for i, chunk in enumerate(why)]
            lines.append(f"{indent}why=(" + f"\n{indent}     ".join(chunks) + "),")
        lines.append(f"{indent}params={_wrapped_tuple([repr(p) for p in fp.params], indent)},")
        if fp.source_sha256 is not None:
            lines.append(f"{indent}source_sha256={fp.source_sha256!r},")
        lines.append("    ),")
        parts.append("\n".join(lines))
    parts += [")", _END]
    return "\n".join(parts) + "\n"


def replace_generated_block(text: str, block: str) -> str:
    """``text`` (this module's source) with its generated block replaced by ``block``."""
    pattern = re.compile(f"^{re.escape(_BEGIN)}.*?^{re.escape(_END)}\n",
                         re.DOTALL | re.MULTILINE)
    if len(pattern.findall(text)) != 1:
        raise RuntimeError("the generated block of fingerprints.py is not found exactly once")
    return pattern.sub(lambda _: block, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_graft.vllm.fingerprints",
        description="Compare the installed vLLM with Graft's fingerprints, or rewrite them.")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--print", action="store_true",
                      help="print the table's values for the installed vLLM")
    mode.add_argument("--update", action="store_true",
                      help="rewrite the table in this file from the installed vLLM")
    args = parser.parse_args(argv)
    if args.print or args.update:
        import vllm

        try:
            block = render_table(regenerate(FINGERPRINTS), vllm.__version__.split("+")[0])
        except SymbolMissing as err:
            print(f"cannot fingerprint: {err}; point that entry at where the installed vLLM "
                  "defines it (or drop it once its patch is gone)", file=sys.stderr)
            return 1
        if args.print:
            print(block, end="")
        else:
            path = Path(__file__)
            path.write_text(replace_generated_block(path.read_text(), block))
            print(f"rewrote the fingerprints in {path} for vLLM {vllm.__version__}")
        return 0
    mismatches = {m.symbol: m for m in find_mismatches(FINGERPRINTS)}
    for fp in FINGERPRINTS:
        found = mismatches.get(fp.symbol)
        print(f"{fp.symbol}: {'ok' if found is None else f'{found.status} ({found.detail})'}")
    return 1 if mismatches else 0


# ---- the table -------------------------------------------------------------------------
# Hand-written: module, qualname, patched_by, why, and whether the source is hashed
# (source_sha256 not None). Generated: params, source_sha256, FINGERPRINTS_VLLM_VERSION.
# BEGIN GENERATED FINGERPRINTS (python -m vllm_graft.vllm.fingerprints --update)
FINGERPRINTS_VLLM_VERSION = '0.32.0'
FINGERPRINTS: tuple[Fingerprint, ...] = (
    Fingerprint(
        'vllm.engine.arg_utils', 'EngineArgs.create_speculative_config',
        patched_by='graft.engine_args',
        why='wrapped: method graft is translated to eagle3 before the original runs',
        params=('self', 'target_model_config', 'target_parallel_config'),
    ),
    Fingerprint(
        'vllm.engine.arg_utils', 'EngineArgs.add_cli_args',
        patched_by='graft.engine_args',
        why='wrapped: --speculative-config gets a type that also reads files',
        params=('parser',),
    ),
    Fingerprint(
        'vllm.sampling_params', 'SamplingParams._validate_spec_decode',
        patched_by='graft.sampling_params',
        why='skipped for Graft engines: a check added to it would be skipped too',
        params=('self', 'speculative_config'),
        source_sha256='2283724c4c43d009421e4438577593bbc550ffc00eb3faa872e4683cf607f070',
    ),
    Fingerprint(
        'vllm.config.vllm', 'VllmConfig.use_v2_model_runner',
        patched_by='graft.model_runner_choice',
        why='property getter; Graft engines answer False (tree verification is in V1)',
        params=('self',),
    ),
    Fingerprint(
        'vllm.v1.worker.gpu_model_runner', 'GPUModelRunner.__init__',
        patched_by='graft.runner',
        why='wrapped: the drafter is replaced by a Graft proposer after the original',
        params=('self', 'vllm_config', 'device'),
    ),
    Fingerprint(
        'vllm.v1.worker.gpu_model_runner', 'GPUModelRunner.initialize_kv_cache',
        patched_by='graft.runner',
        why='wrapped: start-up checks of the KV layout and tree attention after it',
        params=('self', 'kv_cache_config', 'is_profiling', 'kv_cache_allocation_context'),
    ),
    Fingerprint(
        'vllm.v1.worker.gpu_model_runner', 'GPUModelRunner._update_states',
        patched_by='graft.runner',
        why=('wrapped; Graft reads the persistent batch it builds (req_ids, '
             'num_computed_tokens_cpu, token_ids_cpu, requests)'),
        params=('self', 'scheduler_output'),
        source_sha256='075168ea8fa4d556079595af9efce05e0e70a3188c04c2ba0a89595b68cf0c1f',
    ),
    Fingerprint(
        'vllm.v1.worker.gpu_model_runner', 'GPUModelRunner._prepare_inputs',
        patched_by='graft.runner',
        why=('wrapped; Graft rewrites the positions it computed, after it derived slots '
             'from linear positions, and reads query_start_loc; on steps without drafts it '
             'hides speculative_config, which the body reads once, to choose the plain '
             'path'),
        params=('self', 'scheduler_output', 'num_scheduled_tokens'),
        source_sha256='3fc170f920f69afbbb8ab127a0c8ad6997b3d0aec2236cce4d4779e2029d9857',
    ),
    Fingerprint(
        'vllm.v1.worker.gpu_model_runner', 'GPUModelRunner._model_forward',
        patched_by='graft.runner',
        why='wrapped: the tree plan must be active around exactly the target forward',
        params=(
            'self', 'input_ids', 'positions', 'intermediate_tensors', 'inputs_embeds',
            '**model_kwargs',
        ),
        source_sha256='a67a0b6a479b9e387167469f4df39bf9ef8d8650669972e393edde56d677907b',
    ),
    Fingerprint(
        'vllm.v1.worker.gpu_model_runner', 'GPUModelRunner._sample',
        patched_by='graft.runner',
        why='replaced for Graft engines by lossless tree acceptance',
        params=('self', 'logits', 'spec_decode_metadata'),
        source_sha256='e8615af5c218993395c9ae6573c2f16aa22aa16b9d22681dbb4e3451040b4ff0',
    ),
    Fingerprint(
        'vllm.v1.worker.gpu_model_runner', 'GPUModelRunner._input_fits_in_drafter',
        patched_by='graft.runner',
        why='replaced for Graft engines (per-request fit is checked by Graft)',
        params=('self', 'common_attn_metadata'),
        source_sha256='5d7ee7f2c0db50b18548eb35a6d000d0e11cb447116dcf83e6fdb42a23d7325f',
    ),
    Fingerprint(
        'vllm.v1.worker.gpu_model_runner', 'GPUModelRunner.propose_draft_token_ids',
        patched_by='graft.runner',
        why=('replaced for Graft engines by catch-up and tree drafting; the positional '
             'order of its arguments is forwarded'),
        params=(
            'self', 'scheduler_output', 'sampled_token_ids', 'sampling_metadata',
            'hidden_states', 'sample_hidden_states', 'aux_hidden_states',
            'spec_decode_metadata', 'common_attn_metadata', 'slot_mappings',
        ),
        source_sha256='980d46e41814827a464046a8231ca3b7e379831b67def971483559f26065031f',
    ),
    Fingerprint(
        'vllm.v1.worker.gpu_model_runner', 'GPUModelRunner.sample_tokens',
        patched_by='graft.runner',
        why='wrapped: Graft counters ride on its output',
        params=('self', 'grammar_output'),
    ),
    Fingerprint(
        'vllm.v1.worker.gpu_model_runner', 'GPUModelRunner.execute_model',
        patched_by='graft.runner',
        why=('wrapped: a step that only retires requests returns the shared empty output, '
             'and a copy of it carries the Graft gauges'),
        params=('self', 'scheduler_output', 'intermediate_tensors'),
    ),
    Fingerprint(
        'vllm.entrypoints.openai.chat_completion.protocol', 'ChatCompletionRequest.to_sampling_params',
        patched_by='graft.openai_user.ChatCompletionRequest',
        why='wrapped: the user field becomes the tenant of graft.isolation',
        params=('self', 'max_tokens', 'default_sampling_params'),
    ),
    Fingerprint(
        'vllm.entrypoints.openai.completion.protocol', 'CompletionRequest.to_sampling_params',
        patched_by='graft.openai_user.CompletionRequest',
        why='wrapped: the user field becomes the tenant of graft.isolation',
        params=('self', 'max_tokens', 'default_sampling_params'),
    ),
    Fingerprint(
        'vllm.entrypoints.openai.chat_completion.serving', 'OpenAIServingChat.create_chat_completion',
        patched_by='graft.openai_tenant.OpenAIServingChat',
        why=('wrapped: reads the tenant from the user field or a header while the request '
             'is built (to_sampling_params runs inside it); returns its ErrorResponse'),
        params=('self', 'request', 'raw_request'),
    ),
    Fingerprint(
        'vllm.entrypoints.openai.completion.serving', 'OpenAIServingCompletion.create_completion',
        patched_by='graft.openai_tenant.OpenAIServingCompletion',
        why=('wrapped: reads the tenant from the user field or a header while the request '
             'is built (to_sampling_params runs inside it); returns its ErrorResponse'),
        params=('self', 'request', 'raw_request'),
    ),
    Fingerprint(
        'vllm.v1.engine.input_processor', 'InputProcessor.process_inputs',
        patched_by='graft.request_tenant',
        why=('wrapped: the engine request it returns gets its tenant field from the chosen '
             'source (its cache_salt, its extra arguments, or the params passed in)'),
        params=(
            'self', 'request_id', 'prompt', 'params', 'supported_tasks', 'arrival_time',
            'lora_request', 'tokenization_kwargs', 'trace_headers', 'priority',
            'data_parallel_rank', 'resumable', 'session_id', 'kv_hints',
        ),
    ),
    Fingerprint(
        'vllm.v1.worker.gpu_model_runner', 'GPUModelRunner._dummy_sampler_run',
        patched_by='graft.runner',
        why=("wrapped: after vLLM's sampler warm-up in the start-up profile, a step of "
             "trees (every tree row's logits) is profiled too"),
        params=('self', 'hidden_states'),
    ),
    Fingerprint(
        'vllm.v1.worker.gpu_model_runner', 'GPUModelRunner.capture_model',
        patched_by='graft.runner',
        why=('wrapped: a failed capture leaves the engine eager; the wrapper resets the '
             'capturing flag the body sets and clears only after a whole capture'),
        params=('self',),
        source_sha256='55ab8f6c8b926ff7581b7ee8b5e6fa9882d3125a1a896b7c019f8321966fd21e',
    ),
    Fingerprint(
        'vllm.v1.worker.gpu_model_runner', 'GPUModelRunner.shutdown',
        patched_by='graft.runner',
        why='wrapped: the successor state is saved before the runner releases its memory',
        params=('self',),
    ),
    Fingerprint(
        'vllm.v1.engine.core', 'EngineCoreProc._handle_shutdown',
        patched_by='graft.engine_shutdown',
        why=('wrapped: the successor state is saved when it first sees REQUESTED, once, '
             'between steps, before draining'),
        params=('self',),
        source_sha256='2805b3551eee816c024afbcb52a3630ce161e11aa5bfb005d349238bf824854b',
    ),
    Fingerprint(
        'vllm.v1.worker.gpu_model_runner', 'GPUModelRunner._dummy_run',
        patched_by=None,
        why='called with a token count to measure the cost profile of budget "auto"',
        params=(
            'self', 'num_tokens', 'cudagraph_runtime_mode', 'force_attention',
            'uniform_decode', 'allow_microbatching', 'skip_eplb', 'is_profile',
            'create_mixed_batch', 'remove_lora', 'is_graph_capturing', 'num_active_loras',
            'profile_seq_lens', 'randomize_inputs',
        ),
    ),
    Fingerprint(
        'vllm.v1.sample.logits_processor', 'build_logitsprocs',
        patched_by='graft.logitsprocs',
        why=('patched where gpu_model_runner imports it; its non-speculative branch is '
             'reimplemented for Graft engines'),
        params=(
            'vllm_config', 'device', 'is_pin_memory', 'is_pooling_model',
            'custom_logitsprocs',
        ),
        source_sha256='82609dd72304afee0b373e975011c3a628f45da6f3f6ba87bce92c0003d55391',
    ),
    Fingerprint(
        'vllm.v1.attention.backends.cpu_attn', 'CPUAttentionBackendImpl.forward',
        patched_by='graft.tree_attention.CPUAttentionBackendImpl',
        why=('wrapped: tree rows of its output are recomputed; relies on it leaving the KV '
             'write to do_kv_cache_update and on its output layout'),
        params=(
            'self', 'layer', 'query', 'key', 'value', 'kv_cache', 'attn_metadata', 'output',
            'output_scale', 'output_block_scale',
        ),
        source_sha256='63f9284c7b9727bf417c55281114121791831305c1500b145f9a23efd95659f8',
    ),
    Fingerprint(
        'vllm.v1.attention.backends.cpu_attn', 'CPUAttentionBackendImpl.do_kv_cache_update',
        patched_by=None,
        why='called to move accepted KV and to detect the cache layout at start-up',
        params=('self', 'layer', 'key', 'value', 'kv_cache', 'slot_mapping'),
    ),
    Fingerprint(
        'vllm.v1.core.sched.scheduler', 'Scheduler.update_from_output',
        patched_by='graft.scheduler_stats',
        why='wrapped: sums the Graft counters of each runner output',
        params=('self', 'scheduler_output', 'model_runner_output'),
    ),
    Fingerprint(
        'vllm.v1.core.sched.scheduler', 'Scheduler.make_stats',
        patched_by='graft.scheduler_stats',
        why='wrapped: adds the Graft counters to the scheduler stats',
        params=(
            'self', 'spec_decoding_stats', 'kv_connector_stats', 'cudagraph_stats',
            'perf_stats', 'ec_connector_stats',
        ),
    ),
    Fingerprint(
        'vllm.v1.engine', 'EngineCoreOutputs.__annotations__',
        patched_by='graft.core_outputs',
        why='the scheduler_stats field is retyped to carry Graft counters',
        params=(
            'engine_index', 'outputs', 'scheduler_stats', 'timestamp', 'utility_output',
            'finished_requests', 'wave_complete', 'start_wave', 'weight_version',
        ),
    ),
    Fingerprint(
        'vllm.v1.metrics.loggers', 'PrometheusStatLogger.__init__',
        patched_by='graft.prometheus',
        why='wrapped: declares the Graft counters',
        params=('self', 'vllm_config', 'engine_indexes'),
    ),
    Fingerprint(
        'vllm.v1.metrics.loggers', 'PrometheusStatLogger.record',
        patched_by='graft.prometheus',
        why=('wrapped: engine_idx is read as the third positional argument after '
             'scheduler_stats'),
        params=(
            'self', 'scheduler_stats', 'iteration_stats', 'mm_cache_stats', 'engine_idx',
        ),
    ),
    Fingerprint(
        'vllm.v1.spec_decode.eagle', 'EagleProposer.__init__',
        patched_by=None,
        why='GraftProposer subclasses EagleProposer and calls it positionally',
        params=('self', 'vllm_config', 'device', 'runner'),
    ),
    Fingerprint(
        'vllm.v1.spec_decode.draft_model', 'DraftModelProposer.__init__',
        patched_by=None,
        why=('GraftDraftModelProposer subclasses DraftModelProposer and calls it '
             'positionally'),
        params=('self', 'vllm_config', 'device', 'runner'),
    ),
    Fingerprint(
        'vllm.v1.spec_decode.llm_base_proposer', 'SpecDecodeBaseProposer.dummy_run',
        patched_by=None,
        why='overridden by the Graft proposers (one warm-up forward), which call it',
        params=(
            'self', 'num_tokens', 'use_cudagraphs', 'is_graph_capturing', 'slot_mappings',
        ),
    ),
    Fingerprint(
        'vllm.v1.worker.utils', 'AttentionGroup.build_metadata_for_drafting',
        patched_by=None,
        why="called for the drafter's catch-up forward",
        params=('self', 'common_attn_metadata', 'draft_index'),
    ),
    Fingerprint(
        'vllm.v1.worker.utils', 'AttentionGroup.map_to_kernel_block_table',
        patched_by=None,
        why='reimplemented by Graft to address kernel blocks of the paged KV cache',
        params=('self', 'block_table', 'ubatch_idx'),
        source_sha256='1718bff4b602351df9108422a01572b2ebaa609959f0038b04a72f527d56d002',
    ),
    Fingerprint(
        'vllm.forward_context', 'set_forward_context',
        patched_by=None,
        why="entered around the drafter's forwards (num_tokens, slot_mapping)",
        params=(
            'attn_metadata', 'vllm_config', 'num_tokens', 'num_tokens_across_dp',
            'cudagraph_runtime_mode', 'batch_descriptor', 'ubatch_slices', 'slot_mapping',
            'skip_compiled', 'is_padding',
        ),
    ),
    Fingerprint(
        'vllm.v1.sample.sampler', 'Sampler.forward',
        patched_by=None,
        why='called at every tree level to sample each node as plain decoding would',
        params=(
            'self', 'logits', 'sampling_metadata', 'predict_bonus_token',
            'logprobs_mode_override',
        ),
    ),
    Fingerprint(
        'vllm.v1.sample.sampler', 'Sampler.apply_logits_processors',
        patched_by=None,
        why=('everything that edits logits before the greedy choice: a greedy batch free '
             'of all of it is accepted from the raw argmax (sampling.argmax_is_the_sample)'),
        params=('self', 'logits', 'sampling_metadata', 'predict_bonus_token'),
        source_sha256='f05723b69779f60a06b8afe371f6e2e5503a9cdf0b8a79430d2a330dbeb313fb',
    ),
    Fingerprint(
        'vllm.v1.sample.sampler', 'Sampler.sample',
        patched_by=None,
        why='an all-greedy batch is sampled as the argmax of the processed logits',
        params=('self', 'logits', 'sampling_metadata', 'logprobs_mode_override'),
        source_sha256='fd54cc022b3eacafd0788738241e465402198fa37076448815142ba487755bfc',
    ),
    Fingerprint(
        'vllm.v1.sample.sampler', 'Sampler.greedy_sample',
        patched_by=None,
        why=('the greedy choice logits_topk reproduces: the first of equal maxima, NaN '
             'above numbers (vLLM CPU kernel or torch.argmax)'),
        params=('logits',),
        source_sha256='84d3239c36dc9b9ccf3f9ba91760b4049010c36e41bc89c639a7c8d6d6ca8e3a',
    ),
    Fingerprint(
        'vllm.v1.sample.logits_processor.builtin', 'LogitBiasLogitsProcessor.apply',
        patched_by=None,
        why='edits nothing while its biases dict is empty (read by argmax_is_the_sample)',
        params=('self', 'logits'),
        source_sha256='42890cb8fddb29d1a799cf5388a2722724c48dde18ca7e6a21089845cf2af2f9',
    ),
    Fingerprint(
        'vllm.v1.sample.logits_processor.builtin', 'MinTokensLogitsProcessor.apply',
        patched_by=None,
        why=('edits nothing while its min_toks dict is empty (read by '
             'argmax_is_the_sample)'),
        params=('self', 'logits'),
        source_sha256='356fc2de65cbdd65188c9478703eba3551b5d60906561698ea0ab4d5d0ec5d9a',
    ),
)
# END GENERATED FINGERPRINTS


if __name__ == "__main__":
    sys.exit(main())
