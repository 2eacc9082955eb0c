"""Open whatever trace a user points at: one of our run directories or an NDTimeline Parquet file."""

from __future__ import annotations

from pathlib import Path

from stragglers.errors import InputError
from stragglers.protocols import TRACE_READERS
from stragglers.trace.model import Trace

META_FILE = "meta.json"  # as in runformat; not imported so Kineto input never loads pyarrow
_KINETO_SUFFIXES = (".json", ".json.gz")


class KinetoReader:
    """PyTorch-profiler (Kineto) JSON: one .json/.json.gz file per rank, a file or a folder."""

    name = "kineto"

    def can_read(self, path: Path) -> bool:
        """A profiler file, or a folder of them without our meta.json."""
        if path.is_file():
            return path.name.endswith(_KINETO_SUFFIXES)
        return path.is_dir() and not (path / META_FILE).exists() and any(
            f.is_file() and f.name.endswith(_KINETO_SUFFIXES) for f in path.iterdir())

    def read(self, path: Path, *, meta: Path | str | None = None, dp_size: int | None = None,
             pp_size: int | None = None, tp_size: int | None = None) -> Trace:
        """Read the ranks' files, placed on a DP × PP grid by dp_size / pp_size / tp_size."""
        from stragglers.trace.kineto import read_kineto

        if meta is not None:
            raise InputError(meta, None, f"--meta is for NDTimeline files; {path} holds "
                             "PyTorch-profiler traces (their layout: --dp-size, --pp-size)")

        return read_kineto(path, dp_size=dp_size, pp_size=pp_size, tp_size=tp_size)


class RunReader:
    """Our run format: a directory with meta.json and Parquet op tables per rank."""

    name = "run"

    def can_read(self, path: Path) -> bool:
        """Any directory that is not a folder of profiler files."""
        return path.is_dir()

    def read(self, path: Path, *, meta: Path | str | None = None, dp_size: int | None = None,
             pp_size: int | None = None, tp_size: int | None = None) -> Trace:
        """Read every rank's op tables and the job's meta.json."""
        if meta is not None:
            raise InputError(meta, None, f"--meta is for NDTimeline files; {path} is a run "
                             f"directory with its own {META_FILE}")
        _layout_is_given(path, f"a run directory with its own {META_FILE}", dp_size, pp_size,
                         tp_size)
        from stragglers.trace.runformat import read_run

        return read_run(path)


class NDTimelineReader:
    """NDTimeline: trace-<name>.parquet with its meta-<name>.yaml beside it (or --meta)."""

    name = "ndtimeline"

    def can_read(self, path: Path) -> bool:
        """A .parquet file."""
        return path.is_file() and path.suffix == ".parquet"

    def read(self, path: Path, *, meta: Path | str | None = None, dp_size: int | None = None,
             pp_size: int | None = None, tp_size: int | None = None) -> Trace:
        """Read the op table and its metadata YAML."""
        from stragglers.trace.ndtimeline import read_ndtimeline

        _layout_is_given(path, "an NDTimeline trace, laid out by its metadata YAML", dp_size,
                         pp_size, tp_size)
        return read_ndtimeline(path, meta)


class StepTimesReader:
    """Per-worker step times: a .csv table with worker, step and time columns."""

    name = "step_times"

    def can_read(self, path: Path) -> bool:
        """A .csv file whose header names a worker, a step and a time column."""
        from stragglers.trace.steptimes import looks_like_step_times

        return looks_like_step_times(path)

    def read(self, path: Path, *, meta: Path | str | None = None, dp_size: int | None = None,
             pp_size: int | None = None, tp_size: int | None = None) -> Trace:
        """Each worker's step as one compute op and one synchronising all-reduce."""
        from stragglers.trace.steptimes import read_step_times

        _layout_is_given(path, "a table of per-worker step times (data parallel, one stage)",
                         dp_size, pp_size, tp_size)
        if meta is not None:
            raise InputError(meta, None, f"--meta is for NDTimeline files; {path} is a table "
                             "of step times")
        return read_step_times(path)


def _layout_is_given(path: Path, what: str, dp_size: int | None, pp_size: int | None,
                     tp_size: int | None = None) -> None:
    """--dp-size / --pp-size place profiler ranks; a format that records its layout refuses
    them rather than ignoring them (a user who gave one expects it to count)."""
    for flag, value in (("--dp-size", dp_size), ("--pp-size", pp_size), ("--tp-size", tp_size)):
        if value is not None:
            raise InputError(flag, None, f"only places PyTorch-profiler ranks; {path} is {what}")


# Tried in this order; the first whose can_read() accepts the path reads it.
for _reader in (KinetoReader(), RunReader(), NDTimelineReader(), StepTimesReader()):
    TRACE_READERS.register(_reader.name)(_reader)


def load_trace(path: Path | str, meta: Path | str | None = None, *, dp_size: int | None = None,
               pp_size: int | None = None, format: str | None = None,
               tp_size: int | None = None) -> Trace:
    """Read a run directory, an NDTimeline trace (+ meta YAML) or PyTorch-profiler JSON files.

    dp_size / pp_size / tp_size place Kineto ranks on a DP × PP grid (the profiler does not
    record it; each tensor-parallel rank is a worker of its own).
    `format` names a registered reader (`TRACE_READERS`) instead of recognising the path.
    Only the reader a path needs is imported (the Parquet ones bring pyarrow).
    """
    path = Path(path)
    if not path.exists():
        raise InputError(path, None, "no such file or directory")
    if format is not None:
        return TRACE_READERS.get(format, "format").read(
            path, meta=meta, dp_size=dp_size, pp_size=pp_size, tp_size=tp_size)
    if path.is_dir() and not (path / META_FILE).exists():
        entries = [f for f in path.iterdir() if not f.name.startswith(".")]
        if not any(f.name.endswith((".parquet", *_KINETO_SUFFIXES)) for f in entries):
            what = "empty directory" if not entries else "no trace files in this directory"
            raise InputError(path, None, f"{what}; expected a run directory ({META_FILE} and "
                             "rank-NNNNN.parquet files) or PyTorch-profiler traces (*.json / "
                             "*.json.gz, one per rank)")
    for name in TRACE_READERS:
        reader = TRACE_READERS.get(name)
        if reader.can_read(path):
            return reader.read(path, meta=meta, dp_size=dp_size, pp_size=pp_size,
                               tp_size=tp_size)
    raise InputError(path, None, "expected a run directory, an NDTimeline .parquet trace, "
                     "PyTorch-profiler .json/.json.gz files or a .csv table of per-worker "
                     "step times (worker, step and time columns)")


# A selection is a list of step numbers; '0-99999999999999999999' would expand past memory
# (it got the analysis killed), and a million steps is more than any trace holds.
MAX_SELECTED_STEPS = 1_000_000
# a step number at most: the op table's step column is a signed 64-bit integer
MAX_STEP_NUMBER = 2**63 - 1


def parse_steps(spec: str | None) -> list[int] | None:
    """'12,20-23' → [12, 20, 21, 22, 23]; at most MAX_SELECTED_STEPS steps."""
    if spec is None:
        return None
    spans: list[tuple[int, int]] = []
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part:
                a, b = part.split("-", 1)
                lo, hi = int(a), int(b)
            elif part:
                lo = hi = int(part)
            else:
                continue
            if hi < lo:
                raise ValueError
        except ValueError:
            raise InputError("--steps", None, f"cannot read {part!r}; expected steps like "
                             "'12,20-23'") from None
        if hi - lo + 1 > MAX_SELECTED_STEPS:  # refused before it is expanded
            raise InputError("--steps", None, f"{part[:60]!r} makes more than "
                             f"{MAX_SELECTED_STEPS:,} steps; select fewer")
        if lo < 0 or hi > MAX_STEP_NUMBER:   # (one past 2**63 failed inside numpy)
            raise InputError("--steps", None, f"{part[:40]!r}: expected step numbers in "
                             f"0..{MAX_STEP_NUMBER}")
        spans.append((lo, hi))
    if not spans:
        raise InputError("--steps", None, "no steps given; expected steps like '12,20-23'")
    # distinct steps, counted over the merged spans (a step given twice counts once), in one
    # pass over the sorted spans: a selection of many small parts costs no quadratic sum
    count, reach = 0, None
    for lo, hi in sorted(spans):
        if reach is not None:
            lo = max(lo, reach + 1)
        count += max(0, hi - lo + 1)
        reach = hi if reach is None else max(reach, hi)
    if count > MAX_SELECTED_STEPS:
        raise InputError("--steps", None, f"selects {count:,} steps, more than "
                         f"{MAX_SELECTED_STEPS:,}; select fewer")
    return sorted({step for lo, hi in spans for step in range(lo, hi + 1)})
