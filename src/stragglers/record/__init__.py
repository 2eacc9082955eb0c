"""In-process recorder for PyTorch training loops: writes our run format (see README.md)."""

from stragglers.record.recorder import RecordedWork, Recorder

__all__ = ["Recorder", "RecordedWork"]
