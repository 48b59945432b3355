"""Plain-text tables whose columns fit their widest cell: names are never cut, columns never drift."""

from __future__ import annotations

__all__ = ["aligned"]


def aligned(rows: list, right: frozenset[int] | set[int] = frozenset()) -> list[str]:
    """Lines of a table. Each row is a tuple of cells (the first one the header), or a plain string that is
    kept as it is (a note under a row). Column i is as wide as its widest cell, right-aligned when i is in
    ``right``; the last column is not padded. Two spaces between columns."""
    cells = [tuple(str(c) for c in row) for row in rows if not isinstance(row, str)]
    if not cells:
        return [row for row in rows if isinstance(row, str)]
    columns = max(len(row) for row in cells)
    widths = [max((len(row[i]) for row in cells if i < len(row)), default=0) for i in range(columns)]
    lines = []
    for row in rows:
        if isinstance(row, str):
            lines.append(row)
            continue
        out = []
        for i, cell in enumerate(str(c) for c in row):
            last = i == len(row) - 1
            if i in right:
                out.append(cell.rjust(widths[i]))
            else:
                out.append(cell if last else cell.ljust(widths[i]))
        lines.append("  ".join(out).rstrip())
    return lines
