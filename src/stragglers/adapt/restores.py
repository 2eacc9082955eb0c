"""Restores of a data set from a snapshot, written beside its old rows a chunk at a time.

A snapshot of 65,536 shards x 10 epochs is 655,360 rows: deleting the old rows and inserting the
new ones in one transaction held the commit thread (every other job's leases) for ~5.6 s. Here
the rows are checked and prepared off the commit thread (prepare_restore), written under a key of
their own RESTORE_CHUNK rows per transaction (restore_rows; other calls run between chunks), and
the data set switches to them in one small transaction (restore_finish); the old rows are then
deleted GARBAGE_CHUNK at a time (collect_garbage). A restore interrupted half-way changes nothing:
its rows are deleted as garbage, at the latest after the next start (once a write fits).
"""

from __future__ import annotations

import errno
import functools
import marshal
import sqlite3
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from stragglers.adapt import reads
from stragglers.adapt.dataset import DOING, TODO, DatasetConfig, validate_snapshot
from stragglers.adapt.errors import (Conflict, DiskFull, Forbidden, QuotaExceeded, Quarantined,
                                     authorize)
from stragglers.adapt.floors import keep_fence_floor, pin_fence_floor
from stragglers.adapt.replies import Deleted, Restored
from stragglers.adapt.requeues import GIVE_BACK_STEP
from stragglers.adapt.space import Reserve, restore_bound
from stragglers.adapt.stored import check_dataset_row
from stragglers.adapt.store_state import StoreState
from stragglers.errors import EnvironmentFailure

RESTORE_CHUNK = 512    # rows written per transaction (a few ms of the commit thread)
GARBAGE_CHUNK = GIVE_BACK_STEP   # old rows deleted per transaction (a paced step)
# A kept lease reply (a JSON list of [epoch, shard, offset]) naming an epoch >= the second
# parameter: one a restore's snapshot has not created. A reply that is no JSON is left to the
# replay's check (history._recorded_keys: the data set quarantined).
_NAMES_LATER_EPOCH = ("reply IS NOT NULL AND CASE WHEN json_valid(reply) THEN EXISTS (SELECT 1"
                      " FROM json_tree(lease_requests.reply) t WHERE t.path != '$' AND t.key ="
                      " 0 AND t.type = 'integer' AND t.atom >= ?) ELSE 0 END")


@dataclass(frozen=True)
class StaleReplies:
    """The kept lease replies of a data set that name an epoch past a restore's snapshot, read
    before its switch (json_tree over up to ~15 MB of replies: 0.32 s, see stale_replies):
    their (worker, fence, seq), and each worker's (fence, seq) then — rows past those (leased
    since) are the only ones the switch reads."""

    name: str
    epochs_created: int
    keys: tuple[tuple[Any, Any, Any], ...]
    marks: dict[Any, tuple[Any, Any]]


def stale_replies(conn: sqlite3.Connection, name: str, epochs_created: int) -> StaleReplies:
    """StaleReplies of data set `name` for a snapshot of `epochs_created` epochs, read in the
    transaction `conn` is in (the switch's) or else in one read transaction of its own."""
    if not conn.in_transaction:
        with reads._read(conn):
            return stale_replies(conn, name, epochs_created)
    marks = {w: (f, s) for w, f, s in conn.execute(
        "SELECT worker, fence, seq FROM workers WHERE dataset=?", (name,))}
    keys = conn.execute("SELECT worker, fence, seq FROM lease_requests WHERE dataset=? AND "
                        + _NAMES_LATER_EPOCH, (name, epochs_created)).fetchall()
    return StaleReplies(name, epochs_created, tuple(keys), marks)


@dataclass(frozen=True)
class PreparedRestore:
    """The shard rows a restore writes (without their key), computed before any transaction.

    The rows are packed RESTORE_CHUNK to a bytes object (marshal: ints, strings and None, no
    code): they cross from the process that prepares them as a few hundred bytes objects, and
    each commit step unpacks only its own chunk.
    """

    cfg: DatasetConfig
    epochs_created: int
    chunks: tuple[bytes, ...]
    count: int
    front: int
    requeued_first: int
    open_rows: int   # rows of its epochs not done (max_shard_rows_per_token)

    def chunk(self, i: int) -> list[tuple]:
        """The rows of chunk `i` (at most RESTORE_CHUNK)."""
        return marshal.loads(self.chunks[i])


def prepare_restore(checked: tuple) -> PreparedRestore:
    """The rows of a validated snapshot as restore writes them: DOING shards back to TODO at
    the front of the queue (in their queue order), every other row as it was."""
    cfg, epochs_created, rows = checked
    doing = sorted((r for r in rows if r[2] == DOING), key=lambda r: r[5])
    front = min([0] + [r[5] for r in rows]) - len(doing) - 1
    pos_of_doing = {(r[0], r[1]): front + i for i, r in enumerate(doing)}
    size, n = cfg.shard_size, cfg.num_samples
    out = [(e, s, s * size, min((s + 1) * size, n), TODO if st == DOING else st,
            None, None, None, consumed, retries, pos_of_doing.get((e, s), pos), err)
           for e, s, st, consumed, retries, pos, err in rows]
    chunks = tuple(marshal.dumps(out[i:i + RESTORE_CHUNK])
                   for i in range(0, len(out), RESTORE_CHUNK))
    # (the rows max_shard_rows_per_token counts: from the first epoch not done)
    first = min([epochs_created] + [r[0] for r in out if r[4] == TODO])
    open_rows = sum(1 for r in out if r[0] >= first)
    return PreparedRestore(cfg, epochs_created, chunks, len(out), front, len(doing), open_rows)


# A data set's shard rows, from its row alone: every epoch before its last whole, and the
# last's rows written so far (materialized; NULL: all of them)
_SHARDS = "((num_samples + shard_size - 1) / shard_size)"
_ROWS = (f"CASE WHEN epochs_created > 0 THEN (epochs_created - 1) * {_SHARDS} +"
         f" COALESCE(materialized, {_SHARDS}) ELSE 0 END")


class Restores(StoreState):
    """ShardStore's restores and quotas (what a token or a client may create)."""

    def _check_quota(self, c: sqlite3.Connection, token_sha256: str | None,
                     creator: str | None = None, reclaim: bool = False) -> None:
        """Refuse a new data set past the service's, this token's or this client's limit
        (QuotaExceeded: 429): minting tokens does not get one client past its share.
        `reclaim` (a write transaction): unused data sets give their places, once every limit
        is known to pass without them (a refused creation deletes nothing)."""
        total = c.execute("SELECT COUNT(*) FROM datasets").fetchone()[0]
        unused = []
        if total >= self.max_datasets and reclaim:
            unused = self._unused(c, total - self.max_datasets + 1)
        if total - len(unused) >= self.max_datasets:
            raise QuotaExceeded(f"the service holds {total} data sets, its limit"
                                f" (max_datasets={self.max_datasets})")
        if creator is not None:
            theirs = c.execute("SELECT COUNT(*) FROM datasets WHERE creator=?",
                               (creator,)).fetchone()[0]
            theirs -= sum(u[3] == creator for u in unused)
            if theirs >= self.max_datasets_per_client:
                raise QuotaExceeded(f"client {creator} already created {theirs} data sets"
                                    f" (under any token), its limit (max_datasets_per_client="
                                    f"{self.max_datasets_per_client})")
        if token_sha256 is not None:   # (None: in-process use without tokens)
            mine = c.execute("SELECT COUNT(*) FROM datasets WHERE token_sha256=?",
                             (token_sha256,)).fetchone()[0]
            mine -= sum(u[2] == token_sha256 for u in unused)
            if mine >= self.max_datasets_per_token:
                raise QuotaExceeded(f"this token already owns {mine} data sets, its limit"
                                    f" (max_datasets_per_token={self.max_datasets_per_token})")
        for name, key, _, _ in unused:
            self._remove(c, name, key)
            self._reclaimed.append(name)
            self._undo.append(functools.partial(_unlist, self._reclaimed, name))

    def _check_rows(self, c: sqlite3.Connection, name: str, more: int,
                    token_sha256: str | None = None, replacing: bool = False) -> None:
        """Refuse (QuotaExceeded: 429, before a row is written) `more` shard rows for data set
        `name` where its owner's data sets would then hold over max_shard_rows_per_token rows
        in epochs not done (`replacing`: a restore, whose rows replace the data set's;
        `token_sha256`: the owner where the data set does not exist yet). Each data set's own
        bound (max_rows_ahead) let one token's 64 data sets write 64 x 2**18 = 16.7M rows
        without acking one; epochs done are not counted (a long job's epochs are its work)."""
        if token_sha256 is None:
            row = c.execute("SELECT token_sha256 FROM datasets WHERE name=?",
                            (name,)).fetchone()
            token_sha256 = None if row is None else row[0]
        if not isinstance(token_sha256, str):
            return   # (in-process use without tokens)
        sets = [r for r in c.execute(
            f"SELECT name, COALESCE(rows_key, name), epochs_created, {_SHARDS}, {_ROWS} FROM"
            " datasets WHERE token_sha256=?", (token_sha256,)).fetchall()
            # (a damaged row counts nothing: its data set is quarantined)
            if not (replacing and r[0] == name) and isinstance(r[1], str)
            and all(type(v) is int and v >= 0 for v in r[2:])]
        # (the epochs known done first; the shard rows looked at only near the limit)
        if self._open_rows(c, sets, False) + more <= self.max_shard_rows_per_token:
            return
        have = self._open_rows(c, sets, True) + more
        if have <= self.max_shard_rows_per_token:
            return
        raise QuotaExceeded(f"this token's data sets would hold {have} shard rows in epochs"
                            " not done, over its limit (max_shard_rows_per_token="
                            f"{self.max_shard_rows_per_token}; an epoch counts until all its"
                            f" shards are acked or failed): nothing was written for '{name}';"
                            " ack what is leased, or delete data sets finished with")

    def _open_rows(self, c: sqlite3.Connection, sets: list[tuple], look: bool) -> int:
        """The shard rows of `sets` (name, rows key, epochs created, shards an epoch, rows) from
        each one's first epoch holding a TODO or DOING row; `look`:
        the epochs past those known done are read (each epoch found done is kept)."""
        total = 0
        for name, key, epochs, shards, rows in sets:
            done = min(self._closed_epochs.get(name, 0), epochs)
            while look and done < epochs and c.execute(
                    "SELECT 1 FROM shards WHERE dataset=? AND epoch=? AND state IN ('TODO',"
                    " 'DOING') LIMIT 1", (key, done)).fetchone() is None:
                done += 1
            if look:
                self._closed_epochs[name] = done   # (dropped by _forget: a rollback, a restore)
            total += max(0, rows - done * shards)
        return total

    def _unused(self, c: sqlite3.Connection, n: int) -> list[tuple[str, str, object, object]]:
        """Up to `n` data sets that hold nothing, oldest first, as (name, rows key, owner,
        creator): created at least unused_dataset_s ago (by this process; before it started,
        counted from its start), no worker ever joined (no workers row), no restore into it
        being written (its owner's progress is on its way), one epoch, every shard row TODO
        and unconsumed. Looks at 16 at most (a restored one holds progress)."""
        since = self._clock() - self.unused_dataset_s
        if min(self._created_at.values(), default=self._started) > since \
                and self._started > since:
            return []   # (none old enough: no scan)
        rows = c.execute("SELECT name, COALESCE(rows_key, name), token_sha256, creator FROM"
                         " datasets d WHERE epochs_created=1 AND NOT EXISTS (SELECT 1 FROM"
                         " workers w WHERE w.dataset=d.name) AND NOT EXISTS (SELECT 1 FROM"
                         " row_sets r WHERE r.dataset=d.name AND r.state='writing')").fetchall()
        aged = sorted((self._created_at.get(row[0], self._started), row) for row in rows)
        out: list[tuple[str, str, object, object]] = []
        for at, row in aged[:16]:
            if len(out) >= n or at > since:
                break
            if c.execute("SELECT 1 FROM shards WHERE dataset=? AND (state IS NOT 'TODO' OR"
                         " consumed IS NOT 0) LIMIT 1", (row[1],)).fetchone() is None:
                out.append(row)
        return out

    def reclaimed(self) -> list[str]:
        """The unused data sets _check_quota deleted since the last call (the service's caches)."""
        names, self._reclaimed = self._reclaimed, []
        return names

    def delete_dataset(self, name: str, token_sha256: str | None = None,
                       operator: bool = False) -> Deleted:
        """Delete a data set (its owner's call): its places of max_datasets and of its token's
        and client's quotas are given back at once; its shard rows become garbage, deleted in
        paced steps (collect_garbage), and its name may be created again (its fence floor
        kept: the new one's fences start above every fence of this one).

        A quarantined data set (a damaged row) is deleted too, none of its shard rows read:
        by its owner (the datasets row's owner, when that reads) or by the `operator` (the
        service token). Else its places were held for good: every call on it 503, DELETE too.
        """
        with self._tx() as c:
            try:
                cfg, _, _ = self._config(c, name, token_sha256)
            except Quarantined:
                return self._delete_quarantined(c, name, token_sha256, operator)
            self._remove(c, name, self._key(name))
        return Deleted(name, cfg.num_samples)

    def _delete_quarantined(self, c: sqlite3.Connection, name: str, token_sha256: str | None,
                            operator: bool) -> Deleted:
        """delete_dataset of a quarantined data set, judged on its datasets row alone."""
        owner, samples, key = c.execute("SELECT token_sha256, num_samples, COALESCE(rows_key,"
                                        " name) FROM datasets WHERE name=?", (name,)).fetchone()
        if not operator:
            check_dataset_row(name, 0, 0, owner)   # (damaged: the service token's alone)
            authorize(owner, token_sha256, f"data set '{name}'")
        # (a damaged key that is no text: the rows under the name, if any, go)
        self._remove(c, name, key if isinstance(key, str) else name)
        return Deleted(name, samples if type(samples) is int and samples >= 0 else 0)

    def _remove(self, c: sqlite3.Connection, name: str, key: str) -> None:
        """Delete data set `name` (its rows, under `key`, left as garbage) in transaction c."""
        self._touched.add(name)
        self._gone.add(name)   # (its generation dropped at the commit)
        c.execute("DELETE FROM datasets WHERE name=?", (name,))
        keep_fence_floor(c, name, key, self.max_kept_floors)   # (before its workers go)
        c.execute("DELETE FROM workers WHERE dataset=?", (name,))
        c.execute("DELETE FROM lease_requests WHERE dataset=?", (name,))
        c.execute("INSERT OR REPLACE INTO row_sets VALUES (?,?,'garbage')", (key, name))
        self._forget()
        # (all of it put back if the transaction is rolled back: a refused call changes nothing)
        held: list[tuple[dict[str, Any], object]] = [
            (d, d.pop(name)) for d in (self._created_at, self._keys, self._owners,
                                       self._grace_until, self._quarantined) if name in d]
        sets = [s for s in (self._verified, self._grace) if name in s]
        for s in sets:
            s.discard(name)
        self._undo.append(lambda: _put_back(name, held, sets))

    def _fresh_key(self, c: sqlite3.Connection, name: str) -> str | None:
        """The key of a new data set's rows: its name (NULL), unless rows of a deleted one
        of that name are still there to delete (then a key of its own: never mixed)."""
        left = c.execute("SELECT 1 FROM shards WHERE dataset=? LIMIT 1", (name,)).fetchone()
        return None if left is None else f"{name}/{uuid.uuid4().hex}"

    def may_restore(self, name: str, token_sha256: str | None, may_create: bool,
                    conn: sqlite3.Connection | None = None,
                    creator: str | None = None) -> None:
        """The checks of a restore that need no body: ownership, creation right and quota.

        Run before a snapshot body (up to max_restore_bytes) is read: a stranger's token is
        refused without reading or parsing anything.
        """
        conn = conn or self._read_conn()
        exists, owner = reads.owner_of(conn, name)
        if exists:
            authorize(owner, token_sha256, f"data set '{name}'")
            return
        if not may_create:
            raise Forbidden(f"restoring creates data set '{name}': that needs the service token")
        self._check_quota(conn, token_sha256, creator)

    def restore(self, snap: dict, token_sha256: str | None = None,
                may_create: bool = True) -> Restored:
        """Replace a data set's state with a validated snapshot: its DOING shards go first.

        Refused (nothing changed) when the snapshot is inconsistent (a shard missing or twice,
        an offset outside its shard, an unknown state) or its config differs from the data
        set's: a restore never loses samples silently nor changes a lease time.
        """
        return self.restore_prepared(prepare_restore(validate_snapshot(snap)), token_sha256,
                                     may_create)

    def restore_prepared(self, prepared: PreparedRestore, token_sha256: str | None = None,
                         may_create: bool = True, creator: str | None = None) -> Restored:
        """restore() of a prepared snapshot, every step in a row (the service paces them)."""
        reserve = self.restore_reserve(prepared)
        try:
            key = self.restore_begin(prepared, token_sha256, may_create, creator)
            try:
                for i in range(len(prepared.chunks)):
                    self.restore_rows(key, prepared.chunk(i))
                reply = self.restore_finish(prepared, key, token_sha256, may_create, creator)
            except BaseException:
                reserve.release()   # (its space is what the deletion writes)
                self.restore_abort(key)
                while self.collect_garbage(key):
                    pass
                raise
        finally:
            reserve.release()
        while self.collect_garbage():
            pass
        return reply

    def restore_reserve(self, prepared: PreparedRestore) -> Reserve:
        """Space set aside for taking a restore's rows back (see space.Reserve), taken before
        any is written; DiskFull (nothing written) when the disk has no room for the rows and
        their reserve. (A restore refused for space half-way left its rows staged: deleting
        them writes the log too, and the full disk refused it.)"""
        need = restore_bound(prepared.count, len(prepared.cfg.name) + 33,
                             sum(len(c) for c in prepared.chunks))
        try:
            return Reserve(self.db, need)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                # (a folder that refuses a new file: 503 naming it, not a 500)
                raise EnvironmentFailure("shard store", "cannot set aside space for the"
                                         f" restore beside {self.db} ({exc.strerror})"
                                         ) from None
            raise DiskFull("shard store", f"its disk has no room for the restore of"
                           f" '{prepared.cfg.name}' ({prepared.count} shard rows: about"
                           f" {need / 2**20:.3g} MiB set aside to take them back if the disk"
                           " fills, and as much for the rows); nothing was written (retry once"
                           " space is freed)") from None

    def _restore_checks(self, c: sqlite3.Connection, cfg: DatasetConfig, token_sha256: str | None,
                        may_create: bool, creator: str | None, rows: int) -> bool:
        """Whether the data set exists; Forbidden, Conflict or QuotaExceeded (its `rows`
        included) when the restore may not happen (checked when it begins and again when it
        switches)."""
        if c.execute("SELECT 1 FROM datasets WHERE name=?", (cfg.name,)).fetchone() is None:
            if not may_create:
                raise Forbidden(f"restoring creates data set '{cfg.name}': that needs the"
                                " service token")
            self._check_quota(c, token_sha256, creator)
            self._check_rows(c, cfg.name, rows, token_sha256)
            pin_fence_floor(c, cfg.name)   # (as create_dataset: refused before a row is written)
            return False
        have, _, _ = self._config(c, cfg.name, token_sha256)
        if have != cfg:
            raise Conflict(f"snapshot of '{cfg.name}' has another config than the data"
                           f" set: {asdict(cfg)} vs {asdict(have)}")
        self._check_rows(c, cfg.name, rows, replacing=True)
        return True

    def restore_begin(self, prepared: PreparedRestore, token_sha256: str | None = None,
                      may_create: bool = True, creator: str | None = None) -> str:
        """Check a restore and open the key its rows are written under (restore_rows)."""
        with self._tx() as c:
            self._restore_checks(c, prepared.cfg, token_sha256, may_create, creator,
                                 prepared.open_rows)
            key = f"{prepared.cfg.name}/{uuid.uuid4().hex}"   # '/' is in no data set name
            c.execute("INSERT INTO row_sets VALUES (?,?,'writing')", (key, prepared.cfg.name))
        return key

    def restore_rows(self, key: str, rows: list[tuple]) -> int:
        """Write one chunk of a restore's rows under its key (invisible until it switches)."""
        with self._tx() as c:
            c.executemany("INSERT INTO shards VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                          [(key, *r) for r in rows])
        return len(rows)

    def stale_replies(self, prepared: PreparedRestore) -> StaleReplies:
        """The lease replies restore_finish drops, read on this thread's read connection (the
        service: off the commit thread, just before the switch)."""
        return stale_replies(self._read_conn(), prepared.cfg.name, prepared.epochs_created)

    def _drop_stale_replies(self, c: sqlite3.Connection, name: str, epochs_created: int,
                            stale: StaleReplies | None) -> None:
        """Forget the kept replies of `name` naming an epoch from `epochs_created` on: those
        `stale` found, and those of requests made since it was read (a worker whose fence or
        request counter moved: its rows past its mark); all of them read here without it."""
        if stale is None or (stale.name, stale.epochs_created) != (name, epochs_created):
            stale = stale_replies(c, name, epochs_created)   # (no marks past it: all read)
        c.executemany("UPDATE lease_requests SET reply=NULL WHERE dataset=? AND worker=? AND"
                      " fence=? AND seq=?", [(name, *k) for k in stale.keys])
        for worker, fence, seq in c.execute("SELECT worker, fence, seq FROM workers WHERE"
                                            " dataset=?", (name,)).fetchall():
            mark = stale.marks.get(worker)
            if mark == (fence, seq):
                continue   # (no request since: every row it holds was read)
            # (a join deletes the rows of earlier incarnations: another fence, all are new)
            after = mark[1] if mark is not None and mark[0] == fence else None
            c.execute("UPDATE lease_requests SET reply=NULL WHERE dataset=? AND worker=? AND"
                      " (? IS NULL OR seq > ?) AND " + _NAMES_LATER_EPOCH,
                      (name, worker, after, after, epochs_created))

    def restore_finish(self, prepared: PreparedRestore, key: str,
                       token_sha256: str | None = None, may_create: bool = True,
                       creator: str | None = None,
                       stale: StaleReplies | None = None) -> Restored:
        """Switch the data set to the rows written under `key` (one small transaction); its
        old rows become garbage (collect_garbage). Its lease request ids are kept: one replayed
        after the restore answers its shards as they now stand (never a new one); `stale`:
        the replies to drop read beforehand (else read here, on the commit thread)."""
        cfg = prepared.cfg
        with self._tx() as c:
            exists = self._restore_checks(c, cfg, token_sha256, may_create, creator,
                                          prepared.open_rows)
            state = c.execute("SELECT state FROM row_sets WHERE rows_key=?", (key,)).fetchone()
            if state is None or state[0] != "writing" or key in self._cut_short:
                raise Conflict(f"the restore of '{cfg.name}' was interrupted (the service"
                               " restarted while writing it); send it again")
            self._forget()
            self._touched.add(cfg.name)
            # The workers' fences and request counters stay, so their ids stay too: with the
            # history dropped, an id replayed after the restore was a new request and leased
            # new shards (orphans). A kept reply names shards by (epoch, shard), the same in
            # the snapshot's rows (same config); one naming an epoch the snapshot has not
            # created yet keeps its id but not its reply (a replay: 409, nothing leased).
            self._drop_stale_replies(c, cfg.name, prepared.epochs_created, stale)
            c.execute("DELETE FROM row_sets WHERE rows_key=?", (key,))
            if exists:
                c.execute("INSERT OR REPLACE INTO row_sets VALUES (?,?,'garbage')",
                          (self._key(cfg.name), cfg.name))
                c.execute("UPDATE datasets SET epochs_created=?, front=?, materialized=NULL,"
                          " rows_key=? WHERE name=?",
                          (prepared.epochs_created, prepared.front, key, cfg.name))
            else:
                c.execute("INSERT INTO datasets VALUES (?,?,?,?,?,?,?,?,?,?,NULL,?,?)",
                          (cfg.name, cfg.num_samples, cfg.shard_size, cfg.seed,
                           cfg.num_epochs, cfg.lease_s, cfg.max_retries,
                           prepared.epochs_created, prepared.front, token_sha256, key, creator))
            self._keys[cfg.name] = key
            self._created_at[cfg.name] = self._clock()   # (in use: its owner's restore)
            # (its rows are the snapshot's, validated by the parser: a data set restored as
            # a new one was never marked, and its next write scanned all its rows again)
            self._verified.add(cfg.name)
            self._undo.append(lambda: self._verified.discard(cfg.name))
        return Restored(prepared.count, prepared.requeued_first)

    def restore_abort(self, key: str) -> None:
        """A restore that will not finish: its rows written so far become garbage (marked by
        the next collection when this write is refused: it was left 'writing' until a
        restart)."""
        self._cut_short.append(key)
        with self._tx() as c:
            c.execute("UPDATE row_sets SET state='garbage' WHERE rows_key=? AND"
                      " state='writing'", (key,))
            if key in self._cut_short:
                self._cut_short.remove(key)
            self._undo.append(lambda: self._cut_short.append(key))

    def has_garbage(self) -> bool:
        """Whether rows of finished or abandoned restores are left to delete."""
        return bool(self._cut_short) or self._conn.execute(
            "SELECT 1 FROM row_sets WHERE state='garbage' LIMIT 1").fetchone() is not None

    def collect_garbage(self, key: str | None = None, limit: int = GARBAGE_CHUNK) -> int:
        """Delete up to `limit` rows left by restores (one transaction; only those under `key`
        when given); 0 when none are left."""
        if self._cut_short:   # (restores a stopped process was writing: marked first)
            with self._tx() as c:
                cut, self._cut_short = self._cut_short, []
                self._undo.append(lambda: setattr(self, "_cut_short", cut))
                c.executemany("UPDATE row_sets SET state='garbage' WHERE rows_key=? AND"
                              " state='writing'", [(k,) for k in cut])
        with self._tx() as c:
            row = c.execute("SELECT rows_key FROM row_sets WHERE state='garbage' AND"
                            " rows_key=COALESCE(?, rows_key) LIMIT 1", (key,)).fetchone()
            if row is None:
                return 0
            if c.execute("SELECT 1 FROM datasets WHERE COALESCE(rows_key, name)=? LIMIT 1",
                         (row[0],)).fetchone() is not None:
                # a data set's live rows named garbage (an edited file): never deleted
                c.execute("DELETE FROM row_sets WHERE rows_key=?", (row[0],))
                return 1
            gone = c.execute("DELETE FROM shards WHERE rowid IN (SELECT rowid FROM shards"
                             " WHERE dataset=? LIMIT ?)", (row[0], limit)).rowcount
            if gone < limit:
                c.execute("DELETE FROM row_sets WHERE rows_key=?", (row[0],))
        return max(gone, 1)


def _unlist(names: list[str], name: str) -> None:
    """Undo of a reclaimed data set's report (its transaction was rolled back)."""
    if name in names:
        names.remove(name)


def _put_back(name: str, held: list[tuple[dict[str, Any], object]], sets: list[set[str]]) -> None:
    """Undo of Restores._remove's in-memory changes (its transaction was rolled back)."""
    for d, value in held:
        d[name] = value
    for s in sets:
        s.add(name)
