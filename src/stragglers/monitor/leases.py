"""Which instance analyses which job: leases in the store, renewed by a heartbeat.

Every job has one lease row. An instance holds a lease for `lease_s` past its last heartbeat
(every `lease_s / 3`); each heartbeat renews what it holds and takes free or expired leases up
to its fair share (jobs / live instances, `FOR UPDATE SKIP LOCKED` on PostgreSQL), handing back
a surplus when an instance joined. Taking a lease adds one to its epoch; the holder's window and
alert writes carry (instance, epoch) and are refused once the epoch moved on (store_base
`_fence`; a silence, decided from a clock, also once the lease ran out), so an instance that
stalls past its lease and wakes up stores nothing; its tick renews its leases before it decides
a silence when the heartbeat is late (Monitor.tick). An instance
killed with -9 stops renewing: its jobs are taken within `lease_s` plus one heartbeat of
another instance (docs/monitor.md §7).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from stragglers.monitor.records import LayoutEntry
from stragglers.trace.model import JobMeta

log = logging.getLogger(__name__)


def instance_id(store) -> str:
    """This process's name in the leases: fixed for a SQLite store (one instance per file, so
    a restart holds its leases at once), unique per process on a shared store."""
    if not getattr(store, "shared", False):
        return "local"
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass
class ForeignJob:
    """A job another instance analyses, as the ingest here needs it: its metadata (to check
    parts against) and its last step stored (to check step gaps); parts are stored here and
    found by the owner in the store."""

    meta: JobMeta
    max_step: int
    read_at: float
    meta_seq: int = 0   # the stored metadata's version (its parts' commits are fenced by it)
    run: int | None = None   # the store's run number of the job it was read at (jobs.run)

    def knows(self, rank: int, part: int) -> bool:
        """Not known here: the store's key tells a part seen twice."""
        return False

    @functools.cached_property
    def layout(self) -> dict[int, LayoutEntry]:
        """rank → its layout entry, as a JobTracker holds it (a part is checked against it)."""
        from stragglers.monitor.windows import layout_of
        return layout_of(self.meta)


class LeaseKeeper:
    """This instance's leases: a heartbeat thread renews them and takes its share; the monitor
    is told of every job gained or lost."""

    def __init__(self, store, instance: str, url: str, lease_s: float, on_gained, on_lost,
                 on_beat=None, probe: str | None = None):
        self.store, self.instance, self.url, self.lease_s = store, instance, url, float(lease_s)
        self.on_gained, self.on_lost = on_gained, on_lost
        # after every heartbeat (the uploads folder checked against the live instances'), and
        # the probe file name recorded with it (uploads_mark.InstanceProbe)
        self.on_beat, self.probe = on_beat, probe
        self.held: dict[str, int] = {}   # job → epoch
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_beat = 0.0        # (monotonic) and on the wall clock: a paused process's
        self.last_beat_wall = 0.0   # monotonic clock may or may not have moved on (a VM's)
        # when the last heartbeat after a lapse (see lapsed) was written: the other instances
        # left this one's ingest mark out until then
        self.lapse_ended_at = 0.0

    def lease(self, job: str) -> tuple[str, int] | None:
        """(instance, epoch) of the job's lease if held here, else None."""
        epoch = self.held.get(job)
        return None if epoch is None else (self.instance, epoch)

    def holds(self, job: str) -> bool:
        """Whether this instance analyses the job."""
        return job in self.held

    def beat(self) -> None:
        """One heartbeat: renew, take a share, and tell the monitor what changed."""
        with self._lock:
            # (from before the write: the store counts the lease from its transaction's start,
            # and this instance must not think itself alive when the others do not)
            began, began_wall = time.monotonic(), time.time()
            now_held = self.store.heartbeat(self.instance, self.url, self.lease_s, self.held,
                                            alone=not getattr(self.store, "shared", False),
                                            probe=self.probe)
            lost = [j for j in self.held if j not in now_held or now_held[j] != self.held[j]]
            gained = [j for j in now_held if self.held.get(j) != now_held[j]]
            for job in lost:
                del self.held[job]
            self.held.update({job: now_held[job] for job in gained})
            if self.last_beat and self.lapsed():
                self.lapse_ended_at = time.time()
            self.last_beat, self.last_beat_wall = began, began_wall
        # the monitor is told outside the lock (it takes its own lock, which register_job
        # holds while it calls take())
        for job in lost:
            self.on_lost(job)
        for job in gained:
            self.on_gained(job)
        if lost:
            log.warning("leases: %d job(s) now analysed by another instance: %s", len(lost),
                        ", ".join(sorted(lost)[:10]))
        if self.on_beat is not None:
            self.on_beat()

    def overdue(self) -> bool:
        """Whether the heartbeat is late by a beat or more (on a shared store): this process
        was paused or starved, and the leases it believes it holds may have run out and been
        taken meanwhile."""
        return self._since_beat() > 2 * self.lease_s / 3

    def lapsed(self) -> bool:
        """Whether no heartbeat was written for lease_s (on a shared store): the other
        instances take this one for dead and leave its ingest mark out."""
        return self._since_beat() > self.lease_s

    def _since_beat(self) -> float:
        if not getattr(self.store, "shared", False):
            return 0.0
        return max(time.monotonic() - self.last_beat, time.time() - self.last_beat_wall)

    def forget(self, job: str) -> None:
        """A job that is gone (its rows deleted): its lease is no longer held here."""
        with self._lock:
            self.held.pop(job, None)

    def take(self, job: str) -> bool:
        """Take a new job's lease now if nobody holds it (the job was registered here)."""
        with self._lock:
            if job in self.held:
                return True
            epoch = self.store.take_lease(self.instance, job, self.lease_s,
                                          alone=not getattr(self.store, "shared", False))
            if epoch is None:
                return False
            self.held[job] = epoch
        self.on_gained(job)
        return True

    def start(self) -> None:
        """Heartbeat every lease_s / 3 on a thread (on a shared store: alone on its store, an
        instance's leases are its own for good, and a write a heartbeat, an fsync on SQLite,
        would buy nothing)."""
        if not getattr(self.store, "shared", False):
            return
        self._thread = threading.Thread(target=self._run, name="stragglers-monitor-lease",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        failing = False
        while not self._stop.wait(self.lease_s / 3):
            try:
                self.beat()
            except Exception as exc:  # noqa: BLE001 - the database away: try again next beat
                if not failing:   # (once, not every beat while it is away)
                    log.warning("leases: heartbeat failed (%s); the fence keeps a lease that "
                                "runs out from writing", str(exc).splitlines()[0] if str(exc)
                                else exc)
                failing = True
                continue
            if failing:
                log.warning("leases: heartbeat written again")
            failing = False

    def stop(self, release: bool = True) -> None:
        """Stop the heartbeat; with `release`, hand every lease back (a clean stop: the other
        instances take the jobs at their next heartbeat, not after the lease runs out)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if release:
            try:
                self.store.release_leases(self.instance)
            except Exception as exc:  # noqa: BLE001 - the leases then simply run out
                log.warning("leases: could not hand back (%s)", exc)
            self.held.clear()
