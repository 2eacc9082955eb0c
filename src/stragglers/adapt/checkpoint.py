"""Model + optimizer + shard state in one file, written atomically at the same step.

The file holds only tensors and plain containers, and is read with `torch.load(weights_only=True)`:
a tampered checkpoint cannot run code. This module is where the typed shard snapshot
(`replies.Snapshot`) becomes the plain JSON document the file holds and back (`JobCheckpoint`);
the service validates it again on restore like any other request.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import msgspec
import torch
import torch.distributed as dist

from stragglers.adapt.client import ShardClient
from stragglers.adapt.replies import Snapshot, SnapshotJson
from stragglers.errors import InputError


@dataclass(frozen=True)
class JobCheckpoint:
    """What a checkpoint holds: the step, the model's and optimizer's state, the shard snapshot."""

    step: int
    model: dict[str, Any]       # model.state_dict()
    optimizer: dict[str, Any]   # optimizer.state_dict()
    shards: Snapshot
    extra: dict[str, Any] = field(default_factory=dict)

    def to_plain(self) -> CheckpointFile:
        """The file's form: tensors and plain containers only (the snapshot as its JSON document)."""
        return CheckpointFile(step=self.step, model=self.model, optimizer=self.optimizer,
                              shards=msgspec.json.decode(msgspec.json.encode(self.shards)),
                              extra=self.extra)

    @classmethod
    def from_plain(cls, state: object, source: str | Path) -> JobCheckpoint:
        """Read back what `to_plain` wrote (InputError naming the first field that is not)."""
        try:
            f = msgspec.convert(state, _CheckpointFile)
        except msgspec.ValidationError as exc:
            # msgspec's message names the field: "... - at `$.shards.epochs_created`"
            raise InputError(source, None, f"not a checkpoint this code wrote: {exc}") from None
        for name, value in (("model", f.model), ("optimizer", f.optimizer), ("extra", f.extra)):
            if not isinstance(value, dict):
                raise InputError(source, name, f"expected a dict of state, got {type(value).__name__}")
        return cls(f.step, f.model, f.optimizer, f.shards, f.extra)


class CheckpointFile(TypedDict):
    """What the file holds (torch.save of this dict): JobCheckpoint's fields, the snapshot JSON."""

    step: int
    model: dict[str, Any]       # tensors and plain containers, as state_dict() gives them
    optimizer: dict[str, Any]
    shards: SnapshotJson
    extra: dict[str, Any]


class _CheckpointFile(msgspec.Struct):
    """The file's top level as read back: the state dicts kept as they are (tensors, and their
    OrderedDict's `_metadata`, which load_state_dict uses), the snapshot typed."""

    step: int
    model: Any
    optimizer: Any
    shards: Snapshot
    extra: Any = {}


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
        state = JobCheckpoint(step, model.state_dict(), optimizer.state_dict(), client.snapshot(),
                              extra or {})
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save(state.to_plain(), f)
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


def read_checkpoint(path: str | Path) -> JobCheckpoint | None:
    """The checkpoint's contents, None when there is none."""
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
    return JobCheckpoint.from_plain(state, path)


def load_job_checkpoint(path: str | Path, model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer, client: ShardClient
                        ) -> JobCheckpoint | None:
    """Collective: every rank loads the model; rank 0 puts the shard service back to the same step."""
    state = read_checkpoint(path)
    if state is not None:
        model.load_state_dict(state.model)
        optimizer.load_state_dict(state.optimizer)
        if dist.get_rank() == 0:
            client.restore(state.shards)
    dist.barrier()
    return state
