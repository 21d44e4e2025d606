"""What ``vllm-graft generate`` shows a person: answers coloured by token source, one
comparison table, a spinner while engines start, and engine logs kept out of the way.

Colours need a terminal; piped or redirected, the same view is plain text and each
answer is followed by a strip with one letter per token (``d`` drafted, ``r``
retrieved, ``b`` both, ``c`` copied from the context, ``p`` padding, ``.`` target), so
the sources survive copying.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from pathlib import Path

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from vllm_graft.cli.sources import BOTH, CONTEXT, DRAFT, LABELS, PADDING, RETRIEVED, TARGET

STYLES = {DRAFT: "bold cyan", RETRIEVED: "bold magenta", BOTH: "bold green",
          CONTEXT: "bold blue", PADDING: "yellow", TARGET: ""}
LETTERS = {DRAFT: "d", RETRIEVED: "r", BOTH: "b", CONTEXT: "c", PADDING: "p", TARGET: "."}
DESCRIPTIONS = {DRAFT: "accepted, drafted by the head", RETRIEVED: "accepted, retrieved "
                "from the successor matrix", BOTH: "accepted, drafted and retrieved",
                CONTEXT: "accepted, copied from the prompt or earlier output",
                PADDING: "accepted padding node", TARGET: "produced by the target itself"}


def answer_text(pieces: list[str], sources: list[str]) -> Text:
    """The answer with each token's text styled by its source."""
    text = Text()
    for piece, source in zip(pieces, sources):
        text.append(piece, style=STYLES[source] or None)
    return text


def source_strip(sources: list[str]) -> str:
    return "".join(LETTERS[s] for s in sources)


def legend(counts: Counter | None = None) -> Text:
    """One line naming each colour (with counts when given); padding only when seen."""
    text = Text()
    for label in LABELS:
        if label in (PADDING, CONTEXT) and not (counts and counts[label]):
            continue
        if text:
            text.append("  ")
        name = label if label != TARGET else "target"
        shown = f"{name} {counts[label]}" if counts is not None else name
        text.append(shown, style=STYLES[label] or "underline")
    return text


def show_answer(console: Console, prompt: str, pieces: list[str], sources: list[str] | None
                ) -> None:
    """Prompt, then answer: coloured by source on a terminal, plain text with the letter
    strip otherwise (lines not broken by the console); without
    sources (plain decoding) just the text."""
    terminal = console.is_terminal
    options = {} if terminal else {"soft_wrap": True}
    console.print(Text("prompt  ", style="bold") + Text(prompt.strip()), **options)
    if sources is not None and terminal:
        console.print(Text("answer  ", style="bold") + answer_text(pieces, sources))
        console.print(Text("        ") + legend(Counter(sources)))
    else:
        console.print(Text("answer  ", style="bold") + Text("".join(pieces)), **options)
        if sources is not None:
            console.print("sources " + source_strip(sources), markup=False, **options)
    console.print()


def _fmt(value, pattern: str = "{:.2f}", missing: str = "-") -> str:
    return missing if value is None else pattern.format(value)


def comparison_table(report: dict) -> Table | Group:
    """Graft next to plain decoding: the numbers a user compares. MAT = mean tokens
    emitted per target forward (1 for plain decoding by definition)."""
    graft, plain = report["graft"], report.get("plain")
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("")
    table.add_column("Graft", justify="right")
    if plain is not None:
        table.add_column("plain", justify="right")
    hit = graft.get("matrix_hit_rate")
    rows = [
        ("tokens/s", _fmt(graft["tokens_per_s"], "{:.1f}"),
         _fmt(plain and plain["tokens_per_s"], "{:.1f}")),
        ("MAT (tokens / target step)", _fmt(graft.get("mean_accepted_tokens")), "1.00"),
        ("speedup", _fmt(report.get("speedup"), "{:.2f}x"), "1.00x"),
        ("draft forwards / step", _fmt(graft.get("draft_forwards_per_tree")), "0"),
        ("matrix hit rate", _fmt(hit and hit * 100, "{:.0f} %"), "-"),
    ]
    modes = graft.get("steps_by_mode")
    if modes:
        rows.append(("steps: tree / chain / plain",
                     " / ".join(str(modes[m]) for m in ("tree", "chain", "plain")), "-"))
    alone = graft.get("one_at_a_time")
    if alone is not None:
        plain_alone = (plain or {}).get("one_at_a_time") or {}
        rows += [("one at a time: tokens/s", _fmt(alone["tokens_per_s"], "{:.1f}"),
                  _fmt(plain_alone.get("tokens_per_s"), "{:.1f}")),
                 ("one at a time: MAT", _fmt(alone.get("mean_accepted_tokens")), "1.00"),
                 ("one at a time: speedup",
                  _fmt(report.get("speedup_one_at_a_time"), "{:.2f}x"), "1.00x")]
    if "greedy_identical" in report:
        rows.append(("greedy output identical",
                     "yes" if report["greedy_identical"] else "NO", "reference"))
    for name, graft_value, plain_value in rows:
        table.add_row(name, graft_value, *([plain_value] if plain is not None else []))
    warmup = report.get("warmup_tokens")
    if not warmup:
        return table
    return Group(table, Text(f"timed after each engine's untimed warm-up ({warmup} tokens "
                             "a prompt)", style="dim"))


@contextlib.contextmanager
def engine_logs_to(path: Path | None):
    """Send file descriptors 1 and 2 to ``path`` (None: leave them) and yield the
    console for the person at the terminal. Descriptors, not ``sys.stdout``: engine
    processes inherit them, and vLLM, tqdm and warnings write to them directly."""
    if path is None:
        yield Console(highlight=False), Console(stderr=True, highlight=False)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    out, err = os.fdopen(os.dup(saved[0]), "w"), os.fdopen(os.dup(saved[1]), "w")
    with open(path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield Console(file=out, highlight=False), Console(file=err, highlight=False)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        out.close()
        err.close()


def log_tail(path: Path, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""
