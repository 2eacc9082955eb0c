"""Convert between our run directories and NDTimeline Parquet + YAML, losslessly."""

from __future__ import annotations

from pathlib import Path

from stragglers.errors import InputError
from stragglers.trace.load import load_trace
from stragglers.trace.ndtimeline import write_ndtimeline
from stragglers.trace.runformat import write_run


def convert(source: Path | str, dest: Path | str, meta: Path | str | None = None, *,
            dp_size: int | None = None, pp_size: int | None = None) -> Path:
    """Any readable trace → NDTimeline when dest ends in .parquet, else → a run directory."""
    source, dest = Path(source), Path(dest)
    if dest.resolve() == source.resolve():
        raise InputError(dest, None, "the destination is the source; choose another path")
    trace = load_trace(source, meta, dp_size=dp_size, pp_size=pp_size)
    if dest.suffix == ".parquet":
        write_ndtimeline(trace, dest)
    else:
        if dest.exists() and any(dest.iterdir()):
            raise InputError(dest, None, "destination directory is not empty; refusing to mix runs")
        write_run(dest, trace)
    return dest
