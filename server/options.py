"""What the head's commands share: option groups, reading them, and the plain-text table they print."""

from __future__ import annotations

from typing import Container, List


def table(rows: List[List[str]], right: Container[int] = ()) -> str:
    """Rows of cells in aligned columns; columns whose index is in ``right`` (numbers) align right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def cell(j: int, c: str) -> str:
        return c.rjust(widths[j]) if j in right else c.ljust(widths[j])

    return "\n".join("  ".join(cell(j, c) for j, c in enumerate(r)).rstrip() for r in rows)
