"""A Lightning fit on CPU (DDP over gloo under torchrun), recorded by stragglers' RecordCallback.

    python -m torch.distributed.run --nproc-per-node 2 tests/record/workers/lightning_worker.py \
        OUT STEPS SLOW_RANK
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from slowdown import slow_down  # (puts examples/ on sys.path)

from launch import exit_without_finalizing  # noqa: E402  (examples/launch.py)
from stragglers.record.lightning import RecordCallback


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                                 nn.Linear(512, 128))

    def training_step(self, batch, _idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main(out: str, steps: int, slow_rank: int) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64 * steps * 2, 128, generator=g)
    data = DataLoader(TensorDataset(x, torch.tanh(x.flip(-1))), batch_size=64)
    model = Regressor()
    if int(os.environ["RANK"]) == slow_rank:
        slow_down(model.net, 0.08, 0.16)  # on top of a few ms of real compute: ×4 and more
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy="ddp",
                        max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=out, callbacks=[RecordCallback(flush_interval_s=0.05)])
    trainer.fit(model, data)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    exit_without_finalizing()  # examples/launch.py: no rare gloo abort at shutdown
