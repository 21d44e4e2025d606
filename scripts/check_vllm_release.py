"""Which Graft patches another vLLM release would break, read from its sources.

Compares the fingerprints of :mod:`vllm_graft.vllm.fingerprints` (signatures, and
source hashes where Graft depends on a body) with a release's ``.py`` files, parsed with
``ast``; nothing is installed or imported from the release, so any version can be
checked next to the pinned one:

    python -m pip download --no-deps vllm==0.33.0 -d /tmp/vllm-0.33.0
    .venv/bin/python scripts/check_vllm_release.py /tmp/vllm-0.33.0/vllm-0.33.0-*.whl
    .venv/bin/python scripts/check_vllm_release.py SITE_PACKAGES/vllm   # an installed one

SOURCE is a wheel, a directory holding the ``vllm`` package (site-packages, an unpacked
wheel, a source checkout), or the ``vllm`` package directory itself. Prints a Markdown
table (symbol, Graft patch, status, what differs) and exits 1 when anything differs.
"""

from __future__ import annotations

import argparse
import re
import sys
import zipfile
from pathlib import Path
from typing import Callable

from vllm_graft.markdown import markdown_table
from vllm_graft.vllm.fingerprinting import (Fingerprint, Observed, SymbolMissing,
                                            fingerprint_from_source, find_mismatches)
from vllm_graft.vllm.fingerprints import FINGERPRINTS, FINGERPRINTS_VLLM_VERSION


def source_reader(source: Path) -> Callable[[str], str | None]:
    """A function from a path inside the release (``vllm/config/vllm.py``) to its text,
    or None when the release has no such file."""
    if source.is_file() and zipfile.is_zipfile(source):
        archive = zipfile.ZipFile(source)
        names = set(archive.namelist())
        return lambda path: archive.read(path).decode() if path in names else None
    root = source.parent if (source / "__init__.py").is_file() and source.name == "vllm" \
        else source
    if not (root / "vllm" / "__init__.py").is_file():
        raise SystemExit(f"{source}: neither a wheel nor a directory with the vllm package")

    def read(path: str) -> str | None:
        file = root / path
        return file.read_text() if file.is_file() else None

    return read


def release_version(read: Callable[[str], str | None]) -> str:
    text = read("vllm/_version.py") or ""
    match = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", text)
    return match.group(1) if match else "unknown"


def observer(read: Callable[[str], str | None]) -> Callable[[Fingerprint], Observed]:
    """Fingerprints of the release's symbols, the module found as ``a/b.py`` or
    ``a/b/__init__.py`` (parsed once per module)."""
    modules: dict[str, str | None] = {}

    def observe(fingerprint: Fingerprint) -> Observed:
        if fingerprint.module not in modules:
            base = fingerprint.module.replace(".", "/")
            modules[fingerprint.module] = read(f"{base}.py") or read(f"{base}/__init__.py")
        text = modules[fingerprint.module]
        if text is None:
            raise SymbolMissing(f"module {fingerprint.module} is not in this release")
        return fingerprint_from_source(text, fingerprint)

    return observe


def report(source: Path) -> tuple[str, bool]:
    """The Markdown table for ``source`` and whether every fingerprint matched."""
    read = source_reader(source)
    mismatches = {m.symbol: m for m in find_mismatches(FINGERPRINTS, observer(read))}
    rows = []
    for fingerprint in FINGERPRINTS:
        found = mismatches.get(fingerprint.symbol)
        symbol = fingerprint.symbol.removeprefix("vllm.")
        patch = fingerprint.patched_by or "(relied on)"
        status, detail = ("ok", "") if found is None else (found.status, found.detail)
        rows.append([f"`{symbol}`", patch, status, detail])
    lines = [f"vLLM {release_version(read)} against the fingerprints of vLLM "
             f"{FINGERPRINTS_VLLM_VERSION} ({len(mismatches)} of {len(FINGERPRINTS)} differ)",
             "", *markdown_table(["vLLM symbol", "Graft patch", "status", "what differs"],
                                 rows)]
    return "\n".join(lines) + "\n", not mismatches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, metavar="SOURCE_DIR_OR_WHEEL")
    args = parser.parse_args(argv)
    table, all_ok = report(args.source)
    print(table, end="")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
