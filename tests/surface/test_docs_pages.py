"""What docs/ states about the code is the code's: architecture.md's package diagram is the one
docs/package_graph.py draws, report.md's table of causes names every cause the diagnosis can
report, and the examples a README calls runnable run and print what they say."""

from __future__ import annotations

import functools
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "architecture.md"
REPORT_PAGE = REPO / "docs" / "report.md"


@functools.cache
def package_graph_module():
    """docs/package_graph.py, imported from its path (docs/ is no package)."""
    spec = importlib.util.spec_from_file_location("package_graph",
                                                  REPO / "docs" / "package_graph.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def graph() -> dict[str, set[str]]:
    """The import graph of src/stragglers between packages, read once for both tests."""
    return package_graph_module().package_graph()


@pytest.mark.slow   # reads every module of src/ with ast (about 1 s of CPU)
def test_the_diagram_is_the_graph_of_the_code() -> None:
    """A new import between packages changes the diagram; the page must be regenerated with
    the command it shows (its --hide list included)."""
    text = PAGE.read_text()
    hide = re.search(r"docs/package_graph\.py --hide (\S+)", text)
    diagram = re.search(r"```mermaid\n(.*?)```", text, re.S)
    assert hide and diagram, "docs/architecture.md lost its diagram or the command that draws it"
    pg = package_graph_module()
    drawn = pg.mermaid(graph(), set(hide.group(1).split(",")))
    assert diagram.group(1).strip() == re.sub(r"^```mermaid\n|```$", "", drawn.strip()).strip(), (
        "docs/architecture.md's diagram is stale: rerun .venv/bin/python docs/package_graph.py "
        f"--hide {hide.group(1)}")


@pytest.mark.slow   # reads every module of src/ with ast (about 1 s of CPU)
def test_the_packages_have_no_import_cycle() -> None:
    """The page says there is none; the graph of the code agrees."""
    assert package_graph_module().cycles(graph()) == []


def test_the_report_page_explains_every_cause() -> None:
    """A cause the diagnosis can name (it has a fix) is a row of docs/report.md's cause table,
    and the table names no cause the code does not know."""
    from stragglers.whatif.diagnosis import FIXES

    rows = set(re.findall(r"^\| `(\w+)` \|", REPORT_PAGE.read_text(), re.M))
    verdicts = {"none", "unexplained", "partial"}   # findings without a fix, and a partial trace
    assert set(FIXES) <= rows, f"docs/report.md explains no {sorted(set(FIXES) - rows)}"
    unknown = rows - verdicts - set(FIXES)
    assert not unknown, f"docs/report.md names causes the diagnosis does not know: {sorted(unknown)}"


def runnable_examples() -> list:
    """The ```python blocks of the documents that say they are `# runnable as is`, as pytest
    params."""
    pages = sorted((REPO / "docs").glob("*.md")) + sorted((REPO / "src").rglob("README.md"))
    out = []
    for page in pages:
        for i, block in enumerate(re.findall(r"^```python\n(.*?)^```$", page.read_text(),
                                             re.M | re.S)):
            if block.startswith("# runnable as is"):
                # a fresh interpreter and the library's import: over the fast tier's 0.5 s
                out.append(pytest.param(block, id=f"{page.relative_to(REPO)}#{i}",
                                        marks=pytest.mark.slow))
    return out


@pytest.mark.parametrize("block", runnable_examples())
def test_runnable_examples_run_and_print_what_they_say(block: str, tmp_path: Path) -> None:
    """A block a README calls runnable runs as written (in an empty folder), and a print line
    whose comment is one word (`print(plan.best().name)  # antdt-dd`) prints that word."""
    proc = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    promised = re.findall(r"^print\(.*\)\s+#\s*(\S+)\s*$", block, re.M)
    printed = proc.stdout.splitlines()
    missing = [word for word in promised if word not in printed]
    assert not missing, f"promised {missing}, printed {printed[-5:]}"
