"""The op-table trace model and its readers and writers."""

from stragglers.trace.model import (
    COLUMNS,
    NOTE_KINDS,
    OPTYPES,
    STREAM_OF_OPTYPE,
    STREAMS,
    JobMeta,
    Trace,
    optype_code,
)

__all__ = ["COLUMNS", "NOTE_KINDS", "OPTYPES", "STREAMS", "STREAM_OF_OPTYPE", "JobMeta", "Trace", "optype_code"]
