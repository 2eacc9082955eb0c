"""Rows read back from the shard database, checked before they are used.

The file can be damaged or edited behind the service's back (another process, a bad restore of
the file, a disk error). A damaged row of one data set must not become a traceback or a 500 for
every caller: it raises Quarantined naming the data set, the row and the field, so calls on that
data set are refused (503, nothing changed) while every other data set is served as before.
"""

from __future__ import annotations

import re
from typing import TypedDict, TypeGuard

from stragglers.adapt.dataset import (MAX_EPOCHS, MAX_FENCE, MAX_QUEUE_POS, MAX_RETRIES, STATES,
                                      DatasetConfig)
from stragglers.adapt.errors import Quarantined
from stragglers.errors import InputError

_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_BIG = 1 << 62


def damaged(name: str, where: str, problem: str, by: str = "its owner's token") -> Quarantined:
    """The error of a damaged stored row of data set `name` (`by`: who may DELETE it)."""
    return Quarantined(f"data set '{name}' is quarantined: its stored {where} is damaged"
                       f" ({problem}); other data sets are not affected (restore the file from a"
                       f" backup, or DELETE it with {by}: its places are given back)")


def _is_int(value: object, lo: int = -_BIG, hi: int = _BIG) -> TypeGuard[int]:
    return type(value) is int and lo <= value <= hi


def check_rows_key(name: str, rows_key: object) -> str:
    """The key a data set's shard rows are stored under: its name (NULL), or after a restore
    its name, '/' and a hex id."""
    if rows_key is None:
        return name
    if not (isinstance(rows_key, str) and rows_key.startswith(name + "/")
            and re.fullmatch(r"[0-9a-f]{32}", rows_key[len(name) + 1:])):
        raise damaged(name, "row", f"rows_key={rows_key!r:.60}")
    return rows_key


def config_of(name: str, values: tuple) -> DatasetConfig:
    """The DatasetConfig of a datasets row's (num_samples .. max_retries), validated."""
    try:
        cfg = DatasetConfig(name, *values)
        cfg.validate("stored data set")
    except (InputError, TypeError) as exc:
        raise damaged(name, "config", str(getattr(exc, "problem", exc))) from None
    return cfg


def check_dataset_row(name: str, epochs_created: object, front: object, owner: object) -> None:
    """The bookkeeping columns of a datasets row (after its config)."""
    if not _is_int(epochs_created, 0, MAX_EPOCHS):
        raise damaged(name, "row", f"epochs_created={epochs_created!r:.40}")
    if not _is_int(front, -MAX_QUEUE_POS, MAX_QUEUE_POS):
        raise damaged(name, "row", f"front={front!r:.40}")
    if owner is not None and not (isinstance(owner, str) and _DIGEST.match(owner)):
        raise damaged(name, "row", "token_sha256 is not a SHA-256 hex digest",
                      "the service token: its owner cannot be proven")


def check_materialized(cfg: DatasetConfig, value: object) -> int:
    """Shard rows written of the last epoch (NULL: all of them)."""
    if value is None:
        return cfg.num_shards
    if not _is_int(value, 0, cfg.num_shards):
        raise damaged(cfg.name, "row", f"materialized={value!r:.40}")
    return value


def check_worker_row(name: str, worker: str, fence: object, seq: object) -> None:
    """A workers row: its fence and request counter."""
    if not _is_int(fence, 1, MAX_FENCE) or not _is_int(seq, 0):
        raise damaged(name, f"worker '{worker}'", f"fence={fence!r:.40}, seq={seq!r:.40}")


def check_shard(cfg: DatasetConfig, epoch: object, shard: object, start: object, stop: object,
                consumed: object, state: object = "DOING", retries: object = 0) -> None:
    """A shards row against its data set's config: where it lies, its offset, state and retries."""
    where = f"shard {epoch!r:.20}/{shard!r:.20}"
    if not _is_int(epoch, 0, MAX_EPOCHS) or not _is_int(shard, 0, cfg.num_shards - 1):
        raise damaged(cfg.name, "shard row", f"{where} is outside the data set")
    lo = shard * cfg.shard_size
    hi = min(lo + cfg.shard_size, cfg.num_samples)
    if start != lo or stop != hi or type(start) is not int or type(stop) is not int:
        raise damaged(cfg.name, where, f"range {start!r:.20}..{stop!r:.20}, expected {lo}..{hi}")
    if not _is_int(consumed, 0, hi - lo):
        raise damaged(cfg.name, where, f"consumed={consumed!r:.40}, expected 0..{hi - lo}")
    if state not in STATES:
        raise damaged(cfg.name, where, f"state={state!r:.40}")
    if not _is_int(retries, 0, MAX_RETRIES + 1):
        raise damaged(cfg.name, where, f"retries={retries!r:.40}")


# A shard row is valid when this holds (the same checks as check_shard, in SQL: a snapshot or a
# status of 655,360 rows is checked in one scan without building a Python object per row).
# A NULL column makes some terms NULL, not false (`NULL IN (...)`): test it as COALESCE((...), 0)
# (a NULL state passed `NOT (...)` unselected, and the status that read it was a 500).
VALID_SHARD_SQL = (
    "typeof(epoch)='integer' AND epoch BETWEEN 0 AND :epochs - 1"
    " AND typeof(shard)='integer' AND shard BETWEEN 0 AND :shards - 1"
    " AND typeof(start)='integer' AND start = shard * :size"
    " AND typeof(stop)='integer' AND stop = MIN(start + :size, :samples)"
    " AND typeof(consumed)='integer' AND consumed BETWEEN 0 AND stop - start"
    " AND state IN ('TODO', 'DOING', 'DONE', 'FAILED')"
    " AND (state != 'DONE' OR consumed = stop - start)"
    " AND typeof(retries)='integer' AND retries BETWEEN 0 AND :max_retries + 1"
    " AND typeof(queue_pos)='integer' AND queue_pos BETWEEN -:max_pos AND :max_pos"
    " AND (error IS NULL OR (typeof(error)='text' AND length(error) <= 1024))")


class ShardParams(TypedDict):
    """The named parameters of VALID_SHARD_SQL."""

    epochs: int
    shards: int
    size: int
    samples: int
    max_retries: int
    max_pos: int


def shard_params(cfg: DatasetConfig, epochs_created: int) -> ShardParams:
    """The named parameters of VALID_SHARD_SQL for a data set."""
    return ShardParams(epochs=epochs_created, shards=cfg.num_shards, size=cfg.shard_size,
                       samples=cfg.num_samples, max_retries=cfg.max_retries,
                       max_pos=MAX_QUEUE_POS)


def first_bad_shard(conn, cfg: DatasetConfig, epochs_created: int, materialized: int,
                    key: str | None = None) -> None:
    """Raise Quarantined naming the first invalid shard row of the data set (one SQL scan);
    `key`: the key its rows are stored under (check_rows_key; default its name)."""
    key = key or cfg.name
    row = conn.execute(f"SELECT epoch, shard, start, stop, consumed, state, retries FROM shards"
                       f" WHERE dataset=:name AND NOT COALESCE(({VALID_SHARD_SQL}), 0) LIMIT 1",
                       {"name": key, **shard_params(cfg, epochs_created)}).fetchone()
    if row is not None:
        epoch, shard, start, stop, consumed, state, retries = row
        check_shard(cfg, epoch, shard, start, stop, consumed, state, retries)
        raise damaged(cfg.name, f"shard {epoch!r:.20}/{shard!r:.20}",
                      "a DONE shard not fully consumed, a bad queue position or error text")
    count = conn.execute("SELECT COUNT(*) FROM shards WHERE dataset=?", (key,)).fetchone()[0]
    if count != (epochs_created - 1) * cfg.num_shards + materialized:
        raise damaged(cfg.name, "shards table", f"{count} rows, expected {epochs_created - 1} x"
                      f" {cfg.num_shards} + {materialized}")


def check_all_rows(conn, cfg: DatasetConfig, epochs_created: int, materialized: int,
                   key: str) -> None:
    """A data set's full check (its first call's): every shard row (first_bad_shard) and every
    workers row; Quarantined naming the first damaged one."""
    first_bad_shard(conn, cfg, epochs_created, materialized, key)
    bad = conn.execute("SELECT worker, fence, seq FROM workers WHERE dataset=? AND NOT"
                       f" (typeof(fence)='integer' AND fence BETWEEN 1 AND {MAX_FENCE} AND"
                       " typeof(seq)='integer' AND seq >= 0) LIMIT 1", (cfg.name,)).fetchone()
    if bad is not None:
        check_worker_row(cfg.name, str(bad[0]), bad[1], bad[2])
