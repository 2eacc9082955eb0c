"""In-process recorder for PyTorch training loops: writes our run format (see README.md).

- `attach(model, optimizer, out)`: one call records a DDP / FSDP2 / plain loop unchanged.
- `Recorder`: the explicit form (`rec.step`, `rec.op`, recorded p2p and collectives).
- `RecordedWork`: a recorded asynchronous send/recv.
"""

from stragglers.record.attach import Attached, attach
from stragglers.record.recorder import RecordedWork, Recorder

__all__ = ["attach", "Attached", "Recorder", "RecordedWork"]
