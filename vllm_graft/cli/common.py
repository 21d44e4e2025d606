"""Argument conventions shared by the commands: help that shows every default, the
engine options passed through to vLLM, and the arguments of the engine-driving tools
(warmup, calibrate) and the trainers. Running things is :mod:`vllm_graft.offline`'s."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vllm_graft.core.config import DEFAULT_TAIL_LENGTH, MAX_TAIL_LENGTH, PAPER_BUDGET


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter,
                    argparse.RawDescriptionHelpFormatter):
    """``--help`` with each option's default (an option whose default is None or an
    unset switch says what happens in its own help), and the description's examples
    kept as written."""

    def _get_help_string(self, action):
        if action.default is None or (action.nargs == 0 and action.default is False):
            return action.help
        return super()._get_help_string(action)


def command_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """The parser of ``vllm-graft COMMAND``: its description is the module docstring
    (the first paragraph, then the examples)."""
    return argparse.ArgumentParser(prog=f"vllm-graft {prog}", description=doc.strip(),
                                   formatter_class=HelpFormatter)


class RenamedFlag(argparse.Action):
    """An old spelling of a flag: with ``new`` it still works, with a deprecation
    message on stderr; without, it is a usage error naming the flag to use."""

    def __init__(self, option_strings, dest, new: str, replacement: str | None = None,
                 **kwargs):
        self.new, self.replacement = new, replacement
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if self.replacement is None:
            parser.error(f"{option_string} was renamed {self.new}: pass {self.new} "
                         f"{values if not isinstance(values, list) else ' '.join(values)}")
        print(f"vllm-graft: {option_string} is deprecated, use {self.new}", file=sys.stderr)
        setattr(namespace, self.replacement, values)


def add_engine_options(parser, *, dtype: str = "auto", max_model_len: int = 4096,
                       max_num_seqs: int = 16) -> None:
    """vLLM's engine arguments a deployment sets, passed through as they are (see
    :func:`engine_options`)."""
    group = parser.add_argument_group("engine options (passed to vLLM)")
    group.add_argument("--dtype", default=dtype,
                       help="weights' and activations' dtype (auto: the model's own)")
    group.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="GPUs the target is split over")
    group.add_argument("--max-model-len", type=int, default=max_model_len,
                       help="longest prompt + output in tokens" + (
                           "" if max_model_len else " (default: the longest prompt and "
                           "answer the other options allow)"))
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="share of each GPU's memory vLLM may use")
    group.add_argument("--max-num-seqs", type=int, default=max_num_seqs,
                       help="requests the engine runs at once")
    group.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction,
                       default=None, help="run the models without CUDA graphs (default: "
                       "only where there is no GPU, as vllm serve would on a GPU)")


def engine_options(args) -> dict:
    """The engine arguments of :func:`add_engine_options`, keyed as vLLM's ``LLM``
    takes them (``enforce_eager`` only where given: the engine's default depends on the
    machine, :func:`vllm_graft.offline.engine.engine`)."""
    options = {"dtype": args.dtype, "tensor_parallel_size": args.tensor_parallel_size,
               "max_model_len": args.max_model_len,
               "gpu_memory_utilization": args.gpu_memory_utilization,
               "max_num_seqs": args.max_num_seqs}
    if args.enforce_eager is not None:
        options["enforce_eager"] = args.enforce_eager
    return options


def add_num_prompts(parser, default: int, help: str) -> None:
    """``--num-prompts N`` (a count; ``--prompts`` is always a file)."""
    parser.add_argument("--num-prompts", type=int, default=default, help=help)
    parser.add_argument("--prompts", action=RenamedFlag, new="--num-prompts")


def add_training_data_args(parser, artifact: str) -> None:
    """The arguments the drafter trainers share: the target, the output directory and
    the ShareGPT prompts whose greedy answers they train on."""
    parser.add_argument("model", help="target model directory or Hugging Face Hub ID")
    parser.add_argument("--out", type=Path, required=True, help=f"{artifact} directory to write")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="cache of answers and features (default: <out>.work)")
    add_num_prompts(parser, 1600, "ShareGPT prompts to answer")
    parser.add_argument("--prompt-offset", type=int, default=200,
                        help="skip the first prompts (kept for warm-up and calibration)")
    parser.add_argument("--max-prompt-tokens", type=int, default=384,
                        help="longer prompts are left out")
    parser.add_argument("--max-tokens", type=int, default=256, help="answer length")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="datasets and models (default: $VLLM_GRAFT_CACHE or "
                        "~/.cache/vllm-graft)")
    add_engine_options(parser, max_model_len=None, max_num_seqs=64)


def answer_engine_options(args) -> dict:
    """The trainers' answer engine: :func:`engine_options`, its context long enough for
    a prompt and its answer unless ``--max-model-len`` says otherwise."""
    options = engine_options(args)
    if options["max_model_len"] is None:
        options["max_model_len"] = args.max_prompt_tokens + args.max_tokens
    return options


def training_data_settings(args, model: str | Path) -> dict:
    """What the trainers' cached answers and features depend on (a work directory of
    either trainer serves the other). ``model``: the target's directory."""
    return {"model": str(Path(model).resolve()), "prompts": args.num_prompts,
            "prompt_offset": args.prompt_offset, "max_prompt_tokens": args.max_prompt_tokens,
            "max_tokens": args.max_tokens, "dtype": args.dtype}


def training_target_and_work_dir(parser, args) -> tuple[Path, Path]:
    """The target's local directory (a Hub ID's snapshot) and the work directory, made
    and checked against the settings it was made with: either is a usage error naming
    the problem before any work."""
    from vllm_graft.offline.models import ModelNotFoundError, local_model_dir
    from vllm_graft.training.data import WorkDirError, check_work_settings

    try:
        model = local_model_dir(args.model)
    except ModelNotFoundError as err:
        parser.error(str(err))
    work = args.work_dir or args.out.with_name(args.out.name + ".work")
    work.mkdir(parents=True, exist_ok=True)
    try:
        check_work_settings(work, training_data_settings(args, model))
    except WorkDirError as error:
        parser.error(str(error))
    return model, work


def engine_budget(parser, args, chains: bool) -> int:
    """``--budget`` as given, or its default for trees or chains; a chain longer than
    Graft-TAIL takes is a usage error naming the flag."""
    if args.budget is None:
        return DEFAULT_TAIL_LENGTH if chains else PAPER_BUDGET
    if chains and args.budget > MAX_TAIL_LENGTH:
        parser.error(f"--budget: Graft-TAIL chains take at most {MAX_TAIL_LENGTH} tokens, "
                     f"got {args.budget}")
    return args.budget


def add_engine_arguments(parser) -> None:
    """The arguments every engine-driving tool takes after MODEL, the engine options
    included."""
    parser.add_argument("--head", required=True,
                        help="EAGLE-3 head directory or Hub ID (or the draft model, see "
                        "--drafter)")
    parser.add_argument("--drafter", choices=["eagle3", "draft_model", "dflash"],
                        default="eagle3", help="what --head is: an EAGLE-3 head, an "
                        "ordinary draft model, or a DFlash block drafter (Graft-TAIL)")
    parser.add_argument("--max-tokens", type=int, default=256,
                        help="tokens generated per conversation")
    parser.add_argument("--budget", type=int, default=None,
                        help=f"tree nodes (default {PAPER_BUDGET}), or Graft-TAIL chain "
                             f"tokens (default {DEFAULT_TAIL_LENGTH}, at most "
                             f"{MAX_TAIL_LENGTH})")
    parser.add_argument("--out", type=Path, required=True, help="file to write")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="datasets (default: $VLLM_GRAFT_CACHE or ~/.cache/vllm-graft)")
    add_engine_options(parser)
