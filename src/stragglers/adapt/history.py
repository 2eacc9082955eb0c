"""The lease requests a worker made, remembered so that a replayed request id gets the same
shards again (never a new one)."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from stragglers.adapt.dataset import DOING, DONE, MAX_EPOCHS, DatasetConfig
from stragglers.adapt.errors import Conflict
from stragglers.adapt.replies import Lease, LeaseReply, LeaseStatus
from stragglers.adapt.stored import _is_int, check_shard, damaged
from stragglers.adapt.store_state import StoreState

# Lease request ids remembered per worker incarnation: a replay of any of the last
# REQUEST_HISTORY requests returns what that request got (never a new shard) — fewer when the
# data sets of its owner's token have more than HISTORY_ROWS // REQUEST_HISTORY workers in all
# (HISTORY_ROWS shared among them, at least HISTORY_MIN each), and of those, the replies of the newest whose JSON adds up
# to HISTORY_REPLY_BYTES (the last one always); an older id still known is refused (409).
# 1,024 workers x 256 requests x 256 shards each came to ~1.6 GB per data set; now at most
# about 2 x HISTORY_ROWS rows (~700 B each with the longest names: ~23 MB) and 1,024 x ~18 KiB
# of replies (~18 MB).
REQUEST_HISTORY = 256
HISTORY_ROWS = 16_384
HISTORY_MIN = 8
HISTORY_REPLY_BYTES = 8_192
_TRIM_EVERY = 8           # requests between two trims of a worker's replies (small ones)
_BIG_REPLY = 512          # a reply this long is trimmed for at once


class LeaseHistory(StoreState):
    """ShardStore's memory of lease requests (table lease_requests, per worker incarnation)."""

    history_rows = HISTORY_ROWS

    def _remember(self, c: sqlite3.Connection, name: str, worker: str, fence: int, seq: int,
                  request_id: str, status: LeaseStatus, leases: list[Lease]) -> None:
        """Record a lease request's answer; forget this worker's requests past its share of
        the history, and the replies of its older ones past HISTORY_REPLY_BYTES."""
        seq += 1
        reply = json.dumps([[x.epoch, x.shard, x.offset] for x in leases])
        c.execute("INSERT INTO lease_requests VALUES (?,?,?,?,?,?,?)",
                  (name, worker, seq, request_id, fence, status, reply))
        c.execute("UPDATE workers SET seq=? WHERE dataset=? AND worker=?", (seq, name, worker))
        if seq > HISTORY_MIN:
            # (its share counted whenever it may be under seq: counted only past
            # history_rows // REQUEST_HISTORY requests, the workers of a token of over 256
            # kept that many each, not their share)
            keep = self._history_share(c, name)
            if seq > keep:
                c.execute("DELETE FROM lease_requests WHERE dataset=? AND worker=? AND seq<=?",
                          (name, worker, seq - keep))
        if len(reply) > _BIG_REPLY or seq % _TRIM_EVERY == 0:
            self._trim_replies(c, name, worker)

    def _history_share(self, c: sqlite3.Connection, name: str) -> int:
        """Requests each worker of data set `name`'s owner remembers: HISTORY_ROWS shared
        among the workers of all its data sets (each data set's own share let one token's 64
        keep 64 x HISTORY_ROWS, ~700 MB), at least HISTORY_MIN, at most REQUEST_HISTORY."""
        n = c.execute("SELECT COUNT(*) FROM workers w JOIN datasets d ON d.name = w.dataset"
                      " WHERE d.name=? OR d.token_sha256=(SELECT token_sha256 FROM datasets"
                      " WHERE name=?)", (name, name)).fetchone()[0]
        return min(REQUEST_HISTORY, max(HISTORY_MIN, self.history_rows // max(n, 1)))

    def _trim_history(self, c: sqlite3.Connection, name: str) -> None:
        """Every worker of data set `name`'s owner cut to its share (a new name joined: the
        share fell). A worker trims itself only at its own lease: workers joining one after
        another each kept the share of its time, 16,384 x (1 + ln(n / 64)) rows in all."""
        c.execute("DELETE FROM lease_requests WHERE rowid IN (SELECT l.rowid FROM datasets d"
                  " JOIN workers w ON w.dataset = d.name JOIN lease_requests l ON l.dataset ="
                  " w.dataset AND l.worker = w.worker AND l.seq <= w.seq - ? WHERE d.name=? OR"
                  " d.token_sha256=(SELECT token_sha256 FROM datasets WHERE name=?))",
                  (self._history_share(c, name), name, name))

    def _trim_replies(self, c: sqlite3.Connection, name: str, worker: str) -> None:
        """Forget the replies (not the ids) of `worker`'s older requests past
        HISTORY_REPLY_BYTES of JSON, the newest kept first (the last one always)."""
        total, cut = 0, None
        for seq, size in c.execute("SELECT seq, length(reply) FROM lease_requests WHERE"
                                   " dataset=? AND worker=? AND reply IS NOT NULL ORDER BY"
                                   " seq DESC", (name, worker)):
            total += size or 0
            if total > HISTORY_REPLY_BYTES and cut is None and total != (size or 0):
                cut = seq
                break
        if cut is not None:
            c.execute("UPDATE lease_requests SET reply=NULL WHERE dataset=? AND worker=? AND"
                      " seq<=? AND reply IS NOT NULL", (name, worker, cut))

    def _replay(self, c: sqlite3.Connection, cfg: DatasetConfig, worker: str, fence: int,
                seen: tuple[Any, Any], now: float) -> LeaseReply:
        """The answer to a request id seen before: its shards as they stand for this worker.

        Nothing new is leased and no retry is counted: a shard still held is renewed (once
        half its lease is spent) and handed out from its current offset; one this incarnation completed (DONE) or no longer
        holds (its lease expired) comes back with no indices and `"held": false`.
        """
        status, recorded = seen
        if recorded is None:
            raise Conflict(f"lease request of worker '{worker}': too old, its reply is no longer"
                           " kept (nothing was leased); send a new request_id")
        keys = _recorded_keys(cfg, worker, recorded)
        leases: list[Lease] = []
        for epoch, shard, offset in keys:
            row = c.execute("SELECT start, stop, consumed, state, worker, fence, lease_until"
                            " FROM shards WHERE dataset=? AND epoch=? AND shard=?",
                            (self._key(cfg.name), epoch, shard)).fetchone()
            if row is None:
                raise damaged(cfg.name, f"lease request of worker '{worker}'",
                              f"shard {epoch}/{shard} does not exist")
            start, stop, consumed, state, holder, holder_fence, until = row
            mine = holder == worker and holder_fence == fence
            if state == DOING and mine:
                # renewed only once half of it is spent: a replay in a loop wrote (and
                # fsynced) a transaction each time, in the same commits as every job's leases
                if not isinstance(until, (int, float)) or until < now + cfg.lease_s / 2:
                    c.execute("UPDATE shards SET lease_until=? WHERE dataset=? AND epoch=?"
                              " AND shard=?", (now + cfg.lease_s, self._key(cfg.name), epoch,
                                               shard))
                    self._leased_until(cfg.name, now + cfg.lease_s)
                leases.append(self._lease_of(cfg, epoch, shard, start, stop, consumed))
                continue
            check_shard(cfg, epoch, shard, start, stop, consumed, state)
            done = state == DONE and mine
            leases.append(Lease(epoch, shard, consumed if done else offset, [], stop - start,
                                held=False))
        failed, n_failed = self._failed_report(c, cfg.name)
        return LeaseReply(status if status in ("wait", "finished") else "ok", leases, failed,
                          n_failed)


def _recorded_keys(cfg: DatasetConfig, worker: str, recorded: Any) -> list[tuple[int, int, int]]:
    """The (epoch, shard, offset) triples of a stored reply, each inside the data set, else
    Quarantined: a damaged reply (1e400, 2^70, 100,000 nested '[', an offset of -77) was a 500
    on every replay of its id, or an offset handed out as it stood."""
    where = f"lease request of worker '{worker}'"
    try:
        triples = json.loads(recorded)
    except (TypeError, ValueError, RecursionError):
        raise damaged(cfg.name, where, "reply is not JSON") from None
    if not isinstance(triples, list):
        raise damaged(cfg.name, where, "reply is not a list")
    keys = []
    for triple in triples:
        if not (isinstance(triple, list) and len(triple) == 3):
            raise damaged(cfg.name, where, f"reply {triple!r:.40} is not [epoch, shard, offset]")
        epoch, shard, offset = triple
        # the bounds come first: an int past SQLite's 64 bits was an OverflowError at the SELECT
        if not (_is_int(epoch, 0, MAX_EPOCHS) and _is_int(shard, 0, cfg.num_shards - 1)):
            raise damaged(cfg.name, where, f"reply names shard {epoch!r:.20}/{shard!r:.20},"
                          " outside the data set")
        size = min(cfg.shard_size, cfg.num_samples - shard * cfg.shard_size)
        if not _is_int(offset, 0, size):
            raise damaged(cfg.name, where, f"reply offset {offset!r:.20} of shard"
                          f" {epoch}/{shard}, expected 0..{size}")
        keys.append((epoch, shard, offset))
    return keys
