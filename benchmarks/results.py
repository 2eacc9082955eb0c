"""The figures a benchmark run measured, written to benchmarks/results/<script>.json.

BENCHMARKS.md is rendered from these files (benchmarks/render_benchmarks.py): a script that
measures something a page claims calls `write(...)` at its end, so the page shows what the
last run of the documented command measured, with its date, commit and machine load.

Importing this module starts a daemon thread that samples the 1-minute load average every
`SAMPLE_S` seconds, so a run is stamped with the load over its whole course (min, median, max),
not only the load at its end.
"""

from __future__ import annotations

import datetime as _dt
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec

RESULTS = Path(__file__).resolve().parent / "results"
SAMPLE_S = 5.0  # seconds between two samples of the load average during a run


class Figure(msgspec.Struct, kw_only=True):
    """One measured figure: what it is, its value, and the goal it is judged against."""

    name: str  # what was measured, e.g. "16M ops, single process, peak RSS"
    value: str  # the figure as printed, with its unit, e.g. "1.59 GB"
    goal: str = ""  # the issue's goal, e.g. "<= 3 GB"; empty when none
    met: bool | None = None  # None: no goal, or not judgeable here (say why in note)
    anchor: str = ""  # what it is compared with (a baseline in the same run, a published figure)
    note: str = ""  # one line: why a goal is missed, what the figure depends on


class Load(msgspec.Struct, kw_only=True):
    """The 1-minute load average sampled over a run: at its start, every SAMPLE_S, at its end."""

    min: float
    median: float
    max: float
    samples: int
    seconds: float  # from the first sample to the last
    # the 5- and 15-minute averages at the end: what the machine did before the samples began
    # (a script that imports results late, after its work, is sampled for seconds only)
    avg5: float | None = None
    avg15: float | None = None


class Run(msgspec.Struct, kw_only=True):
    """One run of a benchmark script: its command, when and where, and its figures."""

    benchmark: str  # a title, e.g. "What-if of 10^8 ops, streamed"
    issue: str = ""  # the issue(s) it judges, e.g. "32"
    command: str  # the exact command that reproduces it from the repository root
    date: str = ""  # UTC, filled by write()
    commit: str = ""  # git HEAD at the run, filled by write()
    load: str = ""  # 1-minute load average at the end of the run, filled by write()
    load_over_run: Load | None = None  # sampled from start to end, filled by write(); None: older
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


class _LoadSampler:
    """Samples os.getloadavg()[0] from its start, every `period` seconds, on a daemon thread."""

    def __init__(self, period: float = SAMPLE_S) -> None:
        self.period = period
        self.samples: list[tuple[float, float]] = []  # (monotonic time, 1-minute load)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Take the first sample now and the next ones in the background."""
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="results-load", daemon=True)
        self._thread.start()

    def sample(self) -> float:
        """Record the current 1-minute load average and return it."""
        load = os.getloadavg()[0]
        self.samples.append((time.monotonic(), load))
        return load

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()

    def summary(self) -> Load:
        """Min, median and max of the samples so far, with one more taken now."""
        self.sample()
        loads = [x for _, x in self.samples]
        _, avg5, avg15 = os.getloadavg()
        return Load(min=round(min(loads), 1), median=round(statistics.median(loads), 1),
                    max=round(max(loads), 1), samples=len(loads),
                    seconds=round(self.samples[-1][0] - self.samples[0][0], 1),
                    avg5=round(avg5, 1), avg15=round(avg15, 1))

    def _forget_in_child(self) -> None:
        # a forked child has no sampling thread; it keeps the samples taken before the fork
        self._stop = threading.Event()
        self._thread = None


_SAMPLER = _LoadSampler()
_SAMPLER.start()
os.register_at_fork(after_in_child=_SAMPLER._forget_in_child)


def write(run: Run, name: str | None = None) -> Path:
    """Stamp `run` with date, commit and load (at the end and over the run) and write it as
    results/<name>.json."""
    name = name or Path(sys.argv[0]).stem
    run.date = run.date or _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    run.commit = run.commit or _head()
    if not run.load:  # a run carried over from an earlier file keeps the load it had
        run.load_over_run = _SAMPLER.summary()
        run.load = f"{_SAMPLER.samples[-1][1]:.1f}"
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_bytes(msgspec.json.format(msgspec.json.encode(run), indent=1) + b"\n")
    return path


def read_all() -> list[Run]:
    """Every stored run, ordered by file name."""
    return [msgspec.json.decode(p.read_bytes(), type=Run)
            for p in sorted(RESULTS.glob("*.json"))]
