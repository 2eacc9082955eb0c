"""The shard store's replies, typed: what `ShardStore` returns and the service sends as JSON.

msgspec Structs whose fields are the JSON keys of the protocol (README "Protocol"): the service
writes them with `to_builtins`, `ShardClient` decodes them from the reply's bytes (`from_json`
reads one from decoded JSON). A lease that is held (every lease but a replayed one no longer
held) omits `held`, as the wire always did.
A snapshot is typed too (`Snapshot`); a checkpoint stores its plain form, because
`torch.load(weights_only=True)` loads plain values only: `adapt/checkpoint.py` converts there.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict, TypeVar

import msgspec

from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.permutations import Pending
from stragglers.config import PlainObject

LeaseStatus = Literal["ok", "wait", "finished"]
ShardKey = tuple[int, int]   # (epoch, shard)
R = TypeVar("R", bound=msgspec.Struct)


class Lease(msgspec.Struct, omit_defaults=True):
    """One shard handed to a worker: the sample indices still to consume, from `offset`."""

    epoch: int
    shard: int
    offset: int
    # Pending only inside the service, between the commit and the shuffle thread (never sent)
    indices: list[int] | Pending
    size: int
    held: bool = True   # False: a replayed lease this incarnation no longer holds (no indices)

    def sample_indices(self) -> list[int]:
        """The indices, which a reply that left the store has always computed."""
        if isinstance(self.indices, Pending):
            raise RuntimeError("lease indices still pending (shards.lease_json sends them)")
        return self.indices


class _WireLease(msgspec.Struct, omit_defaults=True):
    """A Lease as sent: its indices already JSON (encoded a chunk at a time)."""

    epoch: int
    shard: int
    offset: int
    indices: msgspec.Raw
    size: int
    held: bool = True


# a step of indices_json: each holds the GIL ~1 ms, not the ~0.7 s that 262,144 indices took
# at once as Python ints (tolist + json.dumps) on a loaded machine
INDEX_CHUNK = 16_384


def indices_json(indices: Any) -> msgspec.Raw:
    """A JSON array of `indices` (a list, or a numpy array of ints >= 0), built INDEX_CHUNK at
    a time; an array's digits are written by numpy (no Python int per index), so a thread
    encoding a big lease leaves the GIL to the event loop and the commit thread."""
    if not hasattr(indices, "dtype"):
        return msgspec.Raw(msgspec.json.encode(indices))
    parts = [_digits(indices[i:i + INDEX_CHUNK]) for i in range(0, len(indices), INDEX_CHUNK)]
    return msgspec.Raw(b"[" + b",".join(parts) + b"]")


def _digits(a: Any) -> bytes:
    """The decimal digits of the ints >= 0 of numpy array `a`, comma-separated (no brackets)."""
    import numpy as np

    if not len(a):
        return b""
    v = a.astype(np.int64)
    top = int(v.max())
    if int(v.min()) < 0:
        raise ValueError("indices_json: negative index")
    width = np.ones(v.shape, np.int64)
    p = 10
    while p <= top:
        width += v >= p
        p *= 10
    ends = np.cumsum(width + 1)          # each number and the comma after it
    out = np.full(int(ends[-1]), ord(","), np.uint8)
    last = ends - 2                      # where each number's last digit goes
    for k in range(len(str(top))):       # the k-th digit from the right, where there is one
        live = width > k
        out[last[live] - k] = (v[live] % 10 + 48).astype(np.uint8)
        v //= 10
    return out[:-1].tobytes()


def lease_reply_json(reply: "LeaseReply", json_of: Any) -> bytes:
    """The JSON of a lease reply; `json_of(lease)` gives each lease's indices as JSON (a Raw:
    a Pending one's read from its epoch's permutation, never a list of it all)."""
    leases = [_WireLease(x.epoch, x.shard, x.offset, json_of(x), x.size, x.held)
              for x in reply.leases]
    return msgspec.json.encode(_WireLeaseReply(reply.status, leases, reply.failed,
                                               reply.failed_total))


class FailedShard(msgspec.Struct, frozen=True):
    """A FAILED shard in the report of lease replies and status."""

    epoch: int
    shard: int
    samples: int   # samples of it not consumed
    retries: int
    error: str | None


class LeaseReply(msgspec.Struct):
    """POST .../lease: the shards taken (or "wait" / "finished") and the FAILED report."""

    status: LeaseStatus
    leases: list[Lease]
    failed: list[FailedShard]
    failed_total: int

    @property
    def lease(self) -> Lease | None:
        """The first shard (the one a `count=1` request asked for), if any."""
        return self.leases[0] if self.leases else None


class _WireLeaseReply(msgspec.Struct):
    """A LeaseReply as sent (its leases' indices already JSON)."""

    status: LeaseStatus
    leases: list[_WireLease]
    failed: list[FailedShard]
    failed_total: int


class Status(msgspec.Struct):
    """GET .../status: the data set, shard counts per epoch and state, and the FAILED report."""

    dataset: DatasetConfig
    epochs_created: int
    epochs: dict[str, dict[str, int]]   # epoch (a JSON key) -> state -> shards
    failed: list[FailedShard]           # the first MAX_FAILED_IN_STATUS
    failed_total: int


# epoch, shard, state, consumed, retries, queue_pos, error: one shard's row of a snapshot
ShardRow = tuple[int, int, str, int, int, int, str | None]


class Snapshot(msgspec.Struct):
    """GET .../snapshot (the body of POST .../restore): the data set and every shard's row.

    The service validates a restore body itself (`requests.Snapshot`, strict and bounded); this
    is the shape a client reads and sends back.
    """

    dataset: DatasetConfig
    epochs_created: int
    shards: list[ShardRow]
    folded_epochs: int = 0   # epochs below it list only their shards not DONE


class DatasetJson(TypedDict):
    """A DatasetConfig as JSON (its fields, in order)."""

    name: str
    num_samples: int
    shard_size: int
    seed: int
    num_epochs: int | None
    lease_s: float
    max_retries: int


class SnapshotJson(TypedDict):
    """A Snapshot as the JSON document GET .../snapshot sends (each row a JSON array)."""

    dataset: DatasetJson
    epochs_created: int
    shards: list[list[int | str | None]]   # ShardRow's values
    folded_epochs: int   # epochs below it list only their shards not DONE (older ones: none)


class Health(msgspec.Struct):
    """GET /health: the service answers, and how its commit thread has fared."""

    ok: bool
    commit_batches: int
    commit_calls: int
    failed_batches: int
    stalls: int


class Created(msgspec.Struct):
    """POST /datasets: whether this call created the data set (False: it existed, same config)."""

    created: bool


class Joined(msgspec.Struct):
    """POST .../join: the new incarnation's fence and the shards its predecessors gave back."""

    fence: int
    released: list[ShardKey]


class Acked(msgspec.Struct):
    """POST .../ack: the shard's state and samples consumed after the ack."""

    state: str
    consumed: int


class Released(msgspec.Struct):
    """POST .../release: the shards given back."""

    released: list[ShardKey]


class Requeued(msgspec.Struct):
    """POST .../retry-failed: the FAILED shards put back in the queue."""

    requeued: list[ShardKey]


class Deleted(msgspec.Struct):
    """DELETE /datasets/{name}: the data set deleted (its places given back)."""

    deleted: str
    num_samples: int


class ControlDeleted(msgspec.Struct):
    """DELETE /jobs/{job}/control: the job's controller dropped (its places given back)."""

    deleted: str


class Restored(msgspec.Struct):
    """POST .../restore: rows restored, and DOING shards of the snapshot queued first."""

    restored: int
    requeued_first: int


class Configured(msgspec.Struct):
    """POST /jobs/{job}/control/config: whether this call started a controller."""

    configured: bool
    incarnation: int


def to_builtins(reply: msgspec.Struct) -> PlainObject:
    """The reply as the JSON object it is sent as (a ShardKey stays a tuple: json writes a list)."""
    out: PlainObject = msgspec.to_builtins(reply)
    return out


def from_json(data: Any, kind: type[R]) -> R:
    """A reply decoded from its JSON object (ValueError naming the field when it is not one)."""
    try:
        return msgspec.convert(data, kind)
    except msgspec.ValidationError as exc:
        raise ValueError(f"not a {kind.__name__} reply: {exc}") from None
