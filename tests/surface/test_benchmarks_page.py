"""BENCHMARKS.md is the render of benchmarks/results/*.json, and every result says how to redo it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import msgspec
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import render_benchmarks  # noqa: E402
import results  # noqa: E402
from results import Figure, Run, read_all  # noqa: E402

# A path to a Python file in a command: `benchmarks/x.py`, `examples/y.py`, `tests/z.py`.
SCRIPT = re.compile(r"(?<![\w/.])((?:[\w.-]+/)*[\w.-]+\.py)\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_the_page_is_the_render_of_the_results() -> None:
    """Editing BENCHMARKS.md by hand, or a result without rendering, leaves the page stale."""
    page = (REPO / "BENCHMARKS.md").read_text(encoding="utf-8")
    assert page == render_benchmarks.render(read_all()), (
        "BENCHMARKS.md is stale: run .venv/bin/python benchmarks/render_benchmarks.py")


@pytest.mark.parametrize("run", read_all(), ids=lambda r: r.benchmark)
def test_every_result_names_a_script_of_the_repository(run: Run) -> None:
    """A figure is reproducible only if its command runs a script that exists here."""
    scripts = SCRIPT.findall(run.command)
    assert scripts, f"{run.benchmark}: no script in its command {run.command!r}"
    missing = [s for s in scripts if not (REPO / s).is_file()]
    assert not missing, f"{run.benchmark}: its command names missing files {missing}"
    assert run.figures, f"{run.benchmark}: no figures"


def test_two_sections_with_one_title_get_their_own_anchors() -> None:
    """Headings that repeat are numbered as GitHub numbers them, so each summary link finds its own."""
    assert render_benchmarks.anchors(["A b", "A b", "C", "A b"]) == ["a-b", "a-b-1", "c", "a-b-2"]


def test_the_page_links_nothing_outside_the_repository() -> None:
    """Links are in-page anchors that exist; no path leaves the repository (../shared, /tmp)."""
    page = (REPO / "BENCHMARKS.md").read_text(encoding="utf-8")
    headings = set(render_benchmarks.anchors(re.findall(r"^#+ (.+)$", page, re.M)))
    for target in LINK.findall(page):
        if target.startswith("#"):
            assert target[1:] in headings, f"link to a missing section {target}"
        else:
            resolved = (REPO / target.split("#", 1)[0]).resolve()
            assert resolved.is_relative_to(REPO) and resolved.exists(), f"broken link {target}"
    for outside in ("../", "/tmp/", "shared/data", "shared/specs"):
        assert outside not in page, f"BENCHMARKS.md refers to {outside!r}, outside the repository"


def test_render_lays_out_a_run_as_summary_row_and_section() -> None:
    """One run becomes a summary row per figure and a section with its table, verdicts marked."""
    run = Run(benchmark="A | b", issue="7", command="python benchmarks/x.py", date="d",
              figures=[Figure(name="f1", value="1 s", goal="≤ 2 s", met=True),
                       Figure(name="f2", value="3 s", goal="≤ 2 s", met=False, note="why")],
              table=[{"col": "cell"}])
    page = render_benchmarks.render([run])
    assert "| [A \\| b (issue 7)](#a--b-issue-7) | `python benchmarks/x.py` | f1: **1 s** |  " \
           "| ≤ 2 s | yes |" in page
    assert "|  |  | f2: **3 s** |  | ≤ 2 s | **no** |" in page
    assert "\n## A | b (issue 7)\n" in page and "- f2: why\n" in page
    assert "| col |\n|---|\n| cell |\n" in page


def test_a_run_is_stamped_with_the_load_over_its_course(tmp_path, monkeypatch) -> None:
    """write() records the load sampled since the script imported results (at least start and
    end), keeps the end value in `load`, and the section shows the range."""
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    path = results.write(Run(benchmark="b", command="python benchmarks/x.py",
                             figures=[Figure(name="f", value="1")]), name="x")
    run = msgspec.json.decode(path.read_bytes(), type=Run)
    over = run.load_over_run
    assert over is not None and over.samples >= 2 and over.seconds >= 0
    assert over.min <= over.median <= over.max
    assert run.load == f"{results._SAMPLER.samples[-1][1]:.1f}"
    assert f"load {over.min:.1f}–{over.max:.1f} over the run" in render_benchmarks.render([run])
    # the longer averages say what came before the samples (a script importing results late)
    assert over.avg5 is not None and over.avg15 is not None
    assert f"5- and 15-minute averages {over.avg5:.1f} / {over.avg15:.1f}" in \
        render_benchmarks.render([run])


def test_a_result_written_before_load_sampling_renders_as_before() -> None:
    """An older JSON (no load_over_run) still reads, and its section shows the end load only."""
    old = (b'{"benchmark": "b", "command": "python benchmarks/x.py", "date": "d", "load": "10.8",'
           b' "figures": [{"name": "f", "value": "1"}]}')
    run = msgspec.json.decode(old, type=Run)
    assert run.load_over_run is None
    assert "`python benchmarks/x.py` — d, load 10.8.\n" in render_benchmarks.render([run])
