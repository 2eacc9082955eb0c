"""Shards going back to the queue: expired leases, releases, failures and their retries."""

from __future__ import annotations

import math
import sqlite3

from stragglers.adapt.dataset import FAILED, MAX_FAILED_IN_REPLY, TODO, DatasetConfig
from stragglers.adapt.replies import FailedShard, Requeued, ShardKey
from stragglers.adapt.schema import EXPIRED
from stragglers.adapt.stored import damaged
from stragglers.adapt.store_state import StoreState

# Rows one give-back step touches on the commit thread (~1.5 ms; 1,024 took 11 ms, more on a
# loaded machine): the calls batched with a step wait for it, so five tokens each giving back
# 1,024 shards a call held another job's lease + ack at 29x its quiet latency. A release or
# join holding more gives the rest back in paced steps (PacedWriter), other calls between.
GIVE_BACK_STEP = 128
EXPIRE_CHUNK = GIVE_BACK_STEP   # expired leases one call requeues (the rest: the next calls)
RETRY_CHUNK = GIVE_BACK_STEP    # FAILED shards one step of retry_failed requeues


class Requeues(StoreState):
    """ShardStore's requeues: a DOING shard back at the front of TODO (or FAILED past its
    retries), expired leases found cheaply (a lower bound of the next expiry kept in memory),
    and the FAILED report of lease replies."""

    def _requeue(self, c: sqlite3.Connection, cfg: DatasetConfig, front: int, epoch: int, shard: int,
                 retries: int, failure: bool, error: str | None) -> int:
        """Put a DOING shard back at the front of TODO, or FAILED past the retry bound."""
        if type(retries) is not int:
            raise damaged(cfg.name, f"shard {epoch}/{shard}", f"retries={retries!r:.40}")
        # (capped: a stored count already at the bound, an edited row, stays a valid one)
        retries = min(retries + (1 if failure else 0), cfg.max_retries + 1)
        front -= 1
        state = FAILED if retries > cfg.max_retries else TODO
        if state == FAILED:
            self._failed_cache.pop(cfg.name, None)
        c.execute("UPDATE shards SET state=?, worker=NULL, fence=NULL, lease_until=NULL,"
                  " retries=?, queue_pos=?, error=COALESCE(?, error) WHERE dataset=? AND"
                  " epoch=? AND shard=?", (state, retries, front, error, self._key(cfg.name), epoch,
                                             shard))
        return front

    def _expire(self, c: sqlite3.Connection, cfg: DatasetConfig, front: int, now: float,
                caller: tuple[str, int] | None = None) -> int:
        """Requeue up to EXPIRE_CHUNK expired leases; their holders (but `caller`, the worker
        and fence of the lease calling: alive) are marked EXPIRED."""
        if cfg.name in self._grace:
            # First call since this store was opened (a service restart): the holders could not
            # renew while no service ran, so each lease gets a full lease_s from now: none
            # expires before then (kept in memory: writing every held lease's deadline again
            # was one UPDATE of up to 1,024 workers x 1,024 rows, every other job's calls
            # waiting for it after each restart or pause)
            self._grace.discard(cfg.name)
            before = self._grace_until.get(cfg.name)
            self._grace_until[cfg.name] = now + cfg.lease_s
            self._undo.append(lambda: self._regrace(cfg.name, before))
            self._next_expiry.pop(cfg.name, None)   # (a damaged deadline may have shrunk)
            return front
        until = self._grace_until.get(cfg.name)
        if until is not None:
            if now <= until:
                return front   # none ends before `until`; one renewed since, at its deadline
            del self._grace_until[cfg.name]
            self._undo.append(lambda: self._grace_until.__setitem__(cfg.name, until))
        bound = self._next_expiry.get(cfg.name)
        if bound is not None and now <= bound:
            return front  # no DOING lease ends before `bound`: nothing can have expired
        # No lease ends later than lease_s from now (a lease or an ack sets now + lease_s): a
        # deadline past that (an edited or damaged row: far future, inf, NULL, text, which
        # SQLite orders after every number; or a wall clock stepped back) would hold its shard
        # for ever, so it is cut to a full lease from now.
        # (at the end of a restart's grace, such a deadline ends with the grace: it was not
        # renewed since, which would have set a true one)
        c.execute("UPDATE shards SET lease_until=:to WHERE dataset=:key AND state='DOING' AND"
                  " (lease_until IS NULL OR lease_until > :cap)",
                  {"cap": now + cfg.lease_s, "to": now + cfg.lease_s if until is None else until,
                   "key": self._key(cfg.name)})
        # At most EXPIRE_CHUNK a call, the longest expired first (the rest: the next call,
        # the kept bound then being theirs): 262,144 leases expired at once were requeued in
        # one call, seconds that every other job's calls waited for.
        expired = c.execute("SELECT epoch, shard, retries, worker, fence FROM shards INDEXED BY"
                            " shards_lease WHERE dataset=? AND state='DOING' AND lease_until<?"
                            " ORDER BY lease_until LIMIT ?",
                            (self._key(cfg.name), now, EXPIRE_CHUNK)).fetchall()
        for epoch, shard, retries, worker, _ in expired:
            front = self._requeue(c, cfg, front, epoch, shard, retries, True,
                                  f"lease of {worker} expired")
        # A holder whose lease expired has gone as one that released has (until it leases or
        # acks again): once it holds nothing its place of max_workers_per_dataset is a new
        # name's (an expired worker kept its place for good, a new pod's join 429). Only the
        # incarnation that held the shard (a successor joined since is not gone), and only a
        # mark of its own (LEFT, a release, stays).
        c.executemany("UPDATE workers SET reply=? WHERE dataset=? AND worker=? AND fence=? AND"
                      " reply IS NULL", {(EXPIRED, cfg.name, worker, fence)
                                         for _, _, _, worker, fence in expired
                                         if (worker, fence) != caller})
        earliest = c.execute("SELECT MIN(lease_until) FROM shards WHERE dataset=? AND"
                             " state='DOING'", (self._key(cfg.name),)).fetchone()[0]
        self._next_expiry[cfg.name] = math.inf if earliest is None else earliest
        return front

    def _regrace(self, name: str, until: float | None) -> None:
        """Undo of the first call's grace (a rolled-back call): granted again next call."""
        self._grace.add(name)
        if until is None:
            self._grace_until.pop(name, None)
        else:
            self._grace_until[name] = until

    def _leased_until(self, name: str, deadline: float) -> None:
        """A DOING shard of `name` now ends at `deadline`: keep next_expiry a lower bound."""
        bound = self._next_expiry.get(name)
        if bound is not None and deadline < bound:
            self._next_expiry[name] = deadline

    def _failed_report(self, c: sqlite3.Connection, name: str) -> tuple[list[FailedShard], int]:
        """The FAILED report of a lease reply (first MAX_FAILED_IN_REPLY), kept in memory."""
        report = self._failed_cache.get(name)
        if report is None:
            report = self._failed_cache[name] = self._failed(c, name, MAX_FAILED_IN_REPLY)
        return list(report[0]), report[1]   # FailedShard is frozen: the rows are shared

    def _release_rows(self, c: sqlite3.Connection, cfg: DatasetConfig, front: int, worker: str,
                      fence: int | None, failure: bool, error: str | None,
                      keep: int | None = None, limit: int | None = None) -> list[ShardKey]:
        """Requeue `worker`'s DOING shards (of incarnation `fence`, or of every one but
        `keep`: a join's own), at most `limit` (a give-back step)."""
        rows = c.execute("SELECT epoch, shard, retries FROM shards WHERE dataset=:key AND"
                         " worker=:worker AND state='DOING' AND (:fence IS NULL OR fence=:fence)"
                         " AND (:keep IS NULL OR fence IS NOT :keep) ORDER BY epoch, shard LIMIT :n",
                         {"key": self._key(cfg.name), "worker": worker, "fence": fence,
                          "keep": keep, "n": -1 if limit is None else limit}).fetchall()
        for epoch, shard, retries in rows:
            front = self._requeue(c, cfg, front, epoch, shard, retries, failure, error)
        c.execute("UPDATE datasets SET front=? WHERE name=?", (front, cfg.name))
        return [(e, s) for e, s, _ in rows]

    def give_back(self, name: str, worker: str, fence: int | None, keep: int | None,
                  failure: bool, error: str | None, limit: int = GIVE_BACK_STEP,
                  token_sha256: str | None = None) -> list[ShardKey]:
        """A step of a release or join that had more to give back than its own call: up to
        `limit` more DOING shards of `worker` (of incarnation `fence`, or of every one but
        `keep`) requeued; fewer than `limit` when none are left."""
        with self._tx() as c:
            cfg, _, front = self._config(c, name, token_sha256)
            return self._release_rows(c, cfg, front, worker, fence, failure, error, keep,
                                      limit)

    def retry_failed(self, name: str, token_sha256: str | None = None,
                     limit: int | None = None) -> Requeued:
        """Put every FAILED shard back at the front of TODO with its retry count reset (at most
        `limit`, the first by epoch and shard: a step of it; the service runs steps until one
        requeues fewer, other jobs' calls between them)."""
        with self._tx() as c:
            cfg, _, front = self._config(c, name, token_sha256)
            rows = c.execute("SELECT epoch, shard FROM shards INDEXED BY shards_queue WHERE"
                             " dataset=? AND state='FAILED' ORDER BY epoch, shard LIMIT ?",
                             (self._key(name), -1 if limit is None else limit)).fetchall()
            self._failed_cache.pop(name, None)
            self._closed_epochs.pop(name, None)   # (an epoch done but for its FAILED reopens)
            for epoch, shard in sorted(rows):
                front -= 1
                c.execute("UPDATE shards SET state='TODO', retries=0, queue_pos=? WHERE"
                          " dataset=? AND epoch=? AND shard=?",
                          (front, self._key(name), epoch, shard))
            c.execute("UPDATE datasets SET front=? WHERE name=?", (front, name))
        return Requeued([(e, s) for e, s in sorted(rows)])

    def _failed(self, c: sqlite3.Connection, name: str,
                limit: int | None = None) -> tuple[list[FailedShard], int]:
        # INDEXED BY: the FAILED rows' range of the queue index, sorted (without it SQLite
        # walks the primary key for the ORDER BY); only the first `limit` become objects.
        rows = c.execute("SELECT epoch, shard, start, stop, consumed, retries, error FROM shards"
                         " INDEXED BY shards_queue WHERE dataset=? AND state='FAILED'"
                         " ORDER BY epoch, shard LIMIT ?",
                         (self._key(name), -1 if limit is None else limit)).fetchall()
        total = len(rows) if limit is None or len(rows) < limit else c.execute(
            "SELECT COUNT(*) FROM shards INDEXED BY shards_queue WHERE dataset=? AND"
            " state='FAILED'", (self._key(name),)).fetchone()[0]
        try:
            return ([FailedShard(e, s, b - a - k, r, err) for e, s, a, b, k, r, err in rows],
                    total)
        except TypeError:
            raise damaged(name, "FAILED shard row", "a column is not an integer") from None

    def expire(self, name: str) -> None:
        """Requeue the shards of `name` whose lease ended (what a lease call does first)."""
        now = self._clock()
        with self._tx() as c:
            cfg, _, front0 = self._config(c, name, write=False)
            front = self._expire(c, cfg, front0, now)
            if front != front0:
                c.execute("UPDATE datasets SET front=? WHERE name=?", (front, name))
