"""Two analysis results compared number by number (the partitioned paths against one process)."""

from __future__ import annotations

import json
import math


def assert_same(reference, other) -> None:
    """Every number of the two results within 1e-9 (relative), everything else equal."""
    a, b = json.loads(reference.to_json()), json.loads(other.to_json())
    assert math.isclose(a["slowdown"], b["slowdown"], rel_tol=0, abs_tol=1e-9)
    close(a, b, "result")


def close(a, b, where: str) -> None:
    """Numbers within 1e-9 (relative), anything else equal, recursively; `where` names the place."""
    if isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12), (where, a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            close(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)
