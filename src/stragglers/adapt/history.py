"""The lease requests a worker made, remembered so that a replayed request id gets the same
shards again (never a new one)."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from stragglers.adapt.dataset import DOING, DONE, DatasetConfig
from stragglers.adapt.replies import Lease, LeaseReply, LeaseStatus
from stragglers.adapt.stored import check_shard, damaged
from stragglers.adapt.store_state import StoreState

# Lease request ids remembered per worker incarnation: a replay of any of the last
# REQUEST_HISTORY requests returns what that request got (never a new shard).
REQUEST_HISTORY = 256


class LeaseHistory(StoreState):
    """ShardStore's memory of lease requests (table lease_requests, per worker incarnation)."""

    def _remember(self, c: sqlite3.Connection, name: str, worker: str, fence: int, seq: int,
                  request_id: str, status: LeaseStatus, leases: list[Lease]) -> None:
        """Record a lease request's answer; forget this worker's requests past REQUEST_HISTORY."""
        seq += 1
        c.execute("INSERT INTO lease_requests VALUES (?,?,?,?,?,?,?)",
                  (name, worker, seq, request_id, fence, status,
                   json.dumps([[x.epoch, x.shard, x.offset] for x in leases])))
        c.execute("UPDATE workers SET seq=? WHERE dataset=? AND worker=?", (seq, name, worker))
        if seq > REQUEST_HISTORY:
            c.execute("DELETE FROM lease_requests WHERE dataset=? AND worker=? AND seq<=?",
                      (name, worker, seq - REQUEST_HISTORY))

    def _replay(self, c: sqlite3.Connection, cfg: DatasetConfig, worker: str, fence: int,
                seen: tuple[Any, Any], now: float) -> LeaseReply:
        """The answer to a request id seen before: its shards as they stand for this worker.

        Nothing new is leased and no retry is counted: a shard still held is renewed (once
        half its lease is spent) and handed out from its current offset; one this incarnation completed (DONE) or no longer
        holds (its lease expired) comes back with no indices and `"held": false`.
        """
        status, recorded = seen
        try:
            keys = [(int(e), int(s), int(o)) for e, s, o in json.loads(recorded)]
        except (TypeError, ValueError):
            raise damaged(cfg.name, f"lease request of worker '{worker}'", "reply") from None
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
