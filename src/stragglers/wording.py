"""How lists of numbers, and text read from files, are written in messages and reports, once
for the whole package."""

from __future__ import annotations

import re
from typing import Any, Sequence

# Characters a terminal acts on rather than shows: C0 controls but tab and newline, DEL, C1
# controls, and the bidirectional overrides and isolates that reorder what is shown. A run
# file's name holding ESC[2J cleared the operator's screen (rich drops BEL, not ESC).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` with every control character written as its escape (ESC as \\x1b)."""
    return _CONTROL.sub(lambda m: ascii(m.group())[1:-1], text)


def printable_all(value: Any) -> Any:
    """`value` (JSON-like: dicts, lists, strings) with `printable` applied to every string."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable_all(k): printable_all(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [printable_all(v) for v in value]
    return value


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
