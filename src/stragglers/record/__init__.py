"""In-process recorder for PyTorch training loops: writes our run format (see README.md).

- `attach(model, optimizer, out)`: one call records a DDP / FSDP2 / plain loop unchanged.
- `Recorder`: the explicit form (`rec.step`, `rec.op`, recorded p2p and collectives), its
  settings a `RecorderConfig`.
- `RecordedWork`: a recorded asynchronous send/recv.
- `RecordCallback` (Lightning) and `record_trainer` (Hugging Face Trainer): the trainer forms.
- `PartUploader`: sends each flushed part to the live monitor.

Exports are lazy: `import stragglers.record` does not import torch until a name is used.
"""

from stragglers.lazy import lazy_exports

_LAZY = {
    "attach": "stragglers.record._attach",
    "Attached": "stragglers.record._attach",
    "Recorder": "stragglers.record.recorder",
    "RecorderConfig": "stragglers.record.settings",
    "RecordedWork": "stragglers.record.recorder",
    "RecordCallback": "stragglers.record.lightning",
    "record_trainer": "stragglers.record.hf_trainer",
    "PartUploader": "stragglers.record.upload",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY)
