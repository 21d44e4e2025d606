"""``bench/results/`` stays a small canonical set: every results path the README and the
docs name exists, the directory holds at most twelve entries besides ``LOG.md`` and
``README.md``, and each of them has its line in ``LOG.md`` (runs that are no longer
evidence for a claim live in the history, listed there)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MAX_ENTRIES = 12
PATH = re.compile(r"bench/results/[\w./-]*")


def documents() -> list[Path]:
    return [ROOT / "README.md", RESULTS / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def named_paths(text: str) -> set[str]:
    """The ``bench/results/...`` paths in ``text``, less placeholders such as
    ``bench/results/NAME`` (a component in capitals without a dot)."""
    paths = set()
    for match in PATH.findall(text):
        path = match.rstrip(".,:;")
        if any(part.isupper() and "." not in part for part in path.split("/")):
            continue
        paths.add(path)
    return paths


def test_named_results_exist():
    missing = [f"{doc.relative_to(ROOT)}: {path}" for doc in documents() if doc.is_file()
               for path in sorted(named_paths(doc.read_text())) if not (ROOT / path).exists()]
    assert not missing, "results named but not in bench/results:\n" + "\n".join(missing)


def test_results_are_a_small_canonical_set():
    entries = sorted(p.name for p in RESULTS.iterdir() if p.name not in ("LOG.md", "README.md"))
    assert len(entries) <= MAX_ENTRIES, (
        f"bench/results holds {len(entries)} entries (at most {MAX_ENTRIES}): move superseded "
        f"runs to the history and list them in LOG.md: {entries}")
    log = (RESULTS / "LOG.md").read_text()
    unlogged = [name for name in entries if f"| {name}" not in log]
    assert not unlogged, f"bench/results entries without a line in LOG.md: {unlogged}"
    kept = re.findall(r"^\| [\d-]+ \| ([^ |]+) \|.*\| kept \|$", log, re.MULTILINE)
    assert kept and all((RESULTS / run).exists() for run in kept), kept


def test_named_paths_skip_placeholders():
    text = "`bench/results/NAME` and bench/results/gpu/2026-12-04-h200/README.md, and bench/results/x/."
    assert named_paths(text) == {"bench/results/gpu/2026-12-04-h200/README.md", "bench/results/x/"}
