"""How the engine writes a figure and a table for people: one byte formatter, one table renderer.

Why one module: the same quantity used to read "7.1 GiB" in one place and "7056.1 MiB" in another,
and tables cut cells to "layer1.…" at 80 columns. Every byte count a command prints goes through
``format_bytes`` (one rule: B below 1 KiB, KiB below 1 MiB, MiB below 1 GiB, then GiB; one decimal,
two for GiB), and every table goes through ``render_table``, which never truncates a cell:

- on a terminal wide enough, a rich table;
- on a narrow terminal, one ``key: value`` block per row (the table's own words, nothing cut);
- piped or redirected, plain text columns as wide as the widest cell (no box drawing, no width limit),
  so ``grep`` and a README see the same words.

``table_dict`` gives the same table as JSON rows (``--json`` of every command that prints a table).
This module imports nothing of the engine: everything above it may use it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

_UNITS = (("GiB", 2**30, 2), ("MiB", 2**20, 1), ("KiB", 2**10, 1))


def format_bytes(nbytes: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; None -> ``"n/a"``. The one rule every printed byte count follows."""
    if nbytes is None or (isinstance(nbytes, float) and math.isnan(nbytes)):
        return "n/a"
    size = abs(nbytes)
    for unit, scale, decimals in _UNITS:
        if size >= scale:
            return f"{nbytes / scale:.{decimals}f} {unit}"
    return f"{int(nbytes)} B"


def format_seconds(seconds: float | None) -> str:
    """Milliseconds below a second, seconds above; None -> ``"n/a"``."""
    if seconds is None or math.isnan(seconds):
        return "n/a"
    return f"{1e3 * seconds:.1f} ms" if abs(seconds) < 1 else f"{seconds:.1f} s"


@dataclass
class Table:
    """A titled table: column names, rows of cell strings, optional section breaks and a footer."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    right: set[int] = field(default_factory=set)  # right-aligned columns (numbers)
    sections: set[int] = field(default_factory=set)  # a rule before these row indices
    notes: list[str] = field(default_factory=list)  # lines printed under the table
    show_header: bool = True

    def add_row(self, *cells: Any) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"table {self.title!r}: {len(cells)} cells for {len(self.columns)} columns")
        self.rows.append([str(c) for c in cells])

    def add_section(self) -> None:
        self.sections.add(len(self.rows))

    def width(self) -> int:
        """Characters the plain layout needs (two spaces between columns)."""
        widths = [max([len(c)] + [len(r[i]) for r in self.rows]) for i, c in enumerate(self.columns)]
        return sum(widths) + 2 * (len(widths) - 1)


def table_dict(table: Table) -> dict[str, Any]:
    """The table as JSON: ``{"title", "columns", "rows": [{column: cell}], "notes"}``."""
    return {"title": table.title, "columns": list(table.columns),
            "rows": [dict(zip(table.columns, row)) for row in table.rows], "notes": list(table.notes)}


def plain_lines(table: Table) -> list[str]:
    """The plain-text layout: aligned columns as wide as their widest cell, nothing cut."""
    widths = [max([len(c) if table.show_header else 0] + [len(r[i]) for r in table.rows])
              for i, c in enumerate(table.columns)]

    def line(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if i in table.right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(parts).rstrip()

    out = [table.title] if table.title else []
    if table.show_header:
        out += [line(table.columns), line(["-" * w for w in widths])]
    for index, row in enumerate(table.rows):
        if index in table.sections and index:
            out.append(line(["-" * w for w in widths]))
        out.append(line(row))
    return out + table.notes


def key_value_lines(table: Table) -> list[str]:
    """The narrow layout: one block per row, ``column: cell`` per line; wraps nothing, cuts nothing."""
    out = [table.title] if table.title else []
    for row in table.rows:
        if table.show_header:
            out.append(f"- {row[0]}")
            out += [f"    {c}: {v}" for c, v in zip(table.columns[1:], row[1:]) if v]
        else:
            out.append(f"{row[0]}: {'  '.join(v for v in row[1:] if v)}")
    return out + table.notes


def make_console() -> Any:
    """A rich Console that wraps nothing when piped (a summary line is one line in a log or a README)."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(soft_wrap=True)
    return console


def render_table(table: Table, console: Any = None) -> None:
    """Print ``table`` in the layout that fits where it goes (module docstring); ``console``: a rich Console."""
    if console is None:
        console = make_console()
    if not console.is_terminal or table.width() + 3 * len(table.columns) + 1 > console.width:
        lines = plain_lines(table) if not console.is_terminal else key_value_lines(table)
        for text in [*lines, ""]:
            console.print(text, markup=False, highlight=False, soft_wrap=True)
        return
    from rich.table import Table as RichTable

    rich_table = RichTable(title=table.title, title_justify="left", show_header=table.show_header)
    for i, column in enumerate(table.columns):
        rich_table.add_column(column, justify="right" if i in table.right else "left", no_wrap=True,
                              overflow="fold")
    for index, row in enumerate(table.rows):
        if index in table.sections and index:
            rich_table.add_section()
        rich_table.add_row(*row)
    console.print(rich_table)
    for note in table.notes:
        console.print(note, markup=False, highlight=False, soft_wrap=True)


__all__ = [
    "Table", "format_bytes", "format_seconds", "key_value_lines", "make_console", "plain_lines", "render_table",
    "table_dict",
]
