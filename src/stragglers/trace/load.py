"""Open whatever trace a user points at: one of our run directories or an NDTimeline Parquet file."""

from __future__ import annotations

from pathlib import Path

from stragglers.errors import InputError
from stragglers.trace.kineto import looks_like_kineto, read_kineto
from stragglers.trace.model import Trace
from stragglers.trace.ndtimeline import read_ndtimeline
from stragglers.trace.runformat import META_FILE, read_run


def load_trace(path: Path | str, meta: Path | str | None = None, *, dp_size: int | None = None,
               pp_size: int | None = None) -> Trace:
    """Read a run directory, an NDTimeline trace (+ meta YAML) or PyTorch-profiler JSON files.

    dp_size / pp_size place Kineto ranks on a DP × PP grid (the profiler does not record it).
    """
    path = Path(path)
    if path.is_dir() and not (path / META_FILE).exists() and looks_like_kineto(path):
        return read_kineto(path, dp_size=dp_size, pp_size=pp_size)
    if path.is_file() and path.name.endswith((".json", ".json.gz")):
        return read_kineto(path, dp_size=dp_size, pp_size=pp_size)
    if path.is_dir():
        if meta is not None:
            raise InputError(meta, None, f"--meta is for NDTimeline files; {path} is a run "
                             f"directory with its own {META_FILE}")
        return read_run(path)
    if not path.exists():
        raise InputError(path, None, "no such file or directory")
    if path.suffix != ".parquet":
        raise InputError(path, None, "expected a run directory, an NDTimeline .parquet trace or "
                         "PyTorch-profiler .json/.json.gz files")
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
