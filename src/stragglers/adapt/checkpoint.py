"""Model + optimizer + shard state in one file, written atomically at the same step.

The file holds only tensors and plain containers, and is read with `torch.load(weights_only=True)`:
a tampered checkpoint cannot run code. The shard snapshot inside it is validated by the service
on restore like any other request.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from stragglers.adapt.client import ShardClient
from stragglers.errors import InputError


def save_job_checkpoint(path: str | Path, step: int, model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer, client: ShardClient,
                        extra: dict | None = None) -> None:
    """Collective: all ranks have acknowledged their batches, rank 0 writes, all wait for it.

    The first barrier makes the shard snapshot match the model exactly at `step` (every rank
    acks before entering it); the file is written to a temporary name, fsynced, renamed, and
    the directory fsynced, so a crash (of the process or the machine) leaves either the old
    checkpoint or the new one.
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
        fsync_directory(path.parent)
    dist.barrier()


def fsync_directory(directory: str | Path) -> None:
    """Make a rename inside `directory` durable (POSIX: the entry lives in the directory)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_checkpoint(path: str | Path) -> dict | None:
    """The checkpoint's contents (tensors and plain values only), None when there is none."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        with warnings.catch_warnings():
            # torch warns about a foreign pickle protocol before refusing the file; the refusal
            # below is the one line the user gets
            warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
            state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - unpickling errors come in many types
        raise InputError(path, None, f"not a checkpoint this code wrote, or tampered with"
                         f" ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None
    missing = {"step", "model", "optimizer", "shards"} - set(state if isinstance(state, dict) else ())
    if missing:
        raise InputError(path, sorted(missing)[0], "missing from the checkpoint")
    return state


def load_job_checkpoint(path: str | Path, model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer, client: ShardClient) -> dict | None:
    """Collective: every rank loads the model; rank 0 puts the shard service back to the same step."""
    state = read_checkpoint(path)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if dist.get_rank() == 0:
            client.restore(state["shards"])
    dist.barrier()
    return state
