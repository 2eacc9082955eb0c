"""How lists of numbers are written in messages and reports, once for the whole package."""

from __future__ import annotations

from typing import Sequence


def ranges(values: Sequence[int], dash: str = "-") -> str:
    """Compact '1-3, 7' rendering of sorted integers (reports pass dash='–')."""
    out, i = [], 0
    values = list(values)
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        out.append(f"{values[i]}" if i == j else f"{values[i]}{dash}{values[j]}")
        i = j + 1
    return ", ".join(out)
