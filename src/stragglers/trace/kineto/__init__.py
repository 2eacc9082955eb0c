"""PyTorch-profiler (Kineto) traces → the op table (docs/trace-formats.md §3)."""

from stragglers.trace.kineto.reader import kineto_files, looks_like_kineto, read_kineto

__all__ = ["kineto_files", "looks_like_kineto", "read_kineto"]
