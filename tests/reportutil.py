"""Helpers for tests of what ``simulate`` prints: its lines, and a printed table's cells by run."""

from __future__ import annotations


def printed(emitted: list[str]) -> list[str]:
    """Every printed line (``emit`` may be given several lines at once)."""
    return [line for text in emitted for line in text.split("\n")]


def table(emitted: list[str], title: str) -> tuple[list[str], dict[str, list[str]]]:
    """The column headings and, per run name, the cells of the first table titled ``title``.

    A table is its title, one or two lines of headings, a rule of dashes, then a row per
    run (``#``, name, cells) up to the first line that is not a row (a legend, a blank).
    """
    lines = printed(emitted)
    start = lines.index(title)
    rule = next(i for i in range(start, len(lines)) if lines[i] and set(lines[i]) == {"-"})
    heads = lines[rule - 1].split()[2:]  # after "#" and "run"
    rows: dict[str, list[str]] = {}
    for line in lines[rule + 1 :]:
        cells = line.split()
        if not cells or not cells[0].isdigit():
            break
        rows[cells[1]] = cells[2:]
    return heads, rows
