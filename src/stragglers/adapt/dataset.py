"""What a data set is: its config and bounds, names, per-epoch shuffles, checkpointed snapshots.

Pure Python + numpy (no SQLite, no HTTP): the store, the service's request models and the
checkpoint code all validate against the same rules.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from stragglers.errors import InputError

TODO, DOING, DONE, FAILED = "TODO", "DOING", "DONE", "FAILED"
STATES = (TODO, DOING, DONE, FAILED)

# Bounds that keep one call cheap for every other job on the same service: creating an epoch
# inserts one row per shard, a lease reply carries up to `shard_size` indices, and the epoch's
# permutation (int32) is held in memory.
MAX_SHARDS_PER_EPOCH = 65_536
MAX_SHARD_SIZE = 65_536
MAX_SAMPLES = 1 << 26
MAX_EPOCHS = 1 << 20
MAX_LEASE_S = 7 * 86_400.0
MIN_LEASE_S = 0.05
MAX_RETRIES = 1_000
MAX_SEED = (1 << 63) - 1
MAX_ERROR_CHARS = 1_024
MAX_FAILED_IN_REPLY = 32
# A worker's fences (a join's, a new name's above a floor) never pass this: a request cannot
# carry a larger one, and a stored one past it is damaged (2^63 overflowed SQLite: a 500)
MAX_FENCE = 1 << 62
NAME_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
WORKER_PATTERN = re.compile(r"^[A-Za-z0-9._:@-]{1,128}$")

def check_name(value: object, field: str, pattern: re.Pattern = NAME_PATTERN) -> str:
    """A data set / worker name: 1-128 characters of [A-Za-z0-9._-] (workers also ':' and '@')."""
    # fullmatch: `$` also matches before a final newline ('d\n' named data set 'd\n'); a name
    # of dots only is refused (an HTTP client folds /datasets/../status into /status)
    if not isinstance(value, str) or not pattern.fullmatch(value) or not value.strip("."):
        shown = repr(value) if len(repr(value)) < 60 else repr(value)[:60] + "..."
        raise InputError("shard service", field,
                         f"expected 1-128 characters matching {pattern.pattern} (not only"
                         f" dots), got {shown}")
    return value


def _int(source: str, field: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(source, field, f"expected an integer, got {value!r:.60}")
    if not lo <= value <= hi:
        raise InputError(source, field, f"expected {lo}..{hi}, got {value}")
    return value


@dataclass(frozen=True)
class DatasetConfig:
    """How a data set is cut into shards and how long a lease lasts."""

    name: str
    num_samples: int
    shard_size: int
    seed: int = 0
    num_epochs: int | None = 1  # None: unbounded, new epochs as long as workers pull
    lease_s: float = 30.0
    max_retries: int = 3

    def validate(self, source: str = "dataset") -> None:
        """Raise InputError naming the field for a config that cannot be served."""
        try:
            check_name(self.name, "name")
        except InputError as exc:
            raise InputError(source, "name", exc.problem) from None
        _int(source, "num_samples", self.num_samples, 1, MAX_SAMPLES)
        _int(source, "shard_size", self.shard_size, 1, MAX_SHARD_SIZE)
        shards = math.ceil(self.num_samples / self.shard_size)
        if shards > MAX_SHARDS_PER_EPOCH:
            raise InputError(source, "shard_size", f"{self.num_samples} samples in shards of"
                             f" {self.shard_size} make {shards} shards per epoch; expected at"
                             f" most {MAX_SHARDS_PER_EPOCH} (use larger shards)")
        _int(source, "seed", self.seed, 0, MAX_SEED)
        if self.num_epochs is not None:
            _int(source, "num_epochs", self.num_epochs, 1, MAX_EPOCHS)
        lease = self.lease_s
        if isinstance(lease, bool) or not isinstance(lease, (int, float)) \
                or not math.isfinite(lease) or not MIN_LEASE_S <= lease <= MAX_LEASE_S:
            raise InputError(source, "lease_s",
                             f"expected {MIN_LEASE_S}..{MAX_LEASE_S:g} seconds, got {lease!r:.40}")
        _int(source, "max_retries", self.max_retries, 0, MAX_RETRIES)

    @property
    def num_shards(self) -> int:
        """Shards per epoch."""
        return math.ceil(self.num_samples / self.shard_size)


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The deterministic shuffle of epoch `epoch` (same seed and epoch, same order)."""
    # Generator.permutation(n) shuffles arange(n) (int64); shuffling an int32 arange with the
    # same generator gives the same order with half the memory and time.
    perm = np.arange(num_samples, dtype=np.int32)
    np.random.default_rng([seed, epoch]).shuffle(perm)
    return perm




SNAPSHOT_FIELDS = ("epoch", "shard", "state", "consumed", "retries", "queue_pos", "error")
MAX_QUEUE_POS = 1 << 62
MAX_RESTORED_ROWS = 1 << 22   # as many as a restore body may list (requests.Snapshot)


def validate_snapshot(snap: object, source: str = "snapshot") -> tuple[DatasetConfig, int, list[tuple]]:
    """(config, epochs_created, rows) of a shard snapshot, or InputError naming the bad field.

    Checked in full before anything is changed: every shard of every created epoch exactly
    once, offsets inside their shard, DONE shards complete, known states, bounded numbers.
    """
    keys = {"dataset", "epochs_created", "shards"}
    if not isinstance(snap, dict) or not keys <= set(snap) <= keys | {"folded_epochs"}:
        got = sorted(snap) if isinstance(snap, dict) else type(snap).__name__
        raise InputError(source, None, "expected an object with keys dataset, epochs_created,"
                         f" shards (and folded_epochs); got {got}")
    raw = snap["dataset"]
    fields = ("name", "num_samples", "shard_size", "seed", "num_epochs", "lease_s", "max_retries")
    if not isinstance(raw, dict) or set(raw) != set(fields):
        raise InputError(source, "dataset", f"expected an object with keys {', '.join(fields)}")
    cfg = DatasetConfig(**raw)
    cfg.validate(source)
    limit = cfg.num_epochs if cfg.num_epochs is not None else MAX_EPOCHS
    epochs = _int(source, "epochs_created", snap["epochs_created"], 1, limit)
    # epochs below folded_epochs list only their shards not DONE (the others are DONE)
    folded = _int(source, "folded_epochs", snap.get("folded_epochs", 0), 0, epochs)
    rows = snap["shards"]
    n = cfg.num_shards
    if epochs * n > MAX_RESTORED_ROWS:
        # (a restore writes every row; a few bytes of folded_epochs must not ask for 2^36)
        raise InputError(source, "epochs_created", f"a restore writes a row per shard of every"
                         f" created epoch, at most {MAX_RESTORED_ROWS:,}; got {epochs} x {n}")
    if not isinstance(rows, list):
        raise InputError(source, "shards", f"expected a list of shard rows, got"
                         f" {type(rows).__name__}")
    out, seen = [], set()
    for i, row in enumerate(rows):
        where = f"shards[{i}]"
        if not isinstance(row, list) or len(row) != len(SNAPSHOT_FIELDS):
            raise InputError(source, where, f"expected [{', '.join(SNAPSHOT_FIELDS)}]")
        epoch, shard, state, consumed, retries, pos, error = row
        _int(source, f"{where}.epoch", epoch, 0, epochs - 1)
        _int(source, f"{where}.shard", shard, 0, n - 1)
        if (epoch, shard) in seen:
            raise InputError(source, where, f"shard {epoch}/{shard} listed twice")
        seen.add((epoch, shard))
        if state not in STATES:
            raise InputError(source, f"{where}.state", f"expected one of {', '.join(STATES)},"
                             f" got {state!r:.40}")
        size = min((shard + 1) * cfg.shard_size, cfg.num_samples) - shard * cfg.shard_size
        _int(source, f"{where}.consumed", consumed, 0, size)
        if state == DONE and consumed != size:
            raise InputError(source, f"{where}.consumed", f"a DONE shard has consumed all"
                             f" {size} samples, got {consumed}")
        if state != DONE and consumed == size:
            # (the service marks a shard DONE by the ack that consumes its last sample: a TODO
            # one with none left was leased with no indices, never acked, and retried until
            # FAILED)
            raise InputError(source, f"{where}.consumed", f"a {state} shard has samples left,"
                             f" got all {size} consumed (that is a DONE shard)")
        # only a FAILED shard is past its retries (max_retries + 1): a TODO one there became
        # FAILED with max_retries + 2 at its next failure, a row the store refuses as damaged
        _int(source, f"{where}.retries", retries, 0,
             cfg.max_retries + 1 if state == FAILED else cfg.max_retries)
        # half the stored range: a restore puts its DOING shards before the lowest position
        # and every later requeue one lower again (-2**62 here made a stored front out of
        # range, and the data set refused as damaged after its own restore)
        _int(source, f"{where}.queue_pos", pos, -MAX_QUEUE_POS // 2, MAX_QUEUE_POS // 2)
        if error is not None and (not isinstance(error, str) or len(error) > MAX_ERROR_CHARS):
            raise InputError(source, f"{where}.error",
                             f"expected null or a string of at most {MAX_ERROR_CHARS} characters")
        out.append((epoch, shard, state, consumed, retries, pos, error))
    listed = sum(1 for e, _ in seen if e >= folded)
    if listed != (epochs - folded) * n:
        raise InputError(source, "shards", f"expected every one of the {n} shards of epochs"
                         f" {folded}..{epochs - 1}, got {listed} rows of them")
    for epoch in range(folded):   # the folded epochs' shards not listed: DONE, as they were
        for shard in range(n):
            if (epoch, shard) not in seen:
                size = min((shard + 1) * cfg.shard_size, cfg.num_samples) - shard * cfg.shard_size
                out.append((epoch, shard, DONE, size, 0, 0, None))
    return cfg, epochs, out
