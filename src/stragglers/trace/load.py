"""Open whatever trace a user points at: one of our run directories or an NDTimeline Parquet file."""

from __future__ import annotations

from pathlib import Path

from stragglers.errors import InputError
from stragglers.trace.model import Trace

META_FILE = "meta.json"  # as in runformat; not imported so Kineto input never loads pyarrow
_KINETO_SUFFIXES = (".json", ".json.gz")


def load_trace(path: Path | str, meta: Path | str | None = None, *, dp_size: int | None = None,
               pp_size: int | None = None) -> Trace:
    """Read a run directory, an NDTimeline trace (+ meta YAML) or PyTorch-profiler JSON files.

    dp_size / pp_size place Kineto ranks on a DP × PP grid (the profiler does not record it).
    Only the reader a path needs is imported (the Parquet ones bring pyarrow).
    """
    path = Path(path)
    if path.is_dir() and not (path / META_FILE).exists():
        entries = [f for f in path.iterdir() if not f.name.startswith(".")]
        if any(f.is_file() and f.name.endswith(_KINETO_SUFFIXES) for f in entries):
            from stragglers.trace.kineto import read_kineto

            return read_kineto(path, dp_size=dp_size, pp_size=pp_size)
        if not any(f.name.endswith(".parquet") for f in entries):
            what = "empty directory" if not entries else "no trace files in this directory"
            raise InputError(path, None, f"{what}; expected a run directory ({META_FILE} and "
                             "rank-NNNNN.parquet files) or PyTorch-profiler traces (*.json / "
                             "*.json.gz, one per rank)")
    if path.is_file() and path.name.endswith(_KINETO_SUFFIXES):
        from stragglers.trace.kineto import read_kineto

        return read_kineto(path, dp_size=dp_size, pp_size=pp_size)
    if path.is_dir():
        if meta is not None:
            raise InputError(meta, None, f"--meta is for NDTimeline files; {path} is a run "
                             f"directory with its own {META_FILE}")
        from stragglers.trace.runformat import read_run

        return read_run(path)
    if not path.exists():
        raise InputError(path, None, "no such file or directory")
    if path.suffix != ".parquet":
        raise InputError(path, None, "expected a run directory, an NDTimeline .parquet trace or "
                         "PyTorch-profiler .json/.json.gz files")
    from stragglers.trace.ndtimeline import read_ndtimeline

    return read_ndtimeline(path, meta)


def parse_steps(spec: str | None) -> list[int] | None:
    """'12,20-23' → [12, 20, 21, 22, 23]."""
    if spec is None:
        return None
    steps: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part:
                a, b = part.split("-", 1)
                lo, hi = int(a), int(b)
                if hi < lo:
                    raise ValueError
                steps.update(range(lo, hi + 1))
            elif part:
                steps.add(int(part))
        except ValueError:
            raise InputError("--steps", None, f"cannot read {part!r}; expected steps like "
                             "'12,20-23'") from None
    if not steps:
        raise InputError("--steps", None, "no steps given; expected steps like '12,20-23'")
    return sorted(steps)
