"""The package import graph of src/stragglers, read from the code with `ast`.

    python docs/package_graph.py            # a Mermaid diagram (what docs/architecture.md holds)
    python docs/package_graph.py --text     # one line per package: what it imports
    python docs/package_graph.py --check    # exit 1 if the graph between packages has a cycle
    python docs/package_graph.py --hide errors,lazy   # leave nodes out of the diagram

A node is a sub-package (`trace`, `whatif`, ...) or a top-level module (`errors`, `config`, ...).
An edge A -> B means some module of A imports from B, at module level or inside a function
(lazy imports count: they are dependencies all the same). Each package's `commands.py` belongs
to the command-line node `cli`. Imports within one node, of the lazy public facade `stragglers`
itself and under `if TYPE_CHECKING:` are left out.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "stragglers"


def node_of(module: str) -> str | None:
    """The graph node of a dotted module name: `stragglers.whatif.grid` -> `whatif`.

    A package's `commands.py` (its `stragglers` sub-commands, which cli.py loads by name) and
    `__main__.py` (`python -m stragglers.monitor`) are
    part of the command-line layer, `cli`, not of the package they drive.
    """
    parts = module.split(".")
    if parts[0] != "stragglers" or len(parts) < 2:
        return None
    if len(parts) > 2 and parts[2] in ("commands", "__main__"):
        return "cli"
    if not ((SRC / parts[1]).is_dir() or (SRC / f"{parts[1]}.py").exists()):
        return None   # `from stragglers import x`: x is a name of the facade, not a module
    return parts[1]


def module_name(path: Path) -> str:
    """`src/stragglers/whatif/grid.py` -> `stragglers.whatif.grid`."""
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def type_checking_lines(tree: ast.AST) -> set[int]:
    """Line numbers inside `if TYPE_CHECKING:` blocks (imports for annotations only)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imported_modules(path: Path) -> set[str]:
    """Absolute names of the stragglers modules a file imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = type_checking_lines(tree)
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("stragglers.")}


def package_graph() -> dict[str, set[str]]:
    """node -> the nodes it imports from."""
    graph: dict[str, set[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        source = node_of(module_name(path))
        if source is None:
            continue
        targets = graph.setdefault(source, set())
        for name in imported_modules(path):
            target = node_of(name)
            if target and target != source:
                targets.add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def mermaid(graph: dict[str, set[str]], hide: set[str]) -> str:
    """The graph as a Mermaid flowchart, packages as boxes and top-level modules as rounded."""
    graph = {node: targets - hide for node, targets in graph.items() if node not in hide}
    lines = ["flowchart LR"]
    for node in sorted(graph):
        shape = f"{node}[{node}/]" if (SRC / node).is_dir() else f"{node}({node}.py)"
        lines.append(f"    {shape}")
    for source in sorted(graph):
        for target in sorted(graph[source]):
            lines.append(f"    {source} --> {target}")
    return "\n".join(lines)


def main() -> int:
    """Print the graph (Mermaid or text) or check it for cycles."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", action="store_true", help="one line per package")
    parser.add_argument("--check", action="store_true", help="exit 1 on an import cycle")
    parser.add_argument("--hide", default="", help="comma-separated nodes left out of the diagram")
    args = parser.parse_args()
    graph = package_graph()
    if args.check:
        found = cycles(graph)
        for component in found:
            print("cycle among:", ", ".join(component))
        print("no cycle between packages" if not found else "")
        return 1 if found else 0
    if args.text:
        for node in sorted(graph):
            print(f"{node:12} -> {', '.join(sorted(graph[node])) or '(nothing)'}")
        return 0
    print(mermaid(graph, set(filter(None, args.hide.split(",")))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
