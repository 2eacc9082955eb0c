"""String-key lookups per 1,000 lines of src/: how much of the code still passes dicts around.

A lookup is `x["literal"]` or `x.get("literal", ...)` / `x.pop("literal", ...)` /
`x.setdefault("literal", ...)` with a string constant key. Not counted (they are not records
passed between our functions): keys that name a column of the op table or the run format
(`trace.model.COLUMNS` and the optional columns: table columns are the data, not a record),
`os.environ[...]`, HTTP `headers`/`query_params`/`cookies`, `sys.modules`, `__dict__`,
`globals()`, calls whose first argument is a URL path (`app.get("/api/jobs")` declares a
route, it looks nothing up), and quoted forward references in a generic type
(`list["JsonValue"]` names a type). Reports the total, the rate and the files with the most lookups.

Also counts the public functions and methods (no leading underscore, in a module without one)
whose return annotation says nothing of its fields: `Any`, a container of `Any` or `object`, or
a bare `dict`/`Mapping` (typed maps such as `dict[int, float]` are not counted).

    .venv/bin/python benchmarks/code_metrics.py [--top 15] [--json]

Without --json the figures are also written to benchmarks/results/code_metrics.json.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "stragglers"
# Receivers whose string keys are protocol or environment names, not our records.
_EXEMPT_RECEIVERS = {"environ", "headers", "query_params", "cookies", "modules", "__dict__"}
# Builtin generics: `list["X"]` is a type with a forward reference, not a lookup.
_TYPES = {"list", "dict", "tuple", "set", "frozenset", "type"}
_METHODS = {"get", "pop", "setdefault"}
_UNTYPED = {"dict", "Dict", "Mapping", "MutableMapping"}


def column_names() -> set[str]:
    """Names of the op table's columns (required and optional)."""
    sys.path.insert(0, str(ROOT / "src"))
    from stragglers.trace.model import COLUMNS, OPTIONAL_COLUMNS

    return set(COLUMNS) | set(OPTIONAL_COLUMNS)


def _receiver_name(node: ast.expr) -> str:
    """The last name of the object a lookup is made on (`a.b.c` -> `c`, `f()` -> `f`)."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call):
        return _receiver_name(node.func)
    return ""


def lookups(tree: ast.AST, columns: set[str]) -> int:
    """Number of counted string-key lookups in one module."""
    n = 0
    for node in ast.walk(tree):
        key: object = None
        receiver: ast.expr | None = None
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            key, receiver = node.slice.value, node.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in _METHODS and node.args
              and isinstance(node.args[0], ast.Constant)):
            key, receiver = node.args[0].value, node.func.value
        if not isinstance(key, str) or receiver is None:
            continue
        if (key in columns or key.startswith("/")
                or _receiver_name(receiver) in _EXEMPT_RECEIVERS | {"globals"}
                or (isinstance(receiver, ast.Name) and receiver.id in _TYPES)):
            continue
        n += 1
    return n


def _untyped(annotation: ast.expr) -> bool:
    """Whether a return annotation says nothing of its fields: `Any`, `object` inside a
    container, or a bare `dict`/`Mapping` (a typed map such as `dict[int, float]` is not)."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body  # a quoted annotation
        except SyntaxError:
            return False
    for node in ast.walk(annotation):
        name = node.id if isinstance(node, ast.Name) else \
            node.attr if isinstance(node, ast.Attribute) else None
        if name == "Any" or (name == "object" and node is not annotation):
            return True
    bare = annotation.id if isinstance(annotation, ast.Name) else \
        annotation.attr if isinstance(annotation, ast.Attribute) else None
    return bare in _UNTYPED


def untyped_returns(tree: ast.AST, module: str) -> list[str]:
    """`module:function` of each public function whose return annotation is untyped."""
    return [f"{module}:{node.name}" for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and not node.name.startswith("_") and node.returns is not None
            and _untyped(node.returns)]


@dataclasses.dataclass
class Metrics:
    """What one measurement of src/ found."""

    lookups: int
    lines: int
    per_1000_lines: float
    files: dict[str, int]           # lookups per module, most first
    untyped_returns: list[str]      # module:function whose return annotation is untyped


def measure(src: Path = SRC) -> Metrics:
    """Totals and per-file counts over every module under `src`."""
    columns = column_names()
    per_file: Counter[str] = Counter()
    untyped: list[str] = []
    lines = 0
    for path in sorted(src.rglob("*.py")):
        text = path.read_text()
        lines += text.count("\n")
        name = str(path.relative_to(src))
        tree = ast.parse(text)
        per_file[name] = lookups(tree, columns)
        if not any(part.startswith("_") and part != "__init__.py" for part in path.parts[-1:]):
            untyped += untyped_returns(tree, name)
    total = sum(per_file.values())
    return Metrics(lookups=total, lines=lines, per_1000_lines=round(1000 * total / lines, 2),
                   files=dict(per_file.most_common()), untyped_returns=untyped)


def main() -> None:
    """Print the rate and the files with the most lookups."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json", action="store_true", help="print everything as JSON")
    args = ap.parse_args()
    m = measure()
    if args.json:
        print(json.dumps(dataclasses.asdict(m), indent=1))
        return
    print(f"{m.lookups} string-key lookups in {m.lines} lines: "
          f"{m.per_1000_lines} per 1,000 lines (goal < 8)")
    for name, count in list(m.files.items())[:args.top]:
        print(f"  {count:5d}  {name}")
    print(f"{len(m.untyped_returns)} public functions return Any, dict[str, Any] or a bare dict")
    by_file = Counter(f.split(":")[0] for f in m.untyped_returns)
    for name, count in by_file.most_common(args.top):
        print(f"  {count:5d}  {name}")
    print(f"wrote {record(m)}")


def record(m: Metrics) -> Path:
    """Write the two figures (and the functions still untyped) to results/code_metrics.json."""
    from results import Figure, Run, write  # noqa: PLC0415  (its load sampler: only when written)

    return write(Run(
        benchmark="Code metrics: string-key lookups and untyped returns", issue="33",
        command=".venv/bin/python benchmarks/code_metrics.py",
        figures=[
            Figure(name="string-key lookups outside table columns, per 1,000 lines of src/",
                   value=f"{m.per_1000_lines} ({m.lookups} in {m.lines:,} lines)", goal="< 8",
                   met=m.per_1000_lines < 8, anchor="torchtitan and httpx ~6 (issue 33)"),
            Figure(name="public functions returning Any, dict[str, Any] or a bare dict",
                   value=str(len(m.untyped_returns)), goal="0 between detector and JSON",
                   met=not m.untyped_returns,
                   note="the functions are listed in the table; JSON encoders typed as "
                        "JsonValue/JsonObject or a TypedDict are not counted")],
        table=[{"function": f} for f in m.untyped_returns]))

if __name__ == "__main__":
    main()
