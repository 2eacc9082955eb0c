"""The running monitor: ingest queue → job trackers → window analysis → store, alerts, metrics.

Three threads do the work, so neither way in waits on the analysis: the *ingest* thread reads
and checks parts, stores a batch of them in one transaction (durable before any upload is
acknowledged) and hands their rows to the job trackers; the *analysis* thread has the what-if
engine run each closed window (in the service, in a separate process, analyser.py, so that it
does not hold the interpreter lock the ingest needs) and stores the result with the alert
changes it causes, in one transaction; the *tick* thread closes windows of parts that were
waited for, and moves jobs
between running, stalled and finished.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, overload

import numpy as np

from stragglers.errors import InputError
from stragglers.monitor.alerts import AlertEngine, Changes, Rule, parse_rules
from stragglers.monitor import fast_state
from stragglers.monitor.analyser import Closed, WindowAnalyser
from stragglers.monitor.leases import ForeignJob, LeaseKeeper, instance_id
from stragglers.monitor.metrics import MonitorMetrics
from stragglers.monitor.jobmeta import STARTED_SKEW_S, check_meta, is_new_run, run_start, \
    clock_text, run_started, run_token, started_in_future
from stragglers.monitor.outbox import OutboxSender
from stragglers.monitor.turns import Turns
from stragglers.monitor.part_files import FileReaders, StuckRead
from stragglers.monitor.part_names import file_fingerprint
from stragglers.monitor.places import check_place, rows_place
from stragglers.monitor.parts import MAX_PART, MAX_STEP, MAX_WINDOW, PartConflict, PartData, \
    PartFile, check_file_in_job, \
    check_in_job, check_same_part, check_step_gaps, is_whole_rank_file, part_path, \
    read_part_files, read_part_footers, check_uploads, read_uploads, \
    sync_directory, write_part_file
from stragglers.monitor.records import Alert, AlertLogEntry, IngestMark, JobMark, JobRecord, \
    Lease, PartIndex, WindowRow
from stragglers.monitor.settings import MonitorConfig
from stragglers.monitor.watchdog import Watchdog
from stragglers.monitor.step_sets import Steps, decode, distinct, encode, meet, read_steps
from stragglers.monitor.store import JobConflict, SQLStore
from stragglers.monitor.replaced import was_replaced
from stragglers.monitor.store_base import DAMAGED, STALE
from stragglers.monitor.unstored import HeldState, WriteTrouble
from stragglers.monitor.uploads_mark import InstanceProbe, check_uploads_folder
from stragglers.monitor.windows import JobTracker, Window, layout_of, stuck_window_reads
from stragglers.serving import LogBudget
from stragglers.trace.model import JobMeta
from stragglers.trace.runformat import rank_file_name
from stragglers.wording import printable, utf8

log = logging.getLogger(__name__)
Key = TypeVar("Key")

MAX_BATCH = 1024
SWEEP_EVERY_S = 60.0   # empty jobs are looked for at most this often (or expiry / 2)


class JobFull(InputError):
    """A part that would take its job past max_job_bytes (nothing of it is stored)."""


MAX_STALE = 3   # a part's checks again after its job's metadata changed under it


class MetaChanged(Exception):
    """A part's job changed its metadata (another instance) each time the part was checked:
    not stored, to be sent again (an upload is answered 503, a watched file is queued by the
    next rescan)."""

    def __init__(self, job: str, field: str, problem: str):
        super().__init__(f"job {job!r}: {problem}")
        self.problem = problem


class Superseded(InputError):
    """Metadata or a part of a run that a newer run of the same job name replaced (its
    X-Stragglers-Run, or extra.run, is an earlier run's): refused, never stored as the
    newer run's."""


class RunBusy(InputError):
    """A new run's metadata while parts of the job are on their way: taken once they landed
    (an upload is answered 503 and retried; a watched run's meta.json is read again)."""


@dataclass
class PartIn:
    """A part on its way in: a watched file to read, or an upload already checked."""

    job: str
    rank: int
    part: int
    way: str                        # files | http
    path: Path | None = None       # a watched file, read by the ingest thread
    data: PartData | None = None   # or a part already read and checked
    body: bytes | None = None      # or uploaded bytes: checked, then written into data_dir
    digest: str | None = None      # the uploaded bytes' fingerprint (parts.fingerprint)
    records: int = 0
    queued_at: float = field(default_factory=time.monotonic)
    # a watched file's ctime (when it got its name: the recorder's rename), the earliest time
    # silence may count from (clamped to file_time_slack_s before the notice)
    written_at: float | None = None
    done: Future | None = None      # set to "stored" or "duplicate" once durable
    # the earliest its arrival may be taken as (wall time; set when submitted): another
    # instance decides no silence over it while it is in flight here (ingest marks)
    floor: float | None = None
    stale: int = 0   # times its commit found the job's metadata changed since its check


class Monitor:
    """Jobs, their windows, alerts and metrics; `start()` runs it, `stop()` ends it."""

    def __init__(self, store: SQLStore, config: MonitorConfig | None = None,
                 rules: list[Rule] | None = None, webhooks: list[str] | tuple[str, ...] = (),
                 data_dir: Path | None = None, external_url: str = "",
                 receiver: str = "stragglers", instance: str | None = None):
        self.store, self.config = store, config or MonitorConfig()
        if data_dir is None and store.shared:
            raise InputError("--data-dir", None, "a shared store (PostgreSQL) needs the folder "
                             "uploads are written to, one every instance reads (a shared file "
                             "system)")
        self.data_dir = Path(data_dir) if data_dir else Path(store.path + ".uploads")
        if not utf8(self.data_dir.resolve()):
            # each uploaded job's folder is kept in the store as text, which cannot hold
            # it: every meta.json PUT was a 500 (red team round 9 F5b)
            raise InputError(printable(str(self.data_dir)), None, "the uploads folder's path "
                             "is not UTF-8 (each such byte shown as \\xNN): the monitor keeps "
                             "each uploaded job's folder as text; give --data-dir (or --db) a "
                             "folder whose path is UTF-8")
        # uploads are written there: a folder that cannot be is refused now, not at the first
        # upload of a job (a 5xx to a recorder that can do nothing about it)
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            if not os.access(self.data_dir, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "Permission denied")
        except OSError as exc:
            raise InputError(self.data_dir, None, f"--data-dir: uploads cannot be written there "
                             f"({exc.strerror})") from None
        # the folder is this store's (uploads_mark.py): another store's, or one without this
        # store's uploaded parts, is refused before anything is acknowledged into it
        check_uploads_folder(store, self.data_dir)
        self.metrics = MonitorMetrics()
        self.alerts = AlertEngine(rules if rules is not None else parse_rules(None), store,
                                  self.config.repeat_s, external_url)
        self.receiver = receiver
        # this instance's name in the leases, and its share of the jobs (leases.py)
        self.instance = instance or instance_id(store)
        # the uploads folder is the other live instances' too (uploads_mark.InstanceProbe):
        # refused at the start where it is not, and uploads answered 503 while it is not
        self.probe = InstanceProbe(self.data_dir, self.instance)
        self.unshared: str | None = None   # why uploads are refused (None: they are not)
        self._missing: str | None = None   # a live instance's probe missing here (why)
        self._probe_failed = False
        self.leases = LeaseKeeper(store, self.instance, external_url, self.config.lease_s,
                                  self._gained, self._lost, on_beat=self._check_probe)
        # alert messages leave from the store's outbox, written with their alert change
        self.outbox = OutboxSender(store, self.instance, self.alerts, receiver, webhooks,
                                   self.config.alert_claim_s)
        self.part_seqs: dict[str, int] = {}   # owned job → last part sequence number taken
        # owned job → (run number, metadata text) taken
        self.runs: dict[str, tuple[int | None, str | None]] = {}
        self._foreign: dict[str, ForeignJob] = {}
        self._metrics_at = 0.0
        self.analyser = WindowAnalyser(in_process=not self.config.analysis_process,
                                       read_timeout_s=self.config.read_timeout_s,
                                       timeout_s=self.config.analysis_timeout_s,
                                       start_timeout_s=self.config.analysis_start_timeout_s,
                                       answer_max_bytes=self.config.analysis_answer_max_bytes)
        self.trackers: dict[str, JobTracker] = {}
        self.states: dict[str, str] = {}
        # job → its state decided here whose write was refused (a full disk): written again
        # at each tick until it commits (a failed write lost the stall, and the tick's windows)
        self._unstored: dict[str, HeldState] = {}
        self.trouble = WriteTrouble(store.transient_errors)
        self._tick_failed: str | None = None   # the tick's last unexpected error (said once)
        self._ingest_failed: str | None = None   # the ingest's (said once)
        self.directories: dict[str, Path] = {}
        self.recent_rejects: deque = deque(maxlen=100)
        self._log_budget = LogBudget(REFUSAL_LOG_BURST, REFUSAL_LOG_PER_S)
        self.quarantined: dict[str, str] = {}   # job → why its stored rows cannot be used
        self.remedies: dict[str, str] = {}   # and what brings it back (its uploads' 409 says)
        self._quarantined_meta: dict[str, str | None] = {}   # (shared store) its meta then
        # directories whose paths readers of /api/stats are not shown (the watcher adds its
        # roots): the uploads folder and the store's
        self.private_roots = {str(self.data_dir.resolve()), str(self.data_dir)}
        # the folders watched (the watcher adds its roots, resolved): a watched part is read
        # only where it lies in one once links are followed (part_root)
        self.watched_roots: list[Path] = []
        self._root_order: dict[Path, int] = {}   # watched root → its place (part_root)
        if not store.shared:
            self.private_roots.add(str(Path(store.path).resolve().parent))
        self._lock = threading.RLock()
        self._ingest: queue.Queue = queue.Queue()
        # per-job turns: a job's backlog of windows (a recorder catching up, a job of many
        # ranks) held every other job's windows and alerts behind all of it in one FIFO
        self._analysis: Turns = Turns(_analysis_job)
        self._state_lock = threading.Lock()   # one job state change stored at a time
        self._inflight = 0          # items put on a queue and not yet finished
        # (job, rank) → its parts queued or being stored: silence is not decided over them
        # (a part written just before the deadline may be in the ingest still)
        self._parts_in_flight: dict[tuple[str, int], int] = {}
        self._jobs_in_flight: dict[str, int] = {}
        # the in-flight parts' arrival floors (PartIn.floor → how many), for the ingest mark
        # other instances read before deciding a silence; and those marks, read once a tick
        self._floors: dict[float, int] = {}
        self._marks: list[IngestMark] = []
        # when the first mark that held a silence back this tick is written again (its
        # instance ticks every tick_s): looked at then, not a whole tick of this one later
        self._marks_due: float | None = None
        self._renew_first = False   # a silence was refused by the fence: renew, then decide
        self._renew_failed = False
        self._heard_floor = 0.0     # no part counts as heard before this (_ingest_batch)
        self._mark_failed = False
        self._windows_in_flight: dict[str, int] = {}   # job → its windows queued or analysed
        # job → new runs of it begun here: a window queued under an older one is dropped (a
        # replaced run's queued windows were analysed after the reset, from files gone, and
        # stored in the new run's places); the job whose window is being analysed now
        self._run_count: dict[str, int] = {}
        self._analysing: str | None = None
        self._tick_wake = threading.Event()   # a deadline deferred over parts in flight
        self._noticing: dict[object, tuple[float, float]] = {}   # watchers' batches (noticing)
        # watchers whose first scan of their roots is under way (in the background: 30,000
        # folders took ~8 s, and the service answered nothing, /health included, until then)
        self._first_scans: set[object] = set()
        self._deferred = False
        # landings (a batch stored or refused, a watcher's batch handed over) so far, and how
        # many there were when the running tick began: a deferral after a landing that the
        # tick's checks may have seen in flight wakes the tick at once (that landing found no
        # deferral to wake, and the stall waited a whole tick_s)
        self._settled = 0
        self._tick_mark = 0
        # the clock the last tick decided at: a deadline after it is still to be decided (one
        # that passed while a tick ran was waited past by a whole tick_s)
        self._ticked_at: float | None = None
        self._count_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._readers: ThreadPoolExecutor | None = None
        # watched files are read here, each read waited for a bounded time (a hung NFS or
        # FUSE file once held the ingest thread, every upload behind it, and SIGTERM)
        self.file_readers = FileReaders(self.config.read_threads,
                                        timeout_s=self.config.read_timeout_s,
                                        name="stragglers-monitor-file-read")
        self._writers: ThreadPoolExecutor | None = None
        self._ingest_started: float | None = None   # the batch being stored: its oldest part
        # job → (bytes of parts stored past its last window, when read, its windows stored
        # then): max_job_bytes is checked against it
        self._job_bytes: dict[str, tuple[int, float, int]] = {}
        # job → windows this instance stored (the analysis thread's count): a window stored
        # lets its parts go from the job's bytes, read again then
        self._windows_stored: dict[str, int] = {}
        # one ingest batch or one sweep of empty jobs at a time: a job is never forgotten
        # while a part of it is being written and stored
        self._batch_lock = threading.Lock()
        self._swept_at = 0.0
        # fast alerts (the change detector's thread) and silent ranks, the monitor's health
        self.watchdog = Watchdog(self)
        self.metrics.watch(self)

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> "Monitor":
        """Rebuild unfinished jobs from the store (reading only unanalysed parts), start threads."""
        self._remove_stale_temps()
        for row in self.store.jobs():
            if row.state == "quarantined":   # its row does not read (store.jobs)
                self._quarantine(row.job, _unreadable(self.store, row.job))
                continue
            try:
                job = self.store.job(row.job)
                if job is None:   # removed since the list was read
                    continue
                self.directories[job.job] = self._stored_directory(job)
                latest = self.store.last_window(job.job)
                if latest is not None:   # its figures, as before the restart (not counted
                    self.metrics.show_window(latest)   # again: windows_total stays)
                self.metrics.set_state(job.job, job.state)
            except Exception as exc:   # noqa: BLE001 - a damaged row: that job only
                self._quarantine(str(row.job), exc)
        self._sweep_baselines()
        # an uploads folder the live instances do not share is refused before this one
        # counts as live (their leases stay theirs), and again once it does (two started
        # together: the later check of the two sees the other)
        if self.store.shared:   # (a SQLite store is served by one instance: its flock)
            self._write_probe()   # (recorded with the first heartbeat: live, probe and all)
            self._refuse_unshared(self.probe.problem(self.store, own=True))
        # the first heartbeat, before any thread: the jobs this instance holds are rebuilt
        # now (alone, as with SQLite, every job; the lease of a restarted SQLite monitor is
        # its own)
        try:
            self.leases.beat()
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise
            # a full disk: the monitor serves reads and answers writes 507; the heartbeat
            # thread takes the leases (and rebuilds their jobs) once a write fits
            log.warning("start: the store cannot be written (%s); serving reads, uploads "
                        "refused until space returns", exc)
        if self._missing is not None:
            self.leases.stop(release=True)
            self._refuse_unshared(self._missing)
        self.publish_mark()   # (before any part is taken: others wait for what it holds)
        self.leases.start()
        self.outbox.start()
        self._readers = ThreadPoolExecutor(self.config.read_threads,
                                           thread_name_prefix="stragglers-monitor-read")
        self._writers = ThreadPoolExecutor(self.config.write_threads,
                                           thread_name_prefix="stragglers-monitor-write")
        for name, target in (("ingest", self._ingest_loop), ("analysis", self._analysis_loop),
                             ("tick", self._tick_loop), ("changes", self.watchdog.run)):
            t = threading.Thread(target=target, name=f"stragglers-monitor-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _sweep_baselines(self) -> None:
        """The fast detector's stored baselines no firing alert holds go (fast_state.sweep):
        older versions left them for good; a full disk or a busy store leaves them to the next
        start (they are never loaded without their alert)."""
        skipped: tuple[type[Exception], ...] = (*self.store.transient_errors, OSError)
        try:
            swept = fast_state.sweep(self.store)
        except skipped as exc:
            log.warning("start: stale fast-detector baselines not swept (%s)", exc)
            return
        if swept:
            log.info("start: %d stale fast-detector baselines swept", swept)

    def _refuse_unshared(self, problem: str | None) -> None:
        if problem is not None:
            self.probe.remove()
            raise InputError(f"--data-dir {self.data_dir}", None, problem)

    def _write_probe(self) -> None:
        """This instance's probe written or touched; recorded by the heartbeats from then
        on (a probe recorded is never one absent from a shared folder)."""
        try:
            self.probe.write()
            self.leases.probe = self.probe.record(self._missing is not None)
        except OSError as exc:   # (a full disk: uploads are refused 507 anyway)
            if not self._probe_failed:
                log.warning("uploads folder: the instance probe cannot be written (%s)",
                            exc.strerror or exc)
            self._probe_failed = True

    def _check_probe(self) -> None:
        """After each heartbeat: this instance's probe written (and recorded with the next
        heartbeat), and the other live instances' looked for; uploads are refused (503)
        while one is missing."""
        if not self.store.shared:
            return
        try:
            # (this instance's own view, recorded with the next heartbeat; then the others')
            self._missing, theirs = self.probe.problems(self.store)
            problem = self._missing or theirs
        except Exception as exc:   # noqa: BLE001 - the store away: looked at next beat
            log.warning("uploads folder: the other instances' probes not read (%s)",
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return
        finally:
            self._write_probe()
        if problem != self.unshared:
            if problem is not None:
                log.warning("uploads refused (503): %s (this folder: %s)", problem,
                            self.data_dir)
            else:
                log.warning("uploads folder shared with every live instance again: uploads "
                            "taken")
        self.unshared = problem

    def _remove_stale_temps(self) -> None:
        """Half-written uploads a killed service left (`*.tmp` in the upload folders: written
        before their rename, so never acknowledged) are removed at start."""
        try:
            temps = list(self.data_dir.glob("*/*.tmp"))
        except OSError:
            return
        # on a shared folder another instance may be writing one now: only old ones go
        young = time.time() - 600 if self.store.shared else float("inf")
        for tmp in temps:
            try:
                if tmp.stat().st_mtime > young:
                    continue
            except OSError:
                continue
            if tmp.name.startswith(("rank-", "meta.json.")):
                try:
                    tmp.unlink()
                except OSError as exc:
                    log.warning("cannot remove %s: %s", tmp, exc.strerror)

    def stop(self) -> None:
        """Stop the threads (what is stored stays; windows in flight are redone at restart)."""
        self._stop.set()
        self._tick_wake.set()
        self._ingest.put(None)
        self._analysis.put(None)
        self.watchdog.stop()
        # the analysis process first: it holds nothing durable (a window in it is not stored,
        # so the next start analyses it), and a window in flight held the stop 10 s here
        self.analyser.close()
        for t in self._threads:
            t.join(timeout=10)
        for pool in (self._readers, self._writers):
            if pool is not None:
                pool.shutdown(wait=True)
        self.file_readers.shutdown(wait=False)   # (a read stuck in the kernel is left behind)
        self.outbox.close()
        # a clean stop hands the leases back: the other instances take the jobs at once
        self.leases.stop(release=bool(self._threads))
        if self.store.shared:
            self.probe.remove()

    def idle(self) -> bool:
        """Nothing queued or in progress, no first scan of a watched root under way (for
        tests and benchmarks)."""
        return self._inflight == 0 and not self._first_scans

    def stuck_reads(self) -> dict[str, float]:
        """Watched file → seconds its read has been stuck, for the reads given up on and left
        behind (/health and the ingest's queue depths say how many)."""
        stuck = {**stuck_window_reads(), **self.file_readers.stuck_reads()}
        return {self._public(f): s for f, s in stuck.items()}

    def scanning(self) -> bool:
        """Whether a watcher's first scan of its roots is under way (/health says so)."""
        return bool(self._first_scans)

    @contextmanager
    def first_scan(self) -> Iterator[None]:
        """A watcher scans its roots for the first time: the monitor is not idle, and no
        silence is decided meanwhile (any part not yet queued may be in the scan)."""
        token = object()
        with self._count_lock:
            self._first_scans.add(token)
        try:
            with self.noticing(0.0):
                yield
        finally:
            with self._count_lock:
                self._first_scans.discard(token)

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Wait until idle() holds; False if the timeout passed first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.idle():
                return True
            time.sleep(0.01)
        return False

    # ---- jobs --------------------------------------------------------------------------------

    def register_job(self, job: str, directory: Path, way: str, raw_meta: dict) -> JobMeta:
        """Create or update a job from its meta.json contents (InputError if they are bad)."""
        # checked in full before anything is stored (a bad layout once went into the store and
        # failed every later start)
        meta = check_meta(raw_meta, directory / "meta.json", self.config.max_meta_bytes)
        future = started_in_future(raw_meta, time.time())
        if future is not None:
            raise InputError(directory / "meta.json", "extra.started", f"{clock_text(future)} is "
                             f"more than {STARTED_SKEW_S:g} s past this monitor's clock "
                             f"({time.time():.3f}); expected when the run began, in seconds "
                             "since 1970")
        if meta.world_size > self.config.max_world_size:
            raise InputError(directory / "meta.json", "world_size", f"{meta.world_size} ranks; "
                             f"this monitor takes jobs of at most {self.config.max_world_size} "
                             "(max_world_size)")
        with self._lock:
            if job not in self.directories and self._live_jobs() >= self.config.max_jobs:
                raise InputError(job, "job", f"the monitor tracks {self.config.max_jobs} jobs "
                                 "not finished already (max_jobs)")
            old = self.store.job(job)
            resized = False
            same = self._same_job(old, directory, way)
            if same and old is not None:
                raw_meta, meta = self._check_run_identity(job, old, raw_meta, meta)
            where = old.directory if same and old is not None and way == "http" \
                else str(directory)
            reset = False
            if same and old is not None and is_new_run(old.meta, raw_meta):
                with self._count_lock:
                    # (the old run's part, checked and committed after the reset, was stored
                    # as the new run's: its own part of that number was then refused 409; a
                    # window of it being analysed would be stored in the new run's places)
                    if self._jobs_in_flight.get(job, 0) > 0 or self._analysing == job:
                        raise RunBusy(job, "job", "parts or a window of the run before are "
                                      "still being stored; the new run starts once they are "
                                      "(try again)")
                    # its windows still queued are dropped when their turn comes
                    self._run_count[job] = self._run_count.get(job, 0) + 1
                # the replaced run's announcements, which may go on (two trainings under one
                # job name), are refused from now on: its token is kept in the job's row
                try:
                    reset = self._reset(job, raw_meta, where, way)
                except BaseException:
                    with self._count_lock:   # (refused: the old run goes on)
                        self._run_count[job] -= 1
                    raise
            elif same and old is not None:
                resized = self._check_same_sizes(job, old.meta, meta)
            try:
                # (a resize is judged again under the job row's lock: another instance's
                # part may be stored between the look above and this write; an uploaded job
                # keeps the path its row holds, which names no folder of today's). A reset
                # registered the new run in its own transaction: nothing is left to write
                if not reset:
                    self.store.register_job(job, where, way, raw_meta, sizes_change=resized)
            except JobConflict as exc:
                raise InputError(job, "job", str(exc)) from None
            self.directories[job] = Path(directory)
            self.quarantined.pop(job, None)   # good metadata again: the job is back
            self._quarantined_meta.pop(job, None)
            self._foreign.pop(job, None)
            tracker = self.trackers.get(job)
            if tracker is not None:
                tracker.set_meta(meta)
                self.runs[job] = self._run_mark(job)
                self._foreign.pop(job, None)
                # the version stored, if it is still this metadata (else another instance
                # wrote since: no part is committed until the store is followed)
                tracker.meta_seq = self._meta_seq(job, raw_meta)
            elif self.leases.holds(job) or not self.leases.take(job):
                # held here without a tracker (quarantined until now), or held elsewhere
                # (its holder finds the new metadata in the store)
                stored = self.store.job(job)
                if self.leases.holds(job) and stored is not None:
                    self._rebuild_or_quarantine(stored)
            if self.states.get(job, "quarantined") == "quarantined" and \
                    job not in self.quarantined and self.leases.holds(job):
                self.states[job] = "running"
                self.metrics.set_state(job, "running")
            if job in self.quarantined:
                # set aside again by its rebuild (rows a new metadata does not repair): the
                # announcement was answered "ok" and every part then 409 for good
                raise InputError(job, "job", f"its stored rows cannot be used, new metadata "
                                 f"or not ({self.quarantined[job][:200]}); "
                                 f"{self.remedies.get(job, ANOTHER_NAME)}")
        return meta

    def move_job(self, job: str, directory: Path) -> None:
        """A watched job's run directory was renamed to `directory`: the job follows it (its
        parts, windows and alerts stay; its unanalysed parts are read from there), where a
        new job once began over the same parts. RunBusy while parts or windows of it are on
        their way (they name the old files); the watcher tries again."""
        with self._lock:
            old = self.directories.get(job)
            if old is None or old == directory:
                return
            with self._count_lock:
                busy = job in self._jobs_in_flight or job in self._windows_in_flight
            if busy:
                raise RunBusy(job, "job", "its run directory was renamed while parts or windows "
                              "of it were on their way; it follows the new name once they "
                              "are stored (tried again)")
            if not self.store.move_job(job, str(old), str(directory)):
                raise InputError(job, "job", f"its stored run directory is no longer {old}")
            self.directories[job] = directory
            self.analyser.forget(str(old))
            log.warning("job %s: its run directory %s is now %s; the job follows it", job,
                        old, directory)
            if self.trackers.pop(job, None) is not None or self.leases.holds(job):
                row = self.store.job(job)   # (its held parts' paths were the old ones)
                if row is not None and job not in self.quarantined and \
                        row.state != "finished":
                    self._rebuild_or_quarantine(row)

    def _check_same_sizes(self, job: str, stored: object, meta: JobMeta) -> bool:
        """InputError (a conflict) when a rewrite of a job's run changes its sizes while parts
        of it are stored: a smaller world left stored ranks outside it (the job was set aside
        at the next start), a smaller dp or pp left stored rows outside the grid; a new run
        (a new start clock) starts again instead."""
        try:
            before = check_meta(stored, f"job {job}", 1 << 62)
        except InputError:
            return False   # set aside already (register_job takes the new metadata)
        sizes = ("world_size", "dp_size", "pp_size", "tp_size", "dsp_size", "vpp_size")
        changed = [(n, getattr(before, n), getattr(meta, n)) for n in sizes
                   if getattr(before, n) != getattr(meta, n)]
        if changed and self._has_parts(job):
            name, was, now = changed[0]
            raise InputError(job, "job", f"{name} {now} where the run's stored parts have "
                             f"{was}: a run keeps its sizes (a new run, with a new start "
                             "clock in extra.clock, starts the job again)")
        moved = self._moved_rank(job, before, meta)
        if moved is not None and self._has_parts(job):
            rank, was, now = moved
            raise InputError(job, "job", f"extra.layout puts rank {rank} at (dp_rank, stage) "
                             f"{now} where the run's stored parts have it at {was}: a run keeps "
                             "its layout (a new run, with a new start clock in extra.clock, "
                             "starts the job again)")
        return bool(changed) or moved is not None

    def _has_parts(self, job: str) -> bool:
        """Whether a part of the job is stored, or on its way (checked against the job's
        sizes as they were, and not yet committed: a world shrunk while rank 2's part was
        in flight was taken, the part stored after it, and the next start set the job aside)."""
        return self._in_flight(job) or self.store.has_parts(job)

    def _in_flight(self, job: str) -> bool:
        """Whether a part of the job is queued or being stored."""
        with self._count_lock:
            return self._jobs_in_flight.get(job, 0) > 0

    def _moved_rank(self, job: str, before: JobMeta, meta: JobMeta) \
            -> tuple[int, tuple[int, int], tuple[int, int]] | None:
        """(rank, old place, new place) of a rank the new layout puts elsewhere than the
        stored layout did, or than its parts' rows showed (a job without a layout): a swap of
        two ranks mid-run was taken, and each one's next parts, at its true place, were
        refused (422) from then on. Hosts may change; a layout may be dropped."""
        new = layout_of(meta)
        if not new:
            return None
        old: dict[int, tuple[int | None, int | None]] = {
            r: (e.dp_rank, e.stage) for r, e in layout_of(before).items()}
        tracker = self.trackers.get(job)
        if tracker is not None:
            for r, place in tracker.places.items():
                old.setdefault(r, place)
        for r, e in new.items():
            was = old.get(r)
            if e.dp_rank is None or e.stage is None or was is None or was[0] is None \
                    or was[1] is None:
                continue
            if was != (e.dp_rank, e.stage):
                return r, (int(was[0]), int(was[1])), (e.dp_rank, e.stage)
        return None

    def part_root(self, directory: Path) -> str:
        """The folder a job's part files must lie in once links are followed, checked on the
        file opened (a name checked, then swapped for a link out, was followed): the watched
        folder holding its run directory (links within it followed), else its own folder (an
        upload's, or a run followed before its watched folder was named)."""
        # (by the folder's ancestors, not root by root: a rescan of 1,000 roots asked this
        # a million times, ~5 s of a full scan)
        if len(self._root_order) != len(self.watched_roots):   # (roots are only added)
            self._root_order = {r: i for i, r in reversed(list(enumerate(self.watched_roots)))}
        hits = [p for p in (directory, *directory.parents) if p in self._root_order]
        return str(min(hits, key=self._root_order.__getitem__)) if hits else str(directory)

    def _check_run_identity(self, job: str, old: JobRecord, raw_meta: dict,
                            meta: JobMeta) -> tuple[dict, JobMeta]:
        """Superseded for a meta.json that cannot be the job's current or a newer run: its
        token is among the replaced runs', or it has none where the current run has one (a
        stale run's rewrite without extra.run reset the newer run away). A tokenless rewrite
        of the current run itself (its start clock) keeps the run's token."""
        token, current = run_token(raw_meta), run_token(old.meta)
        if token is not None and was_replaced(old.superseded, token):
            now = current or "one without a token"
            raise Superseded(job, "job", f"run {token} of job {job!r} was replaced by a "
                             f"newer run of the same job name (its run now: {now}); give "
                             "each run its own job name (monitor_job)")
        began, current_began = run_started(raw_meta), run_started(old.meta)
        if started_in_future(old.meta, time.time()) is not None:
            # (a stored start past this monitor's clock, from before starts were checked or
            # while its clock was behind, refused every later run of the job for good)
            current_began = None
        if token != current and began is not None and current_began is not None \
                and began < current_began - STARTED_SKEW_S:
            # a run older than the current one whose token the row does not list (one this
            # store never saw replaced): taken as a new run, it reset the newer run away
            raise Superseded(job, "job", f"run {token or '(no token)'} of job {job!r} began "
                             f"before its current run {current or '(no token)'} (extra."
                             f"started {clock_text(began)}, more than {STARTED_SKEW_S:g} s "
                             f"before {clock_text(current_began)}): an older run "
                             "cannot replace a newer one; give each run its own job name "
                             "(monitor_job)")
        if token is not None or current is None:
            return raw_meta, meta
        if is_new_run(old.meta, raw_meta):
            raise Superseded(job, "job", f"a meta.json without a run token (extra.run) "
                             f"cannot replace run {current} of job {job!r}, which has one: it "
                             "may be a run older than it; give each run its own job name "
                             "(monitor_job)")
        # (stored without it, the run's own parts, which carry it, were refused as another's)
        extra = raw_meta.get("extra")
        raw_meta = {**raw_meta, "extra": {**(extra if isinstance(extra, dict) else {}),
                                          "run": current}}
        return raw_meta, check_meta(raw_meta, f"job {job}", 1 << 62)

    def _reset(self, job: str, raw_meta: dict, directory: str, way: str) -> bool:
        """A new run of a job (the same name, a new start clock: `--overwrite`): the old run's
        parts, windows and held rows go and its alerts resolve, so the job's page shows the new
        run's history only (the old one's windows were shown as the new run's, and its alerts
        kept firing). The new run is registered in the same transaction (a registration
        refused after the old run was deleted had changed the job); False when another
        instance reset it first (the caller registers)."""
        alert_rows, log_rows, _ = self.alerts.on_reset(job)
        # once: two instances that see the new run both come here, the first resets it
        if not self.store.reset_job(job, raw_meta, alert_rows, log_rows,
                                    still_old=lambda stored: is_new_run(stored, raw_meta),
                                    token_of=run_token, directory=directory, way=way):
            return False
        self.trackers.pop(job, None)
        self._job_bytes.pop(job, None)   # the old run's parts are gone
        self.analyser.forget(str(self.directories.get(job, "")))
        self.states[job] = "running"
        self.metrics.new_run(job)
        self.metrics.set_state(job, "running")
        log.warning("job %s: a new run began (its start clock changed); its history starts "
                    "again", job)
        self._deliver(job, alert_rows, log_rows)
        return True

    def note_dropped(self, job: str, rank: int, dropped: int, run: int | None) -> bool:
        """An uploader's drop count, stored and shown for run number `run` of the job only
        (False: a new run replaced it). Under the lock a new run is reset under: its metrics
        go after a count is shown, or the count is refused."""
        with self._lock:
            if not self.store.set_upload_dropped(job, rank, dropped, run):
                return False
            self.metrics.upload_dropped.labels(job, str(rank)).set(dropped)
            return True

    def tracker(self, job: str) -> JobTracker | ForeignJob | None:
        """The job's tracker (rebuilt from the store if the job finished and comes back) when
        this instance holds its lease; a ForeignJob (its metadata, for checking parts stored
        here) when another instance does; None for a job unknown or set aside."""
        tr = self.trackers.get(job)   # (a dict read needs no lock: the watcher asks per file
        if tr is not None:            # and waited behind the ingest's hold of the lock)
            return tr
        with self._lock:
            tr = self.trackers.get(job)
            if tr is not None:
                return tr
            if job not in self.directories and job not in self.quarantined:
                row = self.store.job(job)   # registered by another instance since
                if row is None:
                    return None
                try:
                    self.directories[job] = self._stored_directory(row)
                except InputError as exc:
                    self._quarantine(job, exc)
                    return None
            if job in self.quarantined:
                return None
            if self.leases.holds(job):
                row = self.store.job(job)   # (a row without metadata is set aside, not
                if row is not None:         # left listed as running and answered 404)
                    return self._rebuild_or_quarantine(row)
                return None
            return self._foreign_job(job)

    def _foreign_job(self, job: str) -> ForeignJob | None:
        """What the ingest needs of a job another instance analyses (read again each second)."""
        view = self._foreign.get(job)
        if view is not None and time.monotonic() - view.read_at < 1.0:
            return view
        row = self.store.job(job)
        if row is None or not row.meta:
            return None
        try:
            meta = check_meta(row.meta, f"stored metadata of job {job!r}", stored=True)
        except Exception as exc:   # noqa: BLE001 - one job's rows must not stop the service
            self._quarantine(job, exc)
            return None
        view = self._foreign[job] = ForeignJob(meta, self.store.max_step(job), time.monotonic(),
                                               row.meta_seq, int(row.run))
        return view

    def _meta_seq(self, job: str, raw_meta: dict) -> int:
        """The stored metadata's version when it is `raw_meta`, else -1 (fences every part)."""
        mark = self.store.job_marks([job]).get(job)
        return int(mark.meta_seq) if mark is not None and \
            mark.meta == json.dumps(raw_meta, sort_keys=True) else -1

    def _run_mark(self, job: str) -> tuple[int | None, str | None]:
        mark = self.store.job_marks([job]).get(job)
        return (mark.run, mark.meta) if mark is not None else (None, None)

    # ---- leases ------------------------------------------------------------------------------

    def _gained(self, job: str) -> None:
        """This instance holds the job's lease now: its tracker from the store (what the last
        holder analysed is skipped, every later part is read)."""
        with self._lock:
            self._foreign.pop(job, None)
            if job in self.quarantined:
                return
            try:
                row = self.store.job(job)
                if row is None:
                    return
                self.directories[job] = self._stored_directory(row)
            except Exception as exc:   # noqa: BLE001 - a damaged row: that job only
                self._quarantine(job, exc)
                return
            self.states[job] = row.state
            self.metrics.set_state(job, row.state)
            self.trackers.pop(job, None)
            self.part_seqs[job] = int(row.part_seq)
            self.runs[job] = self._run_mark(job)
            if row.state != "finished":   # (a row without metadata is set aside)
                self._rebuild_or_quarantine(row)
            try:   # its alerts of rules taken out of the config: nothing decides them now
                self.store_alerts(job, self.alerts.on_unconfigured(job))
            except Exception as exc:   # noqa: BLE001 - its next window resolves them
                log.warning("job %s: alerts of rules no longer configured not resolved now "
                            "(%s); at its next window", job, str(exc)[:200])

    def _lost(self, job: str) -> None:
        """Another instance analyses the job now: its tracker goes (windows queued for it are
        not stored: the fence refuses them)."""
        with self._lock:
            self.trackers.pop(job, None)
            self.states.pop(job, None)
            self.part_seqs.pop(job, None)
            self.runs.pop(job, None)

    def _stored_directory(self, job: JobRecord) -> Path:
        """A stored job's directory: a watched run's as stored, an uploaded job's its folder
        under this monitor's uploads folder, whatever path its row kept; InputError (the job
        is quarantined) when its row names a way in that does not exist."""
        if job.way == "http":
            # an uploaded job's folder is the uploads folder's, by construction: the row's
            # path as the monitor that stored it was given it (relative to its working folder,
            # or from before the store and its uploads were moved) set every uploaded job
            # aside when the same store was opened by another path
            return self.data_dir / job.job
        if job.way != "files":
            raise InputError(f"stored row of job {job.job!r}", "way", f"{job.way!r}; expected "
                             "an uploaded job (http) or a watched run (files)")
        return Path(job.directory)

    def _live_jobs(self) -> int:
        """The jobs that hold a place of max_jobs: all but the finished ones (they held their
        places for good: after max_jobs jobs in the monitor's life, every new one was
        refused; one held by another instance counts, its state unknown here) and the set
        aside (quarantined: tracked by nobody; one set aside while serving held its place
        until a restart, new jobs 409 meanwhile: red team round 9 F6b)."""
        return sum(1 for job in self.directories
                   if self.states.get(job) != "finished" and job not in self.quarantined)

    def _same_job(self, old: JobRecord | None, directory: Path, way: str) -> bool:
        """Whether a stored job is the one announced at `directory` by `way` (an uploaded job
        by its name alone: its folder is the uploads folder's, `_stored_directory`)."""
        if old is None:
            return False
        if way == "http" and old.way not in ("http", "files"):
            return True   # an uploaded job's row with a way the ingest never writes: repaired
        if way == "http" or old.way == "http":
            return way == old.way
        return old.directory == str(directory)

    def _rebuild_or_quarantine(self, job: JobRecord) -> JobTracker | None:
        """_rebuild, or, when the job's stored rows cannot be used (its metadata damaged or
        refused by today's checks), the job set aside — named in the log, /api/stats and its
        state — while every other job goes on (a bad row once made every start exit 4)."""
        try:
            return self._rebuild(job)
        except Exception as exc:   # noqa: BLE001 - one job's rows must not stop the service
            self._quarantine(job.job, exc)
            return None

    def _quarantine(self, job: str, exc: Exception) -> None:
        problem = str(exc) if isinstance(exc, InputError) else \
            f"{type(exc).__name__}: {str(exc)[:200]}"
        self.quarantined[job] = problem
        try:
            mark = self.store.job_marks([job]).get(job)
        except Exception:   # noqa: BLE001 - unreadable: looked at again at the next tick
            mark = None
        if self.store.shared:   # (what it was set aside under: another instance may fix it)
            self._quarantined_meta[job] = mark.meta if mark is not None else None
        self.remedies[job] = _remedy(exc, mark.meta if mark is not None else None)
        self.trackers.pop(job, None)
        self.states[job] = "quarantined"
        self.reject("quarantined", f"job {job}", f"stored rows unusable, job set aside: "
                    f"{problem}")

    def _rebuild(self, job: JobRecord) -> JobTracker:
        """A tracker from the store: analysed steps skipped, later parts read from disk."""
        name, directory = job.job, self._stored_directory(job)
        meta = check_meta(job.meta, f"stored metadata of job {name!r}", stored=True)
        last = self.store.last_window(name)
        index = self.store.part_index(name)
        _check_stored_numbers(name, meta, last, index)
        consumed = last.last_step if last else -1
        due = [p for p in index if p.last_step > consumed]
        # (the due parts first: in the right folder the first one looked at is there)
        if job.way == "http" and due and not any(
                os.path.lexists(part_path(directory, p.rank, p.part))
                for p in due + [p for p in index if p.last_step <= consumed]):
            # (a folder marked for this store, not the one its parts went to: the store
            # started by turns with two uploads folders; each part was "vanished", the job
            # listed as running, and its acknowledged parts never analysed. Judged by all
            # of its stored parts, analysed ones too: the one part not analysed yet, lost
            # from the right folder, is passed over as any part missing among others)
            raise InputError(f"stored row of job {name!r}", "directory", f"none of its "
                             f"{len(index)} acknowledged parts ({len(due)} not analysed "
                             "yet) is in the uploads folder: started with another "
                             "--data-dir than they were uploaded to")
        tr = JobTracker(name, meta, self.config.window_steps, self.config.gap_wait_s,
                        consumed_step=last.last_step if last else -1,
                        next_idx=last.idx + 1 if last else 0,
                        read_timeout_s=self.config.read_timeout_s)
        # its windows are stored under the lease it was built under, and under no later one
        # (a tracker of an earlier holding, lost and taken again, must not store its windows)
        tr.lease = self.leases.lease(name)
        tr.meta_seq = int(job.meta_seq)
        tr.run = int(job.run)   # (a part accepted for this run reports its drops to it alone)
        self.analyser.warm()  # a job means windows soon: start the analysis process now
        self.part_seqs[name] = max([self.part_seqs.get(name, 0)] + [p.seq for p in index])
        self._take_stored(tr, directory, index)
        self.analyser.read_ahead(list(tr.files))
        self.trackers[name] = tr
        return tr

    def _take_stored(self, tr: JobTracker, directory: Path,
                     index: list[PartIndex]) -> list[PartFile]:
        """Parts from the store into a tracker (their footers read when their steps are not
        analysed yet, and checked again against the job as read back); the files held for
        windows."""
        within = self.part_root(directory)
        fresh = [p for p in index if not tr.knows(p.rank, p.part)]
        # the places of the ranks' analysed parts first: a part read back is judged against
        # them as the ingest judged it
        self._learn_places(tr, directory, [p for p in index if p.last_step <= tr.consumed_step])
        read: dict[tuple[int, int], PartData | PartFile] = {}
        # an upload's file read back holds the bytes acknowledged (its stored fingerprint): a
        # file replaced since (another writer, another job's backup restored) was analysed as
        # that part
        digests = self.store.part_digests(tr.job, tr.consumed_step) if fresh else {}
        for p in fresh:
            if p.last_step <= tr.consumed_step:
                continue
            path = part_path(directory, p.rank, p.part)
            try:
                stored = digests.get((p.rank, p.part))
                on_disk = file_fingerprint(path) if stored is not None else None
                if on_disk is not None and on_disk != stored:
                    self.reject("bad_part", str(path), "stored part set aside when read back: "
                                "its bytes are not the part acknowledged (its fingerprint "
                                "differs: the file was replaced since)")
                    continue
                # (bounded: a stuck file is left out as an unreadable one is)
                got: PartData | PartFile | InputError | None = \
                    read_part_footers([path], self.file_readers, [within])[0]
                if got is None:
                    got = read_part_files([path], self.file_readers, None, [within])[0]
                if isinstance(got, InputError):
                    raise got
                read[(p.rank, p.part)] = got
            except InputError as exc:
                log.warning("job %s: stored part unreadable now: %s", tr.job, exc)
        # in the order they were stored, as the ingest took them
        for p in sorted(fresh, key=lambda p: (p.seq, p.rank, p.part)):
            data = read.get((p.rank, p.part))
            if data is None:
                continue
            problem = self._check_read_back(tr, p, data, part_path(directory, p.rank, p.part))
            if problem is not None:
                del read[(p.rank, p.part)]
                self.reject("bad_part", str(part_path(directory, p.rank, p.part)),
                            f"stored part set aside when read back: {problem.named}")
            else:
                tr.claim(p.rank, rows_place(data))
        held, read_at = [], time.time()
        for p in fresh:
            got = read.get((p.rank, p.part))
            file = got if isinstance(got, PartFile) else None
            columns = got.columns if isinstance(got, PartData) else None
            if tr.add_part(p.rank, p.part, p.last_step, columns, _arrival(p.ingested_at,
                                                                           read_at),
                           file) and file is not None:
                held.append(file)
            if p.part == 0 and is_whole_rank_file(part_path(directory, p.rank, 0)):
                tr.mark_whole(p.rank)
        return held

    def _check_read_back(self, tr: JobTracker, p: PartIndex, data: PartData | PartFile,
                         source: Path) -> InputError | None:
        """The checks a part's rows pass at ingest that hang on the job (its sizes, one rank
        per place), made again on a stored part as read back: another instance stores parts of
        a job it does not analyse without knowing the places its ranks took, and rows of two
        ranks at one place once took a rank's place for good. (Not the layout entry: a part
        taken under an earlier layout is not set aside by a restart.)"""
        try:
            if isinstance(data, PartFile):
                check_file_in_job(data, tr.meta, source)
            else:
                check_in_job(data, tr.meta, source)
        except InputError as exc:
            return exc
        return check_place(tr.job, p.rank, source, data, tr, {})

    def _learn_places(self, tr: JobTracker, directory: Path, analysed: list[PartIndex]) -> None:
        """A job without a layout: each rank's place from its newest analysed part whose rows
        sit at one place (of its newest 4), for the ranks whose place is not known yet (after
        a restart, another rank's part at such a place was taken as the first there, and the
        rank's own next part refused)."""
        if tr.layout:
            return
        newest: dict[int, list[int]] = {}
        for p in analysed:
            if p.rank not in tr.places:
                newest.setdefault(p.rank, []).append(p.part)
        within = self.part_root(directory)
        for rank in sorted(newest):   # (the lower rank holds a place two claim, as a window)
            for part in sorted(newest[rank], reverse=True)[:4]:
                footer = read_part_footers([part_path(directory, rank, part)], self.file_readers,
                                           [within])[0]
                place = rows_place(footer) if isinstance(footer, PartFile) else None
                if place is not None and place != (-1, -1):
                    tr.claim(rank, place)
                    break

    def _follow_store(self, now: float) -> list:
        """Parts, new runs and new metadata that other instances stored for the jobs held
        here (each job's part sequence says what is new); the windows they close."""
        if not self.store.shared:
            return []   # one instance: nothing is stored but what it stored itself
        with self._lock:
            held = [j for j in [*self.part_seqs, *self.quarantined] if self.leases.holds(j)]
        marks = self.store.job_marks(held)
        windows, ahead = [], []
        with self._lock:
            for job, mark in marks.items():
                if job in self.quarantined and self.leases.holds(job) and \
                        mark.meta != self._quarantined_meta.get(job, mark.meta):
                    # metadata PUT at another instance: the job as stored now is tried again
                    # (the holder kept it set aside for good, and the parts that instance
                    # acknowledged were never analysed)
                    self.quarantined.pop(job, None)
                    self._quarantined_meta.pop(job, None)
                    self._gained(job)
                    continue
                if job not in self.part_seqs or job in self.quarantined:
                    continue
                if not self._follow_meta(job, mark):
                    continue
                tr = self.trackers.get(job)
                if int(mark.part_seq) <= self.part_seqs[job]:
                    continue
                if tr is None:
                    back = self.tracker(job)   # a finished job comes back: rebuilt whole
                    if not isinstance(back, JobTracker):
                        continue
                    tr = back
                else:
                    index = self.store.part_index(job, self.part_seqs[job])
                    self.part_seqs[job] = max([self.part_seqs[job]] + [p.seq for p in index])
                    ahead += self._take_stored(tr, self.directories[job], index)
                if self.states.get(job) != "running":
                    self._set_state(job, "running")
                windows.extend(tr.close_ready(now))
        self.analyser.read_ahead(ahead)
        return windows

    def _follow_meta(self, job: str, mark: JobMark) -> bool:
        """A held job's new run or metadata stored by another instance, taken (under the
        lock); False when the job started again from the store or was set aside."""
        if self.runs.get(job, (None,))[0] not in (None, mark.run):
            # another instance saw a new run: start again from the store
            self.trackers.pop(job, None)
            self._gained(job)
            return False
        tr = self.trackers.get(job)
        if tr is not None and self.runs.get(job, (None, None))[1] != mark.meta:
            try:
                tr.set_meta(check_meta(json.loads(mark.meta or "null"), f"stored "
                                       f"metadata of job {job!r}", stored=True))
            except Exception as exc:   # noqa: BLE001 - that job only
                self._quarantine(job, exc)
                return False
        self.runs[job] = (mark.run, mark.meta)
        if tr is not None:
            tr.meta_seq = int(mark.meta_seq)
        return True

    def _meta_moved(self, job: str) -> None:
        """Another instance changed a job's metadata after parts of it here were checked
        (add_parts said STALE): what checks them is read again now — a job held elsewhere's
        view, a held job's tracker as its next tick would — before they are checked again."""
        with self._lock:
            self._foreign.pop(job, None)
            if job not in self.trackers or job in self.quarantined:
                return
            mark = self.store.job_marks([job]).get(job)
            if mark is not None:
                self._follow_meta(job, mark)

    # ---- parts -------------------------------------------------------------------------------

    def submit(self, item: PartIn) -> None:
        """Queue a part for the ingest thread (never blocks)."""
        if item.path is not None and item.written_at is None and item.way == "files":
            try:
                item.written_at = os.stat(item.path).st_ctime
            except OSError:
                pass   # gone: the ingest refuses it
        key = (item.job, item.rank)
        if item.floor is None:   # (a watched file may be taken as arrived up to the slack early)
            item.floor = time.time() - (time.monotonic() - item.queued_at) - \
                (self.config.file_time_slack_s if item.way == "files" else 0.0)
        with self._count_lock:
            self._floors[item.floor] = self._floors.get(item.floor, 0) + 1
            self._inflight += 1
            self._parts_in_flight[key] = self._parts_in_flight.get(key, 0) + 1
            self._jobs_in_flight[item.job] = self._jobs_in_flight.get(item.job, 0) + 1
        self._ingest.put(item)

    def _landed(self, batch: list[PartIn]) -> None:
        """A batch's parts are stored or refused: no longer in flight (a silence decision
        deferred over them is taken now)."""
        with self._count_lock:
            self._inflight -= len(batch)
            for it in batch:
                if it.floor is not None:
                    _decrement(self._floors, it.floor)
                _decrement(self._parts_in_flight, (it.job, it.rank))
                _decrement(self._jobs_in_flight, it.job)
            self._settled += 1
            deferred, self._deferred = self._deferred, False
        if deferred:
            self._tick_wake.set()

    def in_flight(self, job: str, rank: int | None = None, since: float | None = None) -> bool:
        """Whether parts of the job (of that rank) are queued or being stored, or, for a
        silence since `since`, a watcher is handing over events that may hold one."""
        with self._count_lock:
            if since is not None and self._noticing_since(since):
                return True
            if rank is None:
                return job in self._jobs_in_flight
            return (job, rank) in self._parts_in_flight

    def ranks_in_flight(self, job: str, since: float) -> set[int] | None:
        """The ranks of the job with parts queued or being stored; None when a watcher is
        handing over events that may hold a part of any rank written after `since`."""
        with self._count_lock:
            if self._noticing_since(since):
                return None
            return {r for j, r in self._parts_in_flight if j == job}

    def _noticing_since(self, since: float) -> bool:
        """A batch of file events being handed over may hold a part written after `since`
        (held by _count_lock). A batch handed over for longer than stall_after_s / 2 no
        longer holds decisions: the lag guard's rule."""
        deadline = since + self.config.stall_after_s
        oldest = time.monotonic() - self.config.stall_after_s / 2
        return any(after < deadline and began > oldest
                   for after, began in self._noticing.values())

    @contextmanager
    def noticing(self, after: float) -> Iterator[None]:
        """A watcher hands over a batch of file events that happened after `after` (wall
        time: its previous batch's arrival): a silence whose deadline lies after it is decided
        once the batch is submitted (a part written just before the deadline may be in it,
        not yet queued)."""
        token = object()
        with self._count_lock:
            self._noticing[token] = (after, time.monotonic())
        try:
            yield
        finally:
            with self._count_lock:
                del self._noticing[token]
                self._settled += 1
                deferred, self._deferred = self._deferred, False
            if deferred:
                self._tick_wake.set()

    def defer_silence(self) -> None:
        """A silence was not decided over parts in flight: tick again once a batch landed (at
        once if one landed since the tick began: its in-flight check may have seen it)."""
        with self._count_lock:
            self._deferred = True
            if self._settled != self._tick_mark:
                self._tick_wake.set()

    def publish_mark(self) -> None:
        """On a shared store, say what this instance's ingest holds (IngestMark): the holder
        of a job decides no silence while a part heard here before its deadline may still be
        on its way to the store (it decided over them, a false stall or rank_silent a tick
        before it followed the part). Every tick, so a deadline waits a tick or two."""
        if not self.store.shared:
            return
        as_of = time.time()   # (read first: a part submitted after it is not the mark's)
        fresh = time.monotonic() - self.config.stall_after_s / 2   # (as _noticing_since)
        with self._count_lock:
            floors = list(self._floors) + [after for after, began in self._noticing.values()
                                           if began > fresh]
        try:
            self.store.set_ingest_mark(self.instance, as_of, min(floors) if floors else None)
        except Exception as exc:   # noqa: BLE001 - a full or unreachable store: said once
            # (the others then wait with their silences, as for parts in flight here, until
            # the mark is written again or this instance's lease runs out)
            if not self._mark_failed:
                log.warning("ingest mark not written (%s); other instances hold their "
                            "silence decisions until it is", str(exc).splitlines()[0]
                            if str(exc) else type(exc).__name__)
            self._mark_failed = True
            return
        if self._mark_failed:
            log.warning("ingest mark written again")
        self._mark_failed = False

    def settled_elsewhere(self, deadline: float) -> bool:
        """Whether every other live instance said, at the tick's start, that every part it
        heard up to `deadline` is stored (and so followed here) or refused: a silence whose
        deadline that is may be decided."""
        held = [m for m in self._marks
                if m.as_of < deadline or (m.oldest is not None and m.oldest <= deadline)]
        if held:
            # their next marks (each instance writes one a tick) may let it go: the tick
            # looks again right after (tick_wait), not up to a tick after that, which made a
            # silence on a shared store up to two ticks late
            due = min(m.as_of for m in held) + self.config.tick_s
            self._marks_due = due if self._marks_due is None else min(self._marks_due, due)
        return not held

    def _count(self, delta: int) -> None:
        with self._count_lock:
            self._inflight += delta

    def _queue_analysis(self, item) -> None:
        self._count(1)
        if isinstance(item, Window):
            with self._count_lock:
                self._windows_in_flight[item.job] = self._windows_in_flight.get(item.job, 0) + 1
                item.run = self._run_count.get(item.job, 0)
        self._analysis.put(item)

    def reject(self, reason: str, source: str, problem: str) -> None:
        """Count and remember a refused part or request."""
        self.metrics.rejected.labels(reason).inc()
        # readers of /api/stats see the run's own names, not the server's directories (the
        # log keeps the whole path for the operator)
        # (printable: a file name that is not UTF-8, b'run-\xff', shown as run-\xff; its
        # surrogate escape made /api/stats a 500, red team round 9 F5)
        source, problem = printable(source), printable(problem)
        self.recent_rejects.appendleft({"at": time.time(), "reason": reason,
                                        "source": self._public(source),
                                        "problem": self._public(problem)})
        # a flood of refusals (a wrong token, junk bodies in a loop) is a line per refusal up
        # to a burst, then a few a second with how many went unlogged: each once wrote a line
        # (with 256 connections a client, ~200 KB/s of log); the metric counts every one
        unlogged = self._log_budget.take(reason)
        if unlogged is not None:
            more = f" ({unlogged} more {reason!r} refusals not logged)" if unlogged else ""
            log.warning("refused %s: %s%s", source, problem, more)

    def _public(self, text: str) -> str:
        """`text` with the server's directories (uploads, watched roots) left out: paths read
        relative to them (run/meta.json)."""
        text = str(text)
        for root in sorted(self.private_roots, key=len, reverse=True):
            text = text.replace(root + "/", "").replace(root, ".")
        return text

    def _ingest_loop(self) -> None:
        while True:
            first = self._ingest.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < MAX_BATCH:
                try:
                    item = self._ingest.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._ingest.put(None)
                    break
                batch.append(item)
            self._ingest_started = min(it.queued_at for it in batch)
            try:
                with self._batch_lock:
                    self._ingest_batch(batch)
            except Exception as exc:  # the store failed (disk full): the parts were not taken
                # (uploads are answered with the error, watched files queued again by the
                # rescans); said once while it fails so, not a traceback a batch
                said = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                if said != self._ingest_failed:
                    log.error("ingest batch failed (%s); said once while it fails so", said,
                              exc_info=not isinstance(exc, self.trouble.storage_errors))
                self._ingest_failed = said
                self.metrics.store_errors.labels("ingest").inc()
                for it in batch:
                    if it.done is not None and not it.done.done():
                        it.done.set_exception(exc)
            else:
                if self._ingest_failed is not None:
                    log.warning("ingest stores again")
                    self._ingest_failed = None
            finally:
                self._ingest_started = None
                self._landed(batch)

    def _settle_known(self, it: PartIn) -> None:
        """A part number seen before: `duplicate` for the same bytes, a conflict for others."""
        if it.digest is None:   # a watched file seen again (files are replaced atomically)
            _settle(it, "duplicate")
            return
        try:
            check_same_part(self.store.part_digest(it.job, it.rank, it.part), it.digest,
                            it.job, it.rank, it.part)
        except PartConflict as exc:   # only uploads carry a digest; the request counts it
            _settle(it, exc=exc)
            return
        _settle(it, "duplicate")

    def _ingest_batch(self, batch: list[PartIn]) -> None:
        # the same part number twice in one batch: the second waits until the first is stored
        # or refused (it would otherwise overwrite the first's file before either is checked)
        seen: set[tuple[str, int, int]] = set()
        first: list[PartIn] = []
        again: list[PartIn] = []
        for it in batch:
            key = (it.job, it.rank, it.part)
            (again if key in seen else first).append(it)
            seen.add(key)
        if again:
            self._ingest_batch(first)
            self._ingest_batch(again)
            return
        rows: list[tuple[Any, ...]] = []
        taken: list[tuple[PartIn, PartData | PartFile]] = []
        fresh: list[PartIn] = []
        trackers: dict[str, JobTracker | ForeignJob] = {}
        for it in batch:
            tr = self.tracker(it.job)
            if tr is None:
                self.reject("unknown_job", f"{it.job}/{it.rank}/{it.part}", "unknown job")
                _settle(it, exc=InputError(it.job, "job", "unknown job"))
                continue
            trackers[it.job] = tr
            if tr.knows(it.rank, it.part):
                self._settle_known(it)
                continue
            fresh.append(it)
        # watched files are checked from their footers and uploads from their footers and the
        # three columns a footer cannot vouch for (read_upload): their rows are read by their
        # window (decoded ahead in the analysis process), so the service holds no rows of them;
        # those whose footer cannot tell are read whole and checked together (one check per
        # column for the batch, not per part); uploads are written once checked
        files = [(it, it.path) for it in fresh
                 if it.data is None and it.body is None and it.path is not None]
        footers = read_part_footers([path for _, path in files], self.file_readers,
                                    [self.part_root(path.parent) for _, path in files])
        read: dict[int, PartData | PartFile | InputError] = {
            id(it): f for (it, _), f in zip(files, footers) if f is not None}
        whole = [(it, path) for (it, path), f in zip(files, footers) if f is None]
        uploads = [(it, it.body) for it in fresh if it.body is not None]
        read.update(zip([id(it) for it, _ in whole], read_part_files(
            [path for _, path in whole], self.file_readers, None,
            [self.part_root(path.parent) for _, path in whole])))
        # (their rows checked together: one check per column for the batch, not per part)
        checked = check_uploads([(body, _source(it), it.rank, it.part, self.directories[it.job]
                                  / rank_file_name(it.rank, it.part)) for it, body in uploads],
                                self._readers)
        for (it, _), f in zip(uploads, checked):
            if isinstance(f, PartFile):   # (read again from its folder by its window)
                f.within = self.part_root(self.directories[it.job])
        read.update((id(it), f) for (it, _), f in zip(uploads, checked) if f is not None)
        unsure = [(it, body) for (it, body), f in zip(uploads, checked) if f is None]
        read.update(zip([id(it) for it, _ in unsure], read_uploads(
            [(body, _source(it), it.rank, it.part) for it, body in unsure], self._readers)))
        pending: dict[str, int] = {}   # job → bytes of this batch's parts taken so far
        spans: dict[tuple[str, int], list[tuple[int, int, PartIn, Any]]] = {}   # their steps
        claims: dict[tuple[str, object], object] = {}   # and the places their ranks took
        # job → the last step of this batch's parts taken so far: a wild step is judged
        # against them too (a new job's first parts and a part 2**40 past them, taken in one
        # batch, let it through: its rows were held and never analysed)
        reach: dict[str, int] = {}
        for it in [it for it, _ in files] + [it for it, _ in uploads]:
            # places the job does not have (stage 7 of a 2-stage job)
            data = read[id(it)]
            if not isinstance(data, InputError):
                try:
                    tracker = trackers[it.job]   # (and the place its rank's layout says)
                    place = tracker.layout.get(it.rank)
                    if isinstance(data, PartFile):
                        check_file_in_job(data, tracker.meta, it.path or _source(it), place)
                    else:
                        check_in_job(data, tracker.meta, it.path or _source(it), place)
                except InputError as exc:
                    read[id(it)] = exc
                    continue
                steps = data.columns["step"] if isinstance(data, PartData) else \
                    np.array([data.first_step, data.last_step], dtype=np.int64)
                wild = check_step_gaps(steps, max(trackers[it.job].max_step,
                                                  reach.get(it.job, -1)), it.path or _source(it))
                if wild is not None:
                    read[id(it)] = wild
                    continue
                clash = self._overlap(it, data, trackers[it.job], spans)
                if clash is not None:
                    read[id(it)] = clash
                    continue
                taken_place = check_place(it.job, it.rank, it.path or _source(it), data,
                                          trackers[it.job], claims)
                if taken_place is not None:
                    read[id(it)] = taken_place
                    continue
                full = self._over_job_bytes(it, data.nbytes, pending)
                if full is not None:
                    read[id(it)] = full
                    continue
                reach[it.job] = max(reach.get(it.job, -1), data.last_step)
        self._write_uploads([(it, body) for it, body in uploads
                             if not isinstance(read[id(it)], InputError)])
        now, mono = time.time(), time.monotonic()
        # parts in flight here while this instance's heartbeat had lapsed (a pause, the store
        # out of reach) count as heard once it was back: the others left its ingest mark out
        # meanwhile and decided silences without them (a paused instance that woke and stored
        # a part heard before such a deadline made that stall false, taken back once followed)
        self._heard_floor = now if self.leases.lapsed() else self.leases.lapse_ended_at
        for it in fresh:
            got = read.get(id(it), it.data)
            if got is None:   # neither a file, nor bytes, nor rows: nothing to take
                continue
            if isinstance(got, StuckRead):   # not refused: a later scan reads it again
                # (an upload checked again from its file, its metadata changed meanwhile:
                # 503, retried by its client)
                _settle(it, exc=got if it.way == "files" else
                        OSError(errno.ETIMEDOUT, f"{got.source}: {got.problem}"))
                continue
            if isinstance(got, InputError):
                if it.done is not None:   # the request answers 422 (and counts the refusal)
                    _settle(it, exc=got)
                else:
                    # (the column named, as a 422 names it: "field 'start_ts': expected...")
                    self.reject("bad_part", str(it.path), got.named)
                continue
            it.records = got.records
            # (stored with when it was heard: the job's holder, here or another instance,
            # or this one after a restart, judges silence from that, as the ingest does)
            rows.append((it.job, it.rank, it.part, got.records, got.first_step,
                         got.last_step, got.nbytes, it.way, it.digest, _step_set(got),
                         self._heard(it, now, mono)))
            taken.append((it, got))
        if not rows:
            return
        # on a shared store each job's parts are committed only while its metadata is the
        # version they were checked against: in-flight checks see this instance's parts
        # alone, and another instance's new run (or new sizes) committed between a part's
        # check here and its commit took it as the new run's (a part of that number from
        # the new run was then refused 409), or stored a rank the job no longer had (the job
        # set aside at its next rebuild)
        fence = {job: tr.meta_seq for job, tr in trackers.items()
                 if tr.meta_seq is not None} if self.store.shared else None
        new = self.store.add_parts(rows, now, fence)
        for job in {it.job for (it, _), is_new in zip(taken, new) if is_new == STALE}:
            self._meta_moved(job)
        for job in {it.job for (it, _), is_new in zip(taken, new) if is_new == DAMAGED}:
            with self._lock:   # its row damaged while serving: that job alone set aside
                self._quarantine(job, _unreadable(self.store, job))
        for (it, got), is_new in zip(taken, new):
            if is_new is None:   # forgotten meanwhile (another instance's expiry sweep)
                _settle(it, exc=InputError(it.job, "job", "unknown job"))
            elif is_new == DAMAGED:
                why = self.quarantined.get(it.job, "its stored row does not read")
                _settle(it, exc=PartConflict(f"job {it.job!r}", None,
                                             f"set aside: {str(why)[:200]}"))
            elif is_new == STALE:
                if it.body is None and it.path is None and isinstance(got, PartFile):
                    it.path = got.path   # (an upload's bytes are in its file now)
                # checked again against what the job is now (a few times: then the client
                # or the rescan tries again)
                it.stale += 1
                if it.stale > MAX_STALE:
                    _settle(it, exc=MetaChanged(it.job, "job", "its metadata changed while "
                                                "the part was being stored; try again"))
                else:
                    self.submit(it)
        for row, is_new in zip(rows, new):
            if is_new is True and row[0] in self._job_bytes:
                stored, read_at, counted = self._job_bytes[row[0]]
                self._job_bytes[row[0]] = (stored + int(row[6]), read_at, counted)
        windows, ahead = [], []
        with self._lock:
            touched = set()
            steps_before: dict[str, int] = {}   # job → its max_step before this batch
            for (it, data), is_new in zip(taken, new):
                if is_new is None or is_new == STALE or is_new == DAMAGED:
                    continue
                if not is_new:
                    self._settle_known(it)
                    continue
                if it.job not in self.trackers:
                    # another instance analyses this job: stored here, taken there from the
                    # store (its part sequence)
                    self._counted(it, data)
                    _settle(it, "stored")
                    continue
                heard = self._heard(it, now, mono)
                tr = self.trackers[it.job]
                if tr.last_arrival is not None and \
                        heard - tr.last_arrival >= self.config.stall_after_s:
                    tr.resumed_at = max(tr.resumed_at or heard, heard)   # (tracker's comment)
                steps_before.setdefault(it.job, tr.max_step)
                self.trackers[it.job].claim(it.rank, rows_place(data))
                if isinstance(data, PartFile):
                    if self.trackers[it.job].add_part(it.rank, it.part, data.last_step, None,
                                                      heard, data):
                        ahead.append(data)
                else:
                    self.trackers[it.job].add_part(it.rank, it.part, data.last_step,
                                                   data.columns, heard)
                if is_whole_rank_file(it.path):
                    self.trackers[it.job].mark_whole(it.rank)
                self._counted(it, data)
                touched.add(it.job)
                _settle(it, "stored")
            for job in touched:
                if self.states.get(job) != "running":
                    self._set_state(job, "running")
                tr = self.trackers[job]
                if tr.max_step > steps_before[job] and job in self.watchdog.overdue:
                    # a rank quiet past its deadline while it was not behind is silent from
                    # the moment the others go past its steps: decided now, not at the next
                    # tick (its deadline passed already, so no wake was due for it)
                    self._tick_wake.set()
                windows.extend(tr.close_ready(now))
        if touched:   # their parts' step times, to the change detector
            self.watchdog.wake()
        # the watched files taken by their footers are decoded ahead in the analysis process
        # (queued before the windows they close, so those find them read)
        self.analyser.read_ahead(ahead)
        for w in windows:
            self._queue_analysis(w)

    def _overlap(self, it: PartIn, data: PartData | PartFile, tr: JobTracker | ForeignJob,
                 batch: dict[tuple[str, int], list[tuple[int, int, PartIn, Any]]]) -> \
            PartConflict | None:
        """A conflict when another part of the rank (stored, or earlier in this batch) shares a
        step with this one: a recorder sends each step once, and rows of a step twice failed
        its whole window (duplicate ops); else the part is noted in `batch`. Parts whose step
        ranges meet are compared by their distinct steps (step_sets): a part of steps 0..3 and
        904 holds none of 5..903, and the rank's parts of those steps are its own."""
        first, last = data.first_step, data.last_step
        key = (it.job, it.rank)
        mine: list[Steps] = []   # this part's steps, read once, only when a range meets

        def shares(theirs: Steps) -> bool:
            if not mine:
                mine.append(self._part_steps(it, data))
            return meet(mine[0], theirs)

        other = next((o.part for f, l, o, od in batch.get(key, ())
                      if f <= last and first <= l and shares(self._part_steps(o, od))), None)
        if other is None:
            rp = tr.ranks.get(it.rank) if isinstance(tr, JobTracker) else None
            # parts come in step order: only one that starts at or below a step the rank
            # sent already is looked for in the store (another instance's parts too)
            if not isinstance(tr, JobTracker) or (rp is not None and first <= rp.last_step):
                for part, f, l, text in self.store.overlapping_parts(it.job, it.rank, it.part,
                                                                     first, last):
                    if shares(self._stored_steps(it.job, it.rank, part, f, l, text)):
                        other = part
                        break
        if other is None:
            batch.setdefault(key, []).append((first, last, it, data))
            return None
        return PartConflict(it.path or _source(it), "steps", f"steps {first}..{last} of rank "
                            f"{it.rank} were sent already in its part {other}; each step is "
                            "sent once (nothing of this part was stored)")

    def _part_steps(self, it: PartIn, data: PartData | PartFile) -> Steps:
        """A part's distinct steps: its rows', or its file's step column read once (its bytes,
        for an upload not written yet); its range when they cannot be read (as before)."""
        if isinstance(data, PartData):
            return distinct(data.columns["step"])
        if data.steps is None:
            source = it.body if it.body is not None else data.path
            data.steps = read_steps(source, data.within)
        return data.steps if data.steps is not None else (data.first_step, data.last_step)

    def _stored_steps(self, job: str, rank: int, part: int, first: int, last: int,
                      text: str | None) -> Steps:
        """A stored part's distinct steps: as the store wrote them, else (a store written
        before step sets, or a file taken by its footer) read from its file and written to
        its row, so once; its range when neither can be read (as before)."""
        steps = decode(text, first, last)
        if steps is not None:
            return steps
        directory = self.directories.get(job)
        if directory is None:
            return (first, last)
        read = read_steps(part_path(directory, rank, part), self.part_root(directory))
        if read is None or not len(read) or int(read[0]) < first or int(read[-1]) > last:
            return (first, last)   # (a file that does not agree with its row proves nothing)
        written = encode(read)
        if written is not None:
            try:
                self.store.set_step_set(job, rank, part, written)
            except Exception as exc:   # (a full disk: read again next time, nothing lost)
                log.warning("job %s: step set of rank %d part %d not noted: %s", job, rank,
                            part, exc)
        return read

    def _heard(self, it: PartIn, now: float, mono: float) -> float:
        """When a part arrived, for silence: when it was queued (a watcher's notice, an
        upload's body read), not when its batch was stored; a watched file when it got its
        name (ctime), if that lies within file_time_slack_s before the notice (the watcher's
        and the ingest's delays, up to a few hundred ms for a thousand ranks' parts at once,
        then no longer make the dead-man late), never after the notice."""
        noticed = now - max(0.0, mono - it.queued_at)
        if it.written_at is not None:
            noticed = min(noticed, max(it.written_at, noticed - self.config.file_time_slack_s))
        return max(noticed, self._heard_floor)

    @overload
    def job_bytes(self, job: str) -> int: ...

    @overload
    def job_bytes(self, job: str, read: bool) -> int | None: ...

    def job_bytes(self, job: str, read: bool = True) -> int | None:
        """Bytes of the parts the job stored that hold steps not analysed yet (read from the
        store once, then counted here; read again once a window of the job is stored, and
        each second where other instances store parts too); with `read` False, None where
        that needs a read. Read (and counted) by the ingest thread only: it alone stores this
        instance's parts, so no older read can overwrite its count."""
        known = self._job_bytes.get(job)
        seen = self._windows_stored.get(job, 0)
        if known is not None and known[2] == seen and \
                (not self.store.shared or time.monotonic() - known[1] < 1.0):
            return known[0]
        if not read:
            return None
        stored = self.store.job_bytes(job)
        self._job_bytes[job] = (stored, time.monotonic(), seen)
        return stored

    def _over_job_bytes(self, it: PartIn, nbytes: int, pending: dict[str, int]) -> \
            JobFull | None:
        """JobFull when the part would take its job past max_job_bytes (with the parts of
        this batch taken before it); else the part is counted in `pending`."""
        limit = self.config.max_job_bytes
        total = self.job_bytes(it.job) + pending.get(it.job, 0)
        if total + nbytes > limit:
            return JobFull(it.path or _source(it), None, f"job {it.job!r} stores {total} bytes "
                           f"of parts; {nbytes} more would pass its max_job_bytes ({limit})")
        pending[it.job] = pending.get(it.job, 0) + nbytes
        return None

    def expire_empty_jobs(self, now: float | None = None) -> list[str]:
        """Forget the uploaded jobs that stored no part in empty_job_expiry_s since their last
        meta.json (rows and folders): a client creating empty jobs at the allowed rate once
        took every place of max_jobs for good. Returns their names."""
        now = time.time() if now is None else now
        with self._batch_lock, self._lock:
            gone = self.store.expire_empty_jobs(now - self.config.empty_job_expiry_s, "http")
            if self.store.shared:   # forgotten by another instance: forgotten here too
                known = self.store.job_names()
                gone += [j for j in self.directories if j not in known and j not in gone]
            for job in gone:
                directory = self.directories.pop(job, None)
                self.trackers.pop(job, None)
                self.states.pop(job, None)
                self.quarantined.pop(job, None)
                self._foreign.pop(job, None)
                self.part_seqs.pop(job, None)
                self.runs.pop(job, None)
                self._job_bytes.pop(job, None)
                self.leases.forget(job)
                self.metrics.forget(job)
                if directory is not None:
                    self.analyser.forget(str(directory))
                    if directory == self.data_dir / job:
                        _remove_empty_upload_dir(directory)
        if gone:
            log.warning("forgot %d job(s) that stored no part in %.0f s: %s", len(gone),
                        self.config.empty_job_expiry_s, ", ".join(sorted(gone)[:10]))
        return gone

    def _counted(self, it: PartIn, data) -> None:
        self.metrics.parts.labels(it.way).inc()
        self.metrics.records.labels(it.way).inc(data.records)
        self.metrics.ingest_seconds.labels(it.way).observe(time.monotonic() - it.queued_at)

    def _write_uploads(self, uploads: list[tuple[PartIn, bytes]]) -> None:
        """Checked uploads into the run format: each file fsynced, each directory once."""
        def write(upload: tuple[PartIn, bytes]) -> Path:
            it, body = upload
            return write_part_file(self.directories[it.job], it.rank, it.part, body,
                                   sync_dir=False)

        paths = list(self._writers.map(write, uploads) if self._writers else map(write, uploads))
        for directory in {p.parent for p in paths}:
            sync_directory(directory)
        for it, _ in uploads:
            it.body = None  # the bytes are on disk now; do not hold them

    # ---- analysis and states -----------------------------------------------------------------

    def _analysis_loop(self) -> None:
        while True:
            item = self._analysis.get()
            if item is None:
                return
            try:
                if isinstance(item, Window):
                    with self._count_lock:
                        current = item.run == self._run_count.get(item.job, 0)
                        self._analysing = item.job if current else None
                    if current:   # (else a window of a run replaced since it was queued)
                        self._analyse(item)
                else:
                    # only if still the job's state: a stall decided on the tick thread
                    # meanwhile is newer than a `running` queued here before it
                    job, state = item
                    self._state_changed(job, state, current=True)
            except Closed:   # (the stop killed its process: not stored, redone at the start)
                log.info("job %s window %d not analysed: the monitor stops; the next start "
                         "analyses it", item.job, item.idx)
            except Exception:
                log.exception("monitor analysis step failed")
            finally:
                if isinstance(item, Window):
                    with self._count_lock:
                        _decrement(self._windows_in_flight, item.job)
                        self._analysing = None
                self._count(-1)

    def _analyse(self, window: Window) -> None:
        lease = window.lease
        if lease is None or self.leases.lease(window.job) != lease:
            return   # the job's lease moved on: its holder analyses this window's steps
        row, refused = self.analyser.analyse(window)
        for source, problem in refused:
            # a watched part whose rows turned out bad (its footer was fine): the window was
            # analysed without it
            self.reject("bad_part", source, problem)
        try:
            alert_rows, log_rows, _ = self.alerts.on_window(window.job, row)
        except Exception as exc:   # noqa: BLE001 - the window is stored all the same
            # (the rules decide from the stored windows again at the next window; a window
            # dropped here was never analysed again, not even after a restart)
            log.error("job %s window %d: alert rules not applied (%s: %s); the window is "
                      "stored", window.job, window.idx, type(exc).__name__, str(exc)[:200])
            alert_rows, log_rows = [], []
        if not self._store_window(row, alert_rows, log_rows, lease):
            log.warning("job %s window %d: not stored, the job's lease was taken by another "
                        "instance (which analyses it from the store)", window.job, window.idx)
            self._lost(window.job)
            return
        # its parts no longer count toward max_job_bytes (read again at the next part)
        self._windows_stored[window.job] = self._windows_stored.get(window.job, 0) + 1
        self.metrics.publish_window(row)
        self.metrics.publish_latency.observe(max(0.0, time.time() - window.closed_at))
        self._deliver(window.job, alert_rows, log_rows)

    def _store_window(self, row: WindowRow, alert_rows: list[Alert],
                      log_rows: list[AlertLogEntry], lease: Lease | None = None) -> bool:
        """Store an analysed window, waiting out a full disk (or a locked store) rather than
        dropping it: a window dropped while later ones were stored was never analysed again,
        not even after a restart (its steps lay below the last stored window's). False when
        the lease was lost (nothing stored: the new holder analyses these steps)."""
        delay = 0.5
        retried: tuple[type[Exception], ...] = (*self.store.transient_errors, OSError)
        while True:
            try:
                stored = self.store.add_window(row, alert_rows, log_rows, lease)
                if delay > 0.5:
                    log.warning("job %s window %d stored now", row.job, row.idx)
                return stored
            except retried as exc:
                self.metrics.store_errors.labels("window").inc()
                if delay == 0.5:
                    log.error("job %s window %d cannot be stored (%s); retrying until it can",
                              row.job, row.idx, exc)
                if self._stop.wait(delay):
                    return False   # stopping: the restart analyses this window again
                delay = min(delay * 2, 10.0)

    def _state_changed(self, job: str, state: str, current: bool = False) -> None:
        """Store a job's state change and the alert changes it causes (`current`: only if it
        is still the job's state: decided on the tick thread, a newer change may have come)."""
        with self._state_lock:
            if current and self.states.get(job) != state:
                return
            self._store_state(job, state)

    def _store_state(self, job: str, state: str) -> None:
        lease = self.leases.lease(job)
        if lease is None:
            self._unstored.pop(job, None)
            return   # the job's holder decides its states
        held = self._unstored.get(job)
        if held is None or held.state != state:   # (one refused before: written as decided)
            held = HeldState(state, self.alerts.on_state(job, state),
                             time.time() if state == "finished" else None)
        what = f"job {job}'s state"
        try:
            if state == "stalled":   # the dead-man: one transaction, its message sent at once
                stored = self.store_dead_man(job, state, held.changes, lease)
            else:
                alert_rows, log_rows, _ = held.changes
                stored = self.store.set_job_state(job, state, finished_at=held.finished_at,
                                                  lease=lease, alert_rows=alert_rows,
                                                  log_rows=log_rows)
                if stored:
                    self._deliver(job, alert_rows, log_rows)
        except Exception as exc:   # noqa: BLE001 - kept: written again at the next tick
            self._unstored[job] = held
            self.trouble.refused(what, exc, f" ({state})")
            return
        self._unstored.pop(job, None)
        self.trouble.stored(what)
        if not stored and state == "stalled":
            with self._lock:   # not stored (the lease moved on or ran out): decided again
                if self.states.get(job) == "stalled" and self.leases.holds(job):
                    self.states[job] = "running"   # by the next tick, under a live lease
                    self.metrics.set_state(job, "running")

    def _store_unstored(self) -> None:
        """Write again the job states whose write was refused (each tick); one superseded by
        a newer state of its job is dropped (that one is stored, or held, on its own)."""
        for job, held in list(self._unstored.items()):
            with self._state_lock:
                if self._unstored.get(job) is not held:
                    continue
                if self.states.get(job) != held.state:
                    del self._unstored[job]
                    continue
                self._store_state(job, held.state)

    def _deliver(self, job: str, changes: list[Alert], log_rows: list[AlertLogEntry]) -> None:
        """The messages of alert changes just stored leave from the outbox (written in the
        same transaction as the changes): wake its sender; the transitions are logged."""
        self.alerts.log_stored(log_rows)
        try:
            firing = len(self.store.alerts(job=job, status="firing"))
        except Exception:   # noqa: BLE001 - a gauge: set at the next change (the change is
            firing = None   # stored: not to be written again because this read failed)
        if firing is not None:
            self.metrics.open_alerts.labels(job).set(firing)
        self.metrics.count_alerts(changes)
        if changes:
            self.outbox.wake()

    def store_alerts(self, job: str, changes: Changes) -> None:
        """Store and send alert changes decided outside a window (the watchdog's: the fast
        detector, silent ranks)."""
        alert_rows, log_rows, _ = changes
        if not (alert_rows or log_rows):
            return
        lease = self.leases.lease(job)
        if lease is None:
            return   # the job's holder decides its alerts
        try:
            self.store.add_alert_changes(alert_rows, log_rows, lease=lease, job=job)
        except Exception:
            self.metrics.store_errors.labels("alerts").inc()
            raise
        self._deliver(job, alert_rows, log_rows)

    def store_dead_man(self, job: str, state: str | None, changes: Changes,
                       lease: Lease | None = None) -> bool:
        """Store a silence decided (the job's `stalled` state, or its silent ranks' alert
        changes) in one transaction whose messages are claimed here and posted at once on the
        outbox's urgent thread: no claim transaction, poll or other alerts' posts before it.
        False when not stored (the lease moved on, or ran out: fence)."""
        alert_rows, log_rows, _ = changes
        if state is None and not (alert_rows or log_rows):
            return True
        lease = lease or self.leases.lease(job)
        if lease is None:
            return False   # the job's holder decides its alerts
        try:
            claimed = self.store.add_dead_man(job, state, alert_rows, log_rows, lease,
                                              self.instance, self.config.alert_claim_s)
        except Exception:
            self.metrics.store_errors.labels("alerts").inc()
            raise
        if claimed is None:
            self._renew_first = True
            return False   # the lease moved on meanwhile (or ran out): its holder decides
        self.outbox.send_now(claimed)
        self._deliver(job, alert_rows, log_rows)
        return True

    def refresh_metrics(self) -> None:
        """/metrics for every job: the jobs other instances analyse are shown from the store
        (state, S and waste of the latest window, alerts firing), at most once a second."""
        if time.monotonic() - self._metrics_at < 1.0:
            return
        self._metrics_at = time.monotonic()
        for row in self.store.jobs():
            job = row.job
            if self.leases.holds(job):
                continue
            self.metrics.set_state(job, row.state)
            self.metrics.open_alerts.labels(job).set(row.open_alerts)
            if row.slowdown is not None:
                self.metrics.slowdown.labels(job).set(row.slowdown)
                self.metrics.waste.labels(job).set(1.0 - 1.0 / row.slowdown)
                self.metrics.window_failed.labels(job).set(0.0)
            elif row.window is not None:   # its latest window failed: no S is current
                self.metrics.clear_window(job)
                self.metrics.window_failed.labels(job).set(1.0)

    def _set_state(self, job: str, state: str) -> None:
        self.states[job] = state
        self.metrics.set_state(job, state)
        self._queue_analysis((job, state))

    def _tick_loop(self) -> None:
        sweep_s = min(SWEEP_EVERY_S, self.config.empty_job_expiry_s / 2)
        while True:
            # woken early by the ingest when a silence was deferred over parts in flight
            self._tick_wake.wait(self.tick_wait(time.time()))
            self._tick_wake.clear()
            if self._stop.is_set():
                return
            try:
                self.tick()
                self.publish_mark()
                if time.monotonic() - self._swept_at >= sweep_s:
                    self._swept_at = time.monotonic()
                    self.expire_empty_jobs()
            except Exception as exc:
                self._ticked_at = time.time()   # a failing tick is not retried in a loop
                # its traceback once, not at every tick while the cause lasts
                said = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                if said != self._tick_failed:   # (a storage error in one line; a bug's stack)
                    log.error("monitor tick failed (%s); said once while it fails so", said,
                              exc_info=not isinstance(exc, self.trouble.storage_errors))
                self._tick_failed = said
                continue
            if self._tick_failed is not None:
                log.warning("monitor ticks again")
                self._tick_failed = None

    def tick_wait(self, now: float) -> float:
        """Seconds the tick thread sleeps: tick_s, or less when a dead-man deadline comes
        first (a stall was alerted up to a tick after stall_after_s), none when one passed
        after the last tick's clock reading (while that tick ran: a rank's deadline a few ms
        before its job's, and the job's decided a whole tick_s late)."""
        after = now if self._ticked_at is None else min(now, self._ticked_at)
        deadline = self.silence_deadline(after)
        wait = self.config.tick_s
        if deadline is not None:
            # a hair past it: the tick's own clock reading must find the deadline passed
            wait = max(0.0, min(wait, deadline - now + 1e-3))
        due, poll = self._marks_due, self.config.tick_s / 10
        if due is not None and now <= due + self.config.tick_s:
            # a silence held back by another instance's mark: looked at again a tenth of a
            # tick after that mark is due again (then every tenth, while it is late by less
            # than a tick: its tick is under way); a mark later than that is looked at every
            # tick (its instance is stuck; after lease_s it is left out)
            wait = min(wait, max(0.0, due - now) + poll)
        return wait

    def silence_deadline(self, now: float) -> float | None:
        """The first moment after `now` at which a running job held here has sent nothing for
        stall_after_s (it stalls), or one of its ranks has (it may be silent); None if none."""
        limit, out = self.config.stall_after_s, None
        with self._lock:
            for job, tr in self.trackers.items():
                if not isinstance(tr, JobTracker) or tr.last_arrival is None or \
                        self.states.get(job, "running") != "running":
                    continue
                # the job's stall, then its quietest rank's silence (tick and check_silence
                # decide what they mean: a job that closed, a rank not behind the others)
                first = tr.last_arrival
                if tr.first_arrival is not None and not tr.closed_marker:
                    heard, unheard = tr.heard_expected()
                    # (the ranks never heard from share one silence: -1 stands for them)
                    for rank in heard + ([-1] if unheard else []):
                        last = tr.quiet_since(rank) or first
                        if last + limit > now:
                            first = min(first, last)
                at = first + limit
                if at > now and (out is None or at < out):
                    out = at
        return out

    def tick(self, now: float | None = None) -> None:
        """Close windows whose missing parts were given up on; move jobs between states. The
        windows closed are queued for analysis whatever fails after they were closed (their
        rows are in no tracker any more: a write failing later in the tick lost them)."""
        windows: list = []
        try:
            self._tick(time.time() if now is None else now, windows)
        finally:
            for w in windows:
                self._queue_analysis(w)

    def _tick(self, now: float, windows: list) -> None:
        began = time.monotonic()
        cfg = self.config
        with self._count_lock:
            self._tick_mark = self._settled
        self._marks_due = None   # (set again by this tick's decisions held back by marks)
        if self.leases.overdue() or (self._renew_first and self.store.shared):
            # the heartbeat is late (this process was paused: SIGSTOP, a VM pause, a long GC):
            # its leases may have run out and their jobs been taken while it slept, and it
            # decided their silences from what it saw before the pause (the fence refused
            # the writes, but the state, /metrics and the log said `stalled`). Renewed first,
            # what was taken is dropped; undecided this tick when the store cannot say.
            # (after a silence the fence refused, too: decided again under the lease as it
            # is, not refused again at every tick until the heartbeat came)
            self._renew_first = False
            try:
                self.leases.beat()
            except Exception as exc:   # noqa: BLE001 - the database away: the next tick
                if not self._renew_failed:   # (once, not every tick while it is away)
                    log.warning("tick: leases not renewed (%s); no silence decided until "
                                "they are", str(exc).splitlines()[0] if str(exc)
                                else type(exc).__name__)
                self._renew_failed = True
                self._ticked_at = now
                return
            self._renew_failed = False
        self._store_unstored()   # what earlier ticks decided and could not store
        # the other instances' marks before their parts: a part they stored after this read
        # is followed below, one stored before the mark they wrote is in the store already
        # A mark not written for lease_s is left out: its instance's tick is stuck (a long
        # rebuild, a lock), and waiting for it held every silence of every job here for good
        # A mark further than lease_s ahead of this clock is left out too: its instance's clock
        # runs ahead, and its oldest part in flight (a killed one's, never stored) held every
        # silence here for as long as that clock was ahead (the clocks must agree: README)
        wall = time.time()
        self._marks = [m for m in self.store.ingest_marks(self.instance)
                       if wall - self.config.lease_s <= m.as_of <= wall + self.config.lease_s] \
            if self.store.shared else []
        windows.extend(self._follow_store(now))
        now_stalled: list[str] = []
        with self._lock:
            lagging = self.watchdog.lagging()
            for job, tr in list(self.trackers.items()):
                if isinstance(tr, JobTracker):
                    # (a clock set back: silence counts from now) — from now as it is here:
                    # a part heard since the clock was read (while the store was followed)
                    # arrived after that reading, and moving it back stalled its job early
                    tr.clamp_arrivals(now + (time.monotonic() - began))
                windows.extend(tr.close_ready(now))
                quiet = now - (tr.last_arrival or now)
                state = self.states.get(job, "running")
                if tr.closed_marker and quiet >= cfg.close_grace_s and self._ingest.empty():
                    new = "finished"
                elif quiet >= cfg.finish_after_s:
                    new = "finished"
                elif quiet >= cfg.stall_after_s:
                    new = "stalled"
                    here = state == "running" and (lagging or self.in_flight(
                        job, since=tr.last_arrival))
                    if here or (state == "running" and not self.settled_elsewhere(
                            (tr.last_arrival or now) + cfg.stall_after_s)):
                        # behind on its own ingest, the monitor cannot tell a silent job from
                        # parts still queued (seen: a small job stalled behind a 1,024-rank
                        # one's parts); with a part of it in flight (written just before the
                        # deadline), here or at another instance, decided again once that
                        # part is stored or refused (another's: at the next ticks, which a
                        # batch landing here need not wake)
                        new = "running"
                        if here:
                            self.defer_silence()
                else:
                    new = "running"
                if new == state:
                    if state == "stalled":
                        # a stalled job holds no pending steps: one rebuilt stalled (kill -9
                        # while its partial window waited, its state stored at once, the
                        # dead-man) had them cut by no transition, and waited for
                        # finish_after_s (an hour) to be analysed
                        w = tr.close_partial(state, now)
                        if w is not None:
                            windows.append(w)
                    continue
                if new in ("stalled", "finished"):
                    w = tr.close_partial(new, now)
                    if w is not None:
                        windows.append(w)
                if new == "stalled":
                    # the dead-man: stored and sent from here at once, not behind windows on
                    # the analysis queue (its partial window's included: a state rule's alert
                    # is no window's to change, alerts.on_state)
                    self.states[job] = new
                    self.metrics.set_state(job, new)
                    now_stalled.append(job)
                    continue
                self._set_state_after(windows, job, new)
                if new == "finished":
                    del self.trackers[job]  # its memory goes; a new part brings it back
        for job in now_stalled:
            self._state_changed(job, "stalled", current=True)
        self.watchdog.check_silence(now)
        self._ticked_at = now   # every deadline up to here decided or deferred

    def _set_state_after(self, windows: list, job: str, state: str) -> None:
        # the state change is queued after the windows it closed, so alerts see them first
        self.states[job] = state
        self.metrics.set_state(job, state)
        windows.append((job, state))


def _remove_empty_upload_dir(directory: Path) -> None:
    """An expired job's upload folder: its meta.json (and temp files) and the folder; a folder
    holding anything else is left as it is."""
    try:
        for path in directory.iterdir():
            if path.name == "meta.json" or (path.name.startswith("meta.json.")
                                            and path.name.endswith(".tmp")):
                path.unlink(missing_ok=True)
        directory.rmdir()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("expired job's folder %s not removed: %s", directory,
                    exc.strerror or exc)


ANOTHER_NAME = ("upload the run under another job name (this one's stored rows must be "
                "repaired or removed from the store by the monitor's operator)")


def _remedy(exc: Exception, stored_meta: str | None) -> str:
    """What brings a job set aside for `exc` back, as its uploads' 409 tells the client: its
    metadata announced again where the metadata (or the way its row names) is what cannot be
    used; else (its part or window rows) a new run, which drops them, where the stored run has
    a start clock to differ from; else another name. (Every 409 told the client to PUT its
    meta again, which for damaged part rows changed nothing: a client following it looped.)"""
    if isinstance(exc, InputError) and (exc.source.startswith("stored metadata of job")
                                        or exc.field == "way"):
        return "PUT its meta.json again (good metadata brings the job back)"
    if isinstance(exc, InputError) and exc.field == "directory":
        return ("the monitor's operator must start it with the uploads folder the job's "
                "parts went to; else " + ANOTHER_NAME)
    try:
        start = run_start(json.loads(stored_meta)) if stored_meta else None
    except ValueError:
        start = None
    if start is not None:
        return ("its stored parts or windows cannot be used, new metadata or not: PUT the "
                "meta.json of a new run (another extra.clock.start: the job starts again, its "
                "stored parts and windows dropped), or " + ANOTHER_NAME)
    return ANOTHER_NAME


def _unreadable(store: SQLStore, job: str) -> Exception:
    """Why a job's stored row does not read (for the quarantine's reason)."""
    try:
        row = store.job(job)
    except Exception as exc:   # noqa: BLE001 - the reason itself
        return exc
    what = "its name" if row is None else f"its state {row.state!r}"
    return InputError(f"job {job!r}", None, f"its stored row does not read ({what})")


def _arrival(stored: float, now: float) -> float:
    """A stored part's arrival time as silence may count from: no later than `now` (a row of
    time 1e300 or infinity, damaged or from a clock set back since, was its job's last arrival,
    and the job never stalled nor finished), and 0 when it is no time at all."""
    return min(stored, now) if math.isfinite(stored) and stored > 0 else 0.0


def _analysis_job(item: Window | tuple[str, str] | None) -> str | None:
    """The job an analysis item is of (its turn); None (stop) has a turn of its own."""
    if item is None:
        return None
    return item.job if isinstance(item, Window) else item[0]


def _decrement(counts: dict[Key, int], key: Key) -> None:
    """One less of `key` (gone at zero)."""
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


def _step_set(got: PartData | PartFile) -> str | None:
    """The step set a part is stored with (None: its file's steps were not read)."""
    if isinstance(got, PartData):
        return encode(distinct(got.columns["step"]))
    return encode(got.steps) if got.steps is not None else None


def _source(it: PartIn) -> str:
    """How an uploaded part is named in the errors its client gets."""
    return f"part {it.job}/{it.rank}/{it.part}"


def _settle(item: PartIn, result: str | None = None, exc: BaseException | None = None) -> None:
    if item.done is None or item.done.done():
        return
    if exc is not None:
        item.done.set_exception(exc)
    else:
        item.done.set_result(result)


def _check_stored_numbers(job: str, meta: JobMeta, last: WindowRow | None,
                          index: list[PartIndex]) -> None:
    """InputError (the job is quarantined) when its stored window or part rows hold numbers
    the ingest never stores: a last window of index 2**63-1 made every later window of the
    job fail to store (an OverflowError traceback each), a part row past the world size or
    MAX_STEP moved a rank's frontier where no part can follow."""
    source = f"stored rows of job {job!r}"
    if last is not None and not (0 <= last.idx < MAX_WINDOW and
                                 0 <= last.first_step <= last.last_step <= MAX_STEP):
        raise InputError(source, "windows", f"window {last.idx} of steps {last.first_step}.."
                         f"{last.last_step}; expected an index below {MAX_WINDOW} and steps "
                         f"0..{MAX_STEP}")
    for p in index:   # (one pass over the job's part rows at start, not on the ingest path)
        # (a part without rows is stored with last step -1: an acknowledged empty part once
        # set its job aside at the next start, and the job's later windows never came)
        if not (0 <= p.rank < meta.world_size and 0 <= p.part <= MAX_PART
                and -1 <= p.last_step <= MAX_STEP):
            raise InputError(source, "parts", f"rank {p.rank}, part {p.part}, last step "
                             f"{p.last_step}; expected a rank below {meta.world_size}, a part "
                             f"up to {MAX_PART} and steps up to {MAX_STEP}")


REFUSAL_LOG_BURST = 50      # refusals of one reason logged at once, line by line
REFUSAL_LOG_PER_S = 2.0     # and then this many a second
