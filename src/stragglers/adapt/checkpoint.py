"""Model + optimizer + shard state in one file, written atomically at the same step."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from stragglers.adapt.client import ShardClient


def save_job_checkpoint(path: str | Path, step: int, model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer, client: ShardClient,
                        extra: dict | None = None) -> None:
    """Collective: all ranks have acknowledged their batches, rank 0 writes, all wait for it.

    The first barrier makes the shard snapshot match the model exactly at `step` (every rank
    acks before entering it); the file is written to a temporary name, fsynced and renamed, so
    a crash leaves either the old checkpoint or the new one.
    """
    dist.barrier()
    if dist.get_rank() == 0:
        path = Path(path)
        state = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "shards": client.snapshot(), "extra": extra or {}}
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    dist.barrier()


def load_job_checkpoint(path: str | Path, model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer, client: ShardClient) -> dict | None:
    """Collective: every rank loads the model; rank 0 puts the shard service back to the same step."""
    path = Path(path)
    state = torch.load(path, weights_only=False) if path.exists() else None
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if dist.get_rank() == 0:
            client.restore(state["shards"])
    dist.barrier()
    return state
