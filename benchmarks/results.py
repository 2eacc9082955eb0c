"""The figures a benchmark run measured, written to benchmarks/results/<script>.json.

BENCHMARKS.md is rendered from these files (benchmarks/render_benchmarks.py): a script that
measures something a page claims calls `write(...)` at its end, so the page shows what the
last run of the documented command measured, with its date, commit and machine load.
"""

from __future__ import annotations

import datetime as _dt
import os
import subprocess
import sys
from pathlib import Path

import msgspec

RESULTS = Path(__file__).resolve().parent / "results"


class Figure(msgspec.Struct, kw_only=True):
    """One measured figure: what it is, its value, and the goal it is judged against."""

    name: str  # what was measured, e.g. "16M ops, single process, peak RSS"
    value: str  # the figure as printed, with its unit, e.g. "1.59 GB"
    goal: str = ""  # the issue's goal, e.g. "<= 3 GB"; empty when none
    met: bool | None = None  # None: no goal, or not judgeable here (say why in note)
    anchor: str = ""  # what it is compared with (a baseline in the same run, a published figure)
    note: str = ""  # one line: why a goal is missed, what the figure depends on


class Run(msgspec.Struct, kw_only=True):
    """One run of a benchmark script: its command, when and where, and its figures."""

    benchmark: str  # a title, e.g. "What-if of 10^8 ops, streamed"
    issue: str = ""  # the issue(s) it judges, e.g. "32"
    command: str  # the exact command that reproduces it from the repository root
    date: str = ""  # UTC, filled by write()
    commit: str = ""  # git HEAD at the run, filled by write()
    load: str = ""  # 1-minute load average at the end of the run, filled by write()
    figures: list[Figure]
    table: list[dict[str, str]] = []  # optional detail rows (column -> cell), rendered as given
    note: str = ""  # one line about the run as a whole, e.g. "measured <date>, not rerun: <why>"
    text: list[str] = []  # short paragraphs under the table: setup, caveats, what limits a figure


def _head() -> str:
    """The short git commit of the working tree, or '' outside a repository."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=RESULTS.parent, timeout=10, check=False)
    except OSError:
        return ""
    return out.stdout.strip()


def write(run: Run, name: str | None = None) -> Path:
    """Stamp `run` with date, commit and load and write it as results/<name>.json."""
    name = name or Path(sys.argv[0]).stem
    run.date = run.date or _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    run.commit = run.commit or _head()
    run.load = run.load or f"{os.getloadavg()[0]:.1f}"
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_bytes(msgspec.json.format(msgspec.json.encode(run), indent=1) + b"\n")
    return path


def read_all() -> list[Run]:
    """Every stored run, ordered by file name."""
    return [msgspec.json.decode(p.read_bytes(), type=Run)
            for p in sorted(RESULTS.glob("*.json"))]
