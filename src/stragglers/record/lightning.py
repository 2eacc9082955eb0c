"""PyTorch Lightning: a Callback that records the fit with `attach` (needs `lightning`).

    trainer = L.Trainer(..., callbacks=[RecordCallback()])   # → <default_root_dir>/stragglers-trace

The trainer's own config decides the rest: the model Lightning wrapped (DDP under its ddp
strategies), its first optimizer, its root directory. Recording starts when training starts
(after sanity-check validation) and ends with it; validation forwards are not recorded.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from lightning.pytorch import Callback

from stragglers.record._attach import Attached, attach
from stragglers.record.pipelining import AttachedPipeline


class RecordCallback(Callback):
    """Record a Lightning fit into `out` (default: <trainer.default_root_dir>/stragglers-trace)."""

    def __init__(self, out: str | Path | None = None, **attach_kwargs):
        super().__init__()
        self.out = out
        self.attach_kwargs = attach_kwargs
        self.attached: Attached | AttachedPipeline | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        """Attach to the model as Lightning wrapped it and to its optimizer."""
        optimizers = trainer.optimizers
        if not optimizers:
            warnings.warn("stragglers RecordCallback: the trainer has no optimizer; nothing is "
                          "recorded", stacklevel=2)
            return
        if len(optimizers) > 1:
            warnings.warn("stragglers RecordCallback: several optimizers; steps are taken from "
                          "the first one's step()", stacklevel=2)
        opt = getattr(optimizers[0], "optimizer", optimizers[0])  # LightningOptimizer wraps
        out = self.out or Path(trainer.default_root_dir) / "stragglers-trace"
        kwargs = {"name": type(pl_module).__name__, **self.attach_kwargs}
        self.attached = attach(trainer.strategy.model, opt, out, **kwargs)

    def on_train_end(self, trainer, pl_module) -> None:
        """Flush and close (a collective: every rank ends training together)."""
        if self.attached is not None:
            self.attached.close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        """Keep what was recorded; peers may be gone, so no collectives."""
        if self.attached is not None:
            self.attached.close(collective=False)
