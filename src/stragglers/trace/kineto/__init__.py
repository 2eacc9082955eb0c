"""PyTorch-profiler (Kineto) traces → the op table (specs/trace-formats.md §2)."""

from stragglers.trace.kineto.reader import kineto_files, looks_like_kineto, read_kineto

__all__ = ["kineto_files", "looks_like_kineto", "read_kineto"]
