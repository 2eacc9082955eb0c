"""How lists of numbers, and text read from files, are written in messages and reports, once
for the whole package."""

from __future__ import annotations

import re
from typing import Any, Sequence

# Characters a terminal acts on rather than shows: C0 controls but tab and newline, DEL, C1
# controls, and the bidirectional overrides and isolates that reorder what is shown. A run
# file's name holding ESC[2J cleared the operator's screen (rich drops BEL, not ESC).
# Also surrogates: a file name whose bytes are not UTF-8 (b'run-\xff') comes from os as a
# surrogate escape ('\udcff') that no encoder takes (JSON replies, SQLite, hashes were 500s).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069"
                      "\ud800-\udfff]")


def _escape(m: re.Match) -> str:
    c = m.group()
    if "\udc80" <= c <= "\udcff":   # (a byte os.fsdecode could not decode: shown as that byte)
        return f"\\x{ord(c) - 0xdc00:02x}"
    return ascii(c)[1:-1]


def printable(text: str) -> str:
    """`text` with every control character written as its escape (ESC as \\x1b), and each
    byte of a file name that is not UTF-8 as \\xNN (its surrogate escape: b'\\xff' as \\xff)."""
    return _CONTROL.sub(_escape, text)


def utf8(text: object) -> bool:
    """Whether str(text) (a path) encodes as UTF-8: False for a file name whose bytes are not
    UTF-8 (os gives it as surrogate escapes), which text columns, JSON and str.encode refuse."""
    try:
        str(text).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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
