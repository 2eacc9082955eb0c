"""Hugging Face `transformers.Trainer`: a TrainerCallback that records training with `attach`.

    trainer = Trainer(model=model, args=args, train_dataset=ds)
    record_trainer(trainer)                         # → <args.output_dir>/stragglers-trace
    trainer.train()

`record_trainer` gives the callback the trainer, so it attaches to the model as the trainer
wrapped it (DistributedDataParallel under torchrun), which is what records the gradient
all-reduces per bucket. A bare `RecordCallback()` in `callbacks=[...]` sees only the unwrapped
model: it records compute and the optimizer, and warns that communication is recorded coarsely.
Sequence lengths come from each batch's `attention_mask` unless `seq_lens=` says otherwise.
"""

from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from stragglers.record._attach import Attached, attach
from stragglers.record.pipelining import AttachedPipeline


def lengths_from_attention_mask(*args, **kwargs) -> list[int] | None:
    """Sequence lengths of a batch: the row sums of its attention_mask (None without one)."""
    mask = kwargs.get("attention_mask")
    if mask is None or mask.dim() != 2:
        return None
    return mask.sum(dim=-1).tolist()


class RecordCallback(TrainerCallback):
    """Record `Trainer.train()` into `out` (default: <args.output_dir>/stragglers-trace)."""

    def __init__(self, out: str | Path | None = None, trainer=None, **attach_kwargs):
        self.out, self.trainer = out, trainer
        self.attach_kwargs = {"seq_lens": lengths_from_attention_mask, **attach_kwargs}
        self.attached: Attached | AttachedPipeline | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        """Attach to the wrapped model (when the trainer is known) and the inner optimizer."""
        wrapped = getattr(self.trainer, "model_wrapped", None) or model
        opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
        out = self.out or Path(args.output_dir) / "stragglers-trace"
        kwargs = {"name": type(model).__name__, **self.attach_kwargs}
        self.attached = attach(wrapped, opt, out, **kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        """Flush and close (a collective: every rank ends training together)."""
        if self.attached is not None:
            self.attached.close()


def record_trainer(trainer, out: str | Path | None = None, **attach_kwargs) -> RecordCallback:
    """Add a RecordCallback bound to `trainer` (so it sees the wrapped model); returns it."""
    cb = RecordCallback(out, trainer=trainer, **attach_kwargs)
    trainer.add_callback(cb)
    return cb
