"""What each firing fast alert fired against, kept in the store beside the alert.

A rank_slowdown alert resolves once the rank is back near the baseline it fired against
(changes.RankChangeDetector). That baseline lived in the detector's memory only: a restarted
monitor (an upgrade, kill -9) or another instance taking the job built a new detector, which
learnt the slow steps as the rank's baseline and resolved the alert while the rank stayed 3x
slow (red team round 13 #9). The firing ranks' frozen baselines are written here (store_info
rows, one per firing rank) before their alert is, in their own transaction, and a new
detector resumes from them the ranks whose alert the store holds firing. A rank's row goes in
the transaction that stores its alert resolved, however it resolves (the detector, the job
finishing, a new run, a rule change), and a job's rows with the job: a job that ended while a
rank fired kept that rank's row for good.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from stragglers.monitor.records import Alert
    from stragglers.monitor.store_base import SQLStore

PREFIX = "fast:"   # store_info key: PREFIX + JSON [job, rank]
RULE = "rank_slowdown"   # the alert a row belongs to (alerts.FAST_RULE)


class FiredState(msgspec.Struct):
    """A firing rank's judgement, as RankChangeDetector.fired_state gives it."""

    frozen: float          # the baseline median it fired against (log, relative to peers)
    base: list[float]      # its in-control values when it fired (the baseline it resumes)
    ratio: float
    since_step: int
    at_step: int


def _prefix(job: str) -> str:
    return PREFIX + json.dumps([job])[:-1] + ", "


def save(store: SQLStore, job: str, states: dict[int, FiredState]) -> None:
    """The job's firing ranks' states, replacing what was kept (ranks no longer firing go)."""
    prefix = _prefix(job)

    def tx(db: Any) -> None:
        store._exec(db, f"DELETE FROM store_info WHERE substr(key, 1, {len(prefix)}) = ?",
                    (prefix,))
        for rank, state in sorted(states.items()):
            store._exec(db, "INSERT INTO store_info (key, value) VALUES (?, ?) ON CONFLICT "
                        "(key) DO UPDATE SET value = excluded.value",
                        (prefix + f"{int(rank)}]", msgspec.json.encode(state).decode()))
    store._write(tx, notify=False)


def load(store: SQLStore, job: str) -> dict[int, FiredState]:
    """rank → its kept state (a row that does not read is left out: that rank learns anew)."""
    prefix = _prefix(job)
    out = {}
    for row in store._rows(f"SELECT key, value FROM store_info WHERE substr(key, 1, "
                           f"{len(prefix)}) = ?", (prefix,)):
        try:
            rank = int(str(row["key"])[len(prefix):-1])
            out[rank] = msgspec.json.decode(row["value"], type=FiredState)
        except (ValueError, msgspec.DecodeError):
            continue
    return out


def forget_resolved(store: SQLStore, db: Any, alert_rows: list[Alert]) -> None:
    """In the transaction storing `alert_rows`: the rows of the ranks whose fast alert
    resolves there go."""
    for a in alert_rows:
        if a.rule == RULE and a.status == "resolved" and a.labels.rank is not None:
            try:
                rank = int(a.labels.rank)
            except ValueError:
                continue   # (not one rank: no row of it)
            store._exec(db, "DELETE FROM store_info WHERE key = ?",
                        (_prefix(a.job) + f"{rank}]",))


def forget_job(store: SQLStore, db: Any, job: str) -> None:
    """In the transaction deleting `job`: its rows go."""
    prefix = _prefix(job)
    store._exec(db, f"DELETE FROM store_info WHERE substr(key, 1, {len(prefix)}) = ?",
                (prefix,))


class _Key(msgspec.Struct):
    key: str


class _JobState(msgspec.Struct):
    job: str
    state: str


class _Firing(msgspec.Struct):
    job: str
    labels: str


def sweep(store: SQLStore) -> int:
    """At a start: the rows no firing alert of their rank holds go (older versions kept a
    job's rows for good once it ended, or its alert resolved another way); how many. On a
    shared store only those of jobs gone or finished: another instance writes a firing rank's
    row before its alert, and may be doing so now."""
    if not store._rows(f"SELECT key FROM store_info WHERE substr(key, 1, {len(PREFIX)}) = ? "
                       "LIMIT 1", (PREFIX,)):
        return 0   # (no write at a start with none: a store written by another at once)

    def tx(db: Any) -> int:
        keys = [r.key for r in store._many(
            db, _Key, f"SELECT key FROM store_info WHERE substr(key, 1, {len(PREFIX)}) = ?",
            (PREFIX,))]
        if not keys:
            return 0
        states = {r.job: r.state for r in store._many(db, _JobState,
                                                        "SELECT job, state FROM jobs")}
        firing = set()
        for r in store._many(db, _Firing, "SELECT job, labels FROM alerts WHERE rule = ? AND "
                             "status = 'firing'", (RULE,)):
            try:
                firing.add((r.job, str(json.loads(r.labels).get("rank"))))
            except (ValueError, AttributeError):
                continue   # (a damaged alert row: its rank's baseline, if any, goes)
        gone = []
        for key in keys:
            try:
                job, rank = json.loads(key[len(PREFIX):])
            except (ValueError, TypeError):
                gone.append(key)   # (a key that does not read is never loaded)
                continue
            if states.get(job, "finished") == "finished" or \
                    (not store.shared and (job, str(rank)) not in firing):
                gone.append(key)
        for key in gone:
            store._exec(db, "DELETE FROM store_info WHERE key = ?", (key,))
        return len(gone)
    return store._write(tx, notify=False)
