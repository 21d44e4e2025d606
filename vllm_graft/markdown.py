"""Markdown tables for the reports that benchmarks and scripts write.

Plain strings only (no vLLM, no torch), so the GPU check, which runs where vLLM is not
installed, renders its tables with the same code as the benchmark."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[object]],
                   align: str | None = None, cell: Callable[[object], str] = str
                   ) -> list[str]:
    """The lines of a Markdown table: a header of ``columns``, then one line per row.
    ``align``: one letter per column, ``l`` (left) or ``r`` (right); all left when
    omitted. ``cell`` renders every value that is not already a string."""
    align = align or "l" * len(columns)
    if len(align) != len(columns) or set(align) - {"l", "r"}:
        raise ValueError(f"align needs one of 'l' or 'r' per column ({len(columns)}), "
                         f"got {align!r}")
    lines = [_line(columns), "|" + "".join("---:|" if a == "r" else "---|" for a in align)]
    for row in rows:
        row = list(row)
        if len(row) != len(columns):
            raise ValueError(f"a table row has {len(row)} cells for {len(columns)} "
                             f"columns: {row}")
        lines.append(_line(value if isinstance(value, str) else cell(value)
                           for value in row))
    return lines


def records_table(records: Sequence[Mapping[str, object]],
                  columns: Sequence[str] | None = None, align: str | None = None,
                  cell: Callable[[object], str] = str) -> list[str]:
    """:func:`markdown_table` of dictionaries: ``columns`` (default: the first
    record's keys) read from each; a missing key is an empty cell."""
    if columns is None and not records:
        raise ValueError("a table of no records needs its columns")
    columns = list(records[0]) if columns is None else list(columns)
    return markdown_table(columns, ([record.get(c, "") for c in columns]
                                    for record in records), align, cell)


def _line(cells: Iterable[str]) -> str:
    return "| " + " | ".join(cells) + " |"
