"""Way in #1: watch run directories (our run format) with watchfiles and queue each new part.

A watched directory is either a run directory itself (it holds meta.json or rank parts) or a
folder whose subdirectories are run directories, new ones included. A run's job name is its
directory's name. The watcher only names files; the monitor's ingest thread reads and checks
them. Directories are also rescanned now and then, for file systems that drop events.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import watchfiles

from stragglers.errors import InputError
from stragglers.monitor.jobmeta import read_meta_file, run_start
from stragglers.monitor.part_files import OUTSIDE, FileReaders, StuckRead
from stragglers.monitor.parts import MAX_PART, is_job_name, parse_part_name
from stragglers.monitor.service import JobFull, Monitor, PartIn
from stragglers.monitor.watch_child import UNWATCHABLE
from stragglers.trace.model import JobMeta
from stragglers.trace.runformat import META_FILE
from stragglers.wording import printable, utf8

log = logging.getLogger(__name__)
FIRST_BATCH_WAIT_S = 30.0   # the first scan waits at most this long for the watch to be built
# a run's scan (a stat of each part not taken yet) not done in this long is given up on as
# one whose files hang (a generous bound: a healthy file system answers a stat in µs to ms)
RUN_SCAN_TIMEOUT_S = 30.0
# a run folder whose path is not UTF-8 (b'run-\xff': a name from another system's tar) is
# refused once, naming the remedy: the store keeps a run's folder as text, which cannot hold
# it (its surrogate escape refused by hashlib, SQLite and JSON: a UnicodeEncodeError at every
# scan, and /api/stats a 500 while it was listed; red team round 9 F5)
NOT_UTF8 = ("its folder's path is not UTF-8 (each such byte shown as \\xNN): the monitor keeps "
            "a run's folder as text; rename it to a UTF-8 name to have the run followed")


def _followed_under(monitor: Monitor, root: Path) -> bool:
    """Whether the monitor's store holds a watched run at `root` or under it."""
    try:
        jobs = monitor.store.jobs()
    except Exception:   # noqa: BLE001 - unreadable now: the root is refused as unknown
        return False
    return any(j.way == "files" and (Path(j.directory) == root or root in
                                     Path(j.directory).parents) for j in jobs)


class DirectoryWatcher:
    """Feeds a Monitor from directories on disk."""

    def __init__(self, monitor: Monitor, roots: list[Path], rescan_s: float | None = None):
        self.monitor = monitor
        self.roots = [Path(r).resolve() for r in roots]
        for r in self.roots:
            if not r.is_dir():
                if _followed_under(monitor, r):
                    # a root this store followed runs in, gone now (removed, a mount not up
                    # yet): watched once it is back, as when it goes while serving; the
                    # restart refused to start, and its uploads and history were down too
                    log.warning("watched folder %s is not there (its runs are in the store); "
                                "serving, and following it once it is back", r)
                    continue
                raise InputError(r, None, "not a directory (expected a run directory or a "
                                 "folder of run directories to watch)")
        self._root_set = set(self.roots)
        self.rescan_s = monitor.config.rescan_s if rescan_s is None else rescan_s
        monitor.private_roots.update(str(r) for r in self.roots)
        monitor.watched_roots.extend(r for r in self.roots if r not in monitor.watched_roots)
        self.jobs: dict[Path, str] = {}          # run directory -> job name
        self.waiting: dict[Path, set[Path]] = {}  # parts seen before their meta.json
        self.refused: set[Path] = set()          # part names refused (said once)
        # parts that are links out of their watched folder → where they led (said once, until
        # the link changes)
        self.escaped: dict[Path, str] = {}
        # meta.json refused → (its file as it was, the problem, refused for what it holds)
        self.meta_refused: dict[Path, tuple[tuple | None, str, bool]] = {}
        # parts queued, or taken or refused, as the file was then (inode, size, mtime): a
        # rescan queues a part again only when its file changed or its ingest failed (it once
        # queued every part not stored: refused ones were re-read every rescan, and parts
        # behind a long backlog were queued again each time)
        self.submitted: dict[Path, tuple[int, ...]] = {}
        # subdirectories of a root found not to be runs, as they were then (inode, mtime):
        # not listed again until they change (a root with 100,000 empty folders was listed
        # whole every rescan, ~30% of a core at the default rescan_s)
        self.not_runs: dict[Path, dict[str, tuple[int, int]]] = {}   # root → name → (ino, mtime)
        # each run directory as its last scan began (inode, mtime, and its meta.json's inode,
        # size, mtime, ctime; none while an mtime is under 2 s old): the catch-up after the
        # watch of the folders is made again scans the runs that changed since (every run,
        # 1.3 ms each, at every rebuild: 2 s at 1,000 runs)
        self.run_marks: dict[Path, tuple[int, ...]] = {}
        # links to run directories: refused (out of the watched folders, loops) → why, and
        # aliases (a second name of a run followed by another) → the run (each said once)
        # what identifies a followed run beside its path (a rename keeps its job): job →
        # its directory's (device, inode); (device, inode) → job; run mark → job
        self.inodes: dict[str, tuple[int, int]] = {}
        self.by_inode: dict[tuple[int, int], str] = {}
        self.by_mark: dict[str, str] = {}
        self.marks: dict[str, str | None] = {}   # job → its run mark (None: not yet known)
        # real path → the job a version that followed links stored under a link to it
        self.linked: dict[Path, str] = {}
        self.links_refused: dict[Path, str] = {}
        self.aliases: dict[Path, Path] = {}
        self._stop = threading.Event()
        self._child: subprocess.Popen | None = None   # the watch_child process
        self._ready = threading.Event()   # the watch is built (its first batch came)
        self.watching = False   # a child's watch is up (it sent a batch) and runs
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        # each run's scan on a thread whose wait is bounded: a part whose stat hangs (a
        # hard-mounted NFS server gone) held the scan for good (the first one never ended:
        # `scanning` ever after, no rescan of any root); that run is left for a later scan
        self._scans = FileReaders(1, timeout_s=RUN_SCAN_TIMEOUT_S, name="stragglers-files-scan")

    def start(self) -> "DirectoryWatcher":
        """Follow changes on a thread, and scan what is there now on another (the service
        answers meanwhile: a first scan of 30,000 folders held it ~8 s; /health says
        `scanning` and the monitor is not idle until the scan is done)."""
        scan = self.monitor.first_scan()
        scan.__enter__()   # (before start returns: idle() is False from now on)
        self._first = scan
        for target, name in ((self._watch, "watch"), (self._rescan, "rescan")):
            t = threading.Thread(target=target, name=f"stragglers-files-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        """Stop following changes, promptly: what each thread waits on ends (a watch child
        that hung, blocked in the kernel on a dead mount, held the stop 10 s and stayed)."""
        self._stop.set()
        self._ready.set()
        self._scans.shutdown(wait=False)   # (a scan waiting on a run's stat that hangs ends)
        child = self._child
        if child is not None:
            # killed, not asked: it holds nothing to flush, and the watch thread's read of
            # its output ends with it (its stdin closed, it ended within a second, unless hung)
            with contextlib.suppress(OSError):
                child.kill()
        for t in self._threads:
            t.join(timeout=10)   # (a bound on a hang only: each ends once its wait does)

    # ---- discovery ---------------------------------------------------------------------------

    def run_dirs(self) -> list[Path]:
        """Every run directory under the roots now, each once, by its real path (two links
        to one run, or one run under two watched roots, were two jobs over the same files)."""
        out: dict[Path, list[Path]] = {}   # real path → the names it was found by
        for root in self.roots:
            if (root / META_FILE).exists():
                out.setdefault(root, []).append(root)
                continue
            try:
                runs = sorted(self._runs_in(root))
            except OSError as exc:
                log.warning("cannot list %s: %s", root, exc)
                continue
            # a root without meta.json is one run only when it holds parts and no runs: one
            # stray file named like a part at the top of a folder of runs hid every run in it
            for run in runs or ([root] if _is_run(root) else []):
                real = self.canonical(run)
                if real is not None:
                    out.setdefault(real, []).append(run)
        for real, names in out.items():
            # the real path is the name followed when found itself, else the first link
            kept = real if real in names else min(names)
            for run in names:
                self._alias(run, real if run != kept else None)
        return sorted(out)

    def canonical(self, run: Path) -> Path | None:
        """The run directory `run` is, by its real path; None (named once) when links take
        it out of every watched folder, or back to the folder it lies in or above (a loop)."""
        real = Path(os.path.realpath(run))
        if real == run:
            return real
        if not any(p in self._root_set for p in (real, *real.parents)):
            self._refuse_link(run, OUTSIDE)
            return None
        if run.parent.is_relative_to(real):
            self._refuse_link(run, "a link to the folder it lies in, or one above it (a loop); "
                              "not followed")
            return None
        with self._lock:
            self.links_refused.pop(run, None)
        return real

    def _refuse_link(self, run: Path, problem: str) -> None:
        with self._lock:
            said = self.links_refused.get(run) == problem
            self.links_refused[run] = problem
        if not said:
            self.monitor.reject("bad_run", printable(str(run)), problem)

    def _alias(self, run: Path, real: Path | None) -> None:
        """`run` leads to the run directory `real`, followed under its own name (said once,
        until that changes); None: `run` is the name it is followed by."""
        with self._lock:
            said = self.aliases.get(run) == real
            if real is None:
                self.aliases.pop(run, None)
            else:
                self.aliases[run] = real
        if real is not None and not said:
            self.monitor.reject("bad_run", printable(str(run)), f"the same run directory as "
                                f"{printable(str(real))}, "
                                "followed once, by its real path (a link or a second watched "
                                "folder made it a second job over the same files)")

    def _runs_in(self, root: Path) -> list[Path]:
        """The run directories among a root's subdirectories, listing only those that are
        new or changed since they were last found not to be runs. A folder's mtime changes
        when a name in it is added or removed, so one that gains a meta.json or a part is
        listed again; one whose mtime is under 2 s old is not trusted to have settled (file
        systems whose clock ticks coarsely)."""
        runs, seen = [], {}
        known = self.not_runs.get(root, {})
        limit = time.time_ns() - 2_000_000_000
        with os.scandir(root) as entries:   # (names as strings: Path objects were most of it)
            for e in entries:
                try:
                    if not e.is_dir():
                        continue
                    st = e.stat()
                except OSError:
                    continue
                key = (st.st_ino, st.st_mtime_ns)
                if known.get(e.name) == key:
                    seen[e.name] = key
                elif _is_run(Path(e.path)):
                    runs.append(Path(e.path))
                elif st.st_mtime_ns < limit:
                    seen[e.name] = key
        self.not_runs[root] = seen   # (folders gone are forgotten)
        return runs

    def scan(self, changed: bool = False) -> int:
        """Register every run and queue every part not yet known (a run that cannot be taken
        is refused and named; the others go on); with `changed`, only the runs whose directory
        changed since its last scan (a name added, removed or renamed in it, or its meta.json
        rewritten, in place too; a part rewritten in place is seen by the periodic rescans).
        How many runs it scanned."""
        runs = self.run_dirs()
        if changed:
            runs = [r for r in runs if (m := self._run_mark(r)) is None
                    or m != self.run_marks.get(r)]
        else:   # (runs gone are forgotten)
            kept = set(runs)
            self.run_marks = {r: m for r, m in self.run_marks.items() if r in kept}
        # (each run's on the bounded scan thread: one whose files hang, given up on after
        # RUN_SCAN_TIMEOUT_S, is left for a later scan while the others go on)
        self._scans.map(self._scan_one, runs)
        return len(runs)

    @staticmethod
    def _run_mark(run: Path) -> tuple[int, ...] | None:
        """A run directory's (inode, mtime) and its meta.json's (inode, size, mtime, ctime;
        zeros: none), None while either mtime is under 2 s old (file systems whose clock
        ticks coarsely) or the directory cannot be read. (meta.json rewritten in place — the
        same inode, no name added — leaves the directory's mtime as it was: the catch-up
        missed it until a full rescan.)"""
        try:
            st = os.stat(run)
        except OSError:
            return None
        try:
            meta = os.stat(run / META_FILE)
            of_meta = (meta.st_ino, meta.st_size, meta.st_mtime_ns, meta.st_ctime_ns)
        except OSError:
            of_meta = (0, 0, 0, 0)
        if max(st.st_mtime_ns, of_meta[2]) >= time.time_ns() - 2_000_000_000:
            return None
        return st.st_ino, st.st_mtime_ns, *of_meta

    def _scan_one(self, run: Path) -> None:
        if self._stop.is_set():   # (a stop during a long first scan waits for no more)
            return
        self._guarded(self._scan_run, run)

    def _scan_run(self, run: Path) -> None:
        mark = self._run_mark(run)   # (before its names are read: a change after is seen)
        if mark is None:
            self.run_marks.pop(run, None)
        else:
            self.run_marks[run] = mark
        self._meta_changed(run)
        try:
            names = [p for p in run.iterdir() if parse_part_name(p.name)]
        except OSError:
            return
        for path in sorted(names):
            self._part_seen(path)

    def _guarded(self, fn, path: Path) -> None:
        """fn(path); any failure is one refusal naming `path`, never the end of the watcher
        (a bad meta.json once stopped the watch thread, or the start itself)."""
        try:
            fn(path)
        except Exception as exc:   # noqa: BLE001
            self.monitor.reject("bad_run", printable(str(path)),
                                printable(f"{type(exc).__name__}: {str(exc)[:200]}"))

    def _rescan(self) -> None:
        # the first scan at once, beside the watch child's start (waiting for its watch
        # held a backlog's ingest ~1.5 s); all of it inside the first scan's `noticing`, so
        # every part it queues is handed over as noticed (events of the watch meanwhile
        # are queued once: `submitted`)
        try:
            ready = self._ready.is_set()
            try:
                self.learn_gone_runs()
            except Exception:   # noqa: BLE001 - the store failed: the scan goes on
                log.exception("the run marks of watched jobs could not be read")
            self.scan()
            if not ready:
                # a file written after the scan listed its folder and before the watch
                # was built would be seen only a rescan later: once built, a scan again
                # (cheap: what was queued is skipped), still inside the first scan
                self._ready.wait(FIRST_BATCH_WAIT_S)
                self.scan()
        except Exception:   # noqa: BLE001 - listing a root failed: the rescans try again
            log.exception("first scan of %s failed", ", ".join(map(str, self.roots)))
        finally:
            self._first.__exit__(None, None, None)
        while not self._stop.wait(self.rescan_s):
            try:
                self.scan()
            except Exception:
                log.exception("rescan failed")

    def _watch(self) -> None:
        """Follow the roots' file events, watched in a child process (watch_child: building
        the watch held the interpreter lock, and the whole service, 2–3 s per 30,000
        folders), started again when it ends (killed, say: until then the rescans find what
        changed); in this process where none can be started, or one ends before its first
        batch."""
        wait, said, first = 1.0, False, True
        while not self._stop.is_set():
            # (each later child's watch catches up once built: a scan)
            lines, status = self._follow_child(catch_up=not first)
            first = False
            if lines:
                wait = 1.0   # (it ran: the backoff is for children that never do)
            if self._stop.is_set():
                return
            if status == UNWATCHABLE:
                # (a root gone or not named in UTF-8: the rescans follow the runs meanwhile)
                if not said:
                    log.warning("%s cannot be watched (a root gone, or its name not "
                                "UTF-8?); rescans every %.0f s follow the runs, "
                                "the watch is tried again now and then",
                                ", ".join(map(str, self.roots)), self.rescan_s)
                said = True
            elif not lines and (status is None or status > 0):
                # (it could not run here: no interpreter to start, the package not found)
                log.warning("the file watcher's process did not start (status %s); watching "
                            "in this one", status)
                return self._watch_here()
            else:
                log.warning("the file watcher's process of %s ended; started again in %.0f s "
                            "(rescans meanwhile)", ", ".join(map(str, self.roots)), wait)
            if self._stop.wait(wait):
                return
            wait = min(2 * wait, 60.0)

    def _follow_child(self, catch_up: bool = False) -> tuple[int, int | None]:
        """Hand over the batches of one child process until it ends; how many it sent, and
        its exit status (None: it could not be started). With `catch_up` (a child started
        again), its watch built, the roots are scanned: what changed while none watched was
        seen only a rescan later."""
        # (the child imports this package as this process does: an embedding program may
        # have put it on sys.path itself)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            child = subprocess.Popen(
                [sys.executable, "-m", "stragglers.monitor.watch_child", *map(str, self.roots)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True, env=env)
        except OSError as exc:
            log.warning("cannot start the file watcher's process (%s)", exc.strerror)
            return 0, None
        self._child = child
        if self._stop.is_set():   # (stopped while it started: stop() found no child)
            self._end_child()
            return 0, child.returncode
        lines = 0
        try:
            assert child.stdout is not None
            previous = time.time()   # a batch holds the events since the previous one came
            for line in child.stdout:
                lines += 1
                self._ready.set()   # (its first batch: the watch is built)
                self.watching = True
                try:
                    at, changes = json.loads(line)
                    events = [] if changes is None else \
                        [(watchfiles.Change(int(c)), str(name)) for c, name in changes]
                except (ValueError, TypeError):
                    log.warning("file watcher's process: a line that does not read: %.80r",
                                line)
                    continue
                # (a catch-up line: the child made its watch of the folders again, events
                # may be missed while it did: the runs that changed; a child started again:
                # every run)
                if (catch_up and lines == 1) or changes is None:
                    try:
                        self.scan(changed=changes is None and not (catch_up and lines == 1))
                    except Exception:   # noqa: BLE001 - the rescans try again
                        log.exception("scan of %s failed", ", ".join(map(str, self.roots)))
                self._batch(previous, events)
                previous = float(at)
        finally:
            self.watching = False
            self._end_child()
            if child.returncode == UNWATCHABLE:
                self._ready.set()   # (the first scan waits no longer)
        return lines, child.returncode

    def _end_child(self) -> None:
        child = self._child
        if child is None:
            return
        if self._stop.is_set():
            with contextlib.suppress(OSError):
                child.kill()   # (a stop waits on no child: see stop)
        if child.stdin is not None and not child.stdin.closed:
            try:
                child.stdin.close()   # (it ends within a second: its stop event)
            except OSError:
                pass
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()

    def _watch_here(self) -> None:
        try:
            previous = time.time()
            for changes in watchfiles.watch(*self.roots, stop_event=self._stop,
                                            debounce=50, step=20, yield_on_timeout=True,
                                            rust_timeout=1000, raise_interrupt=False):
                self._ready.set()
                arrived = time.time()
                self._batch(previous, list(changes))
                previous = arrived
        except Exception:
            log.exception("watching %s failed; rescans continue every %.0f s",
                          ", ".join(map(str, self.roots)), self.rescan_s)
        finally:
            self._ready.set()   # (the first scan waits no longer)

    def _batch(self, previous: float, changes: list[tuple[watchfiles.Change, str]]) -> None:
        """One batch of file events, handed over as noticed since `previous` (a part written
        just before a job's dead-man deadline may be in it, not yet submitted: the silence
        is decided once the batch is handed over)."""
        with self.monitor.noticing(previous):
            for change, name in changes:
                if change == watchfiles.Change.deleted:
                    continue
                self._guarded(self._path_changed, Path(name))

    def _path_changed(self, path: Path) -> None:
        # (events name a file by the path it was seen under: a link to a run dir too)
        if path.name == META_FILE or parse_part_name(path.name):
            run = self.canonical(path.parent)
            if run is None:
                return
            if path.name == META_FILE:
                self._meta_changed(run)
            else:
                self._part_seen(run / path.name)
        elif path.is_dir() and _is_run(path):
            run = self.canonical(path)
            if run is not None:
                self._meta_changed(run)

    # ---- jobs and parts ----------------------------------------------------------------------

    def _job_name(self, run: Path) -> str:
        with self._lock:
            if run in self.jobs:
                return self.jobs[run]
            name = run.name if is_job_name(run.name) else ""
            taken = set(self.jobs.values()) | set(self.monitor.directories)
            if not name or (name in taken and self.monitor.directories.get(name) != run):
                # (os.fsencode: a name not in UTF-8, b'run-\xff', is a surrogate escape
                # that str.encode refuses: the run was refused at every scan, round 9 F5)
                digest = hashlib.sha1(os.fsencode(run)).hexdigest()[:8]
                # ASCII letters and digits only, no '..': the API takes no other job name (a
                # run named 'é' or 'a..b' was a job whose page and API answered 422)
                safe = "".join(c if (c.isascii() and c.isalnum()) or c in "._-" else "_"
                               for c in run.name)[:100]
                safe = re.sub(r"\.{2,}", ".", safe)
                name = f"{safe.lstrip('._-') or 'run'}-{digest}"
            self.jobs[run] = name
            return name

    def _escapes(self, path: Path) -> str | None:
        """The real path of `path` when links take it out of the watched folder it lies in
        (None when it stays inside): a run's file linked to /etc/... was read and stored."""
        real = os.path.realpath(path)
        # (by ancestors in a set, not root by root: 1,000 roots made each run's check ~1,000
        # comparisons, most of a full rescan's 6 s)
        roots = {p for p in path.parents if p in self._root_set} or self._root_set
        if any(p in roots for p in (Path(real), *Path(real).parents)):
            return None
        return real

    def _meta_changed(self, run: Path) -> None:
        path = run / META_FILE
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            return self._meta_refused(path, None, f"cannot be read ({exc.strerror})", False)
        seen = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        prior = self.meta_refused.get(path)
        if prior is not None and prior[0] == seen and prior[2]:
            return   # refused for what it holds, and unchanged since
        if self._escapes(path) is not None:
            # the target is not named: readers of /api/stats see refusals, and it lies
            # outside every folder the operator chose to show
            return self._meta_refused(path, seen, OUTSIDE, True)
        if not utf8(run):
            return self._meta_refused(path, seen, NOT_UTF8, True)
        try:
            # a regular file of bounded size, opened without blocking (a FIFO named meta.json
            # once blocked the watcher for good), read on the monitor's file readers (a
            # hanging one, on a hung NFS or FUSE mount, is left for a later scan)
            raw = next(self.monitor.file_readers.map(_read_meta, [(
                path, self.monitor.config.max_meta_bytes, self.monitor.part_root(run),
                self.monitor.config.max_world_size)]))
            if isinstance(raw, StuckRead):
                return
        except InputError as exc:
            return self._meta_refused(path, seen, exc.problem, True)
        except OSError as exc:
            return self._meta_refused(path, seen, f"cannot be read ({exc.strerror})", False)
        if not isinstance(raw, dict):
            return self._meta_refused(path, seen, "expected a JSON object", True)
        try:
            job = self._moved(run, raw) or self._job_name(run)
            self.monitor.register_job(job, run, "files", raw)
        except InputError as exc:
            # what the file holds (its source is the file), or a name taken / the monitor
            # full / a renamed run busy, which may change without the file: tried again,
            # said once
            return self._meta_refused(path, seen, str(exc), str(exc.source) == str(path))
        self._identify(job, run, raw)
        with self._lock:
            self.meta_refused.pop(path, None)
        with self._lock:
            waiting = self.waiting.pop(run, set())
        for p in sorted(waiting):
            self._part_seen(p)

    def _identify(self, job: str, run: Path, raw: dict) -> None:
        """Remember what identifies the job's run beside its path: its run mark (the
        recorder's start clock and run id) and its directory's inode (README, "Renamed
        runs")."""
        try:
            st = os.stat(run)
        except OSError:
            return
        mark = run_start(raw)
        with self._lock:
            self.inodes[job] = (st.st_dev, st.st_ino)
            self.by_inode[(st.st_dev, st.st_ino)] = job
            self.marks[job] = mark
            if mark is not None:
                self.by_mark.setdefault(mark, job)

    def _moved(self, run: Path, raw: dict) -> str | None:
        """The watched job whose run directory `run` is, renamed (None: a run not seen
        before, or one followed under this path): the job whose directory had its inode and
        its run mark, else the job with its run mark, whose directory is gone or another
        folder now. The job follows it (Monitor.move_job); a renamed run was a new job over
        the same parts."""
        try:
            st = os.stat(run)
        except OSError:
            return None
        mark = run_start(raw)
        with self._lock:
            linked = self.linked.pop(run, None) if run not in self.jobs else None
        stored = self.monitor.directories.get(linked) if linked is not None else None
        if linked is not None and stored is not None and os.path.realpath(stored) == str(run):
            return self._follow(linked, stored, run)
        with self._lock:
            # by its inode a job with the same mark, or none (inodes are reused: by its inode
            # only, a new run in a reused inode would be an old job's) — of two with its mark
            # (a copy), the one whose folder it is; else by its mark
            by_inode = self.by_inode.get((st.st_dev, st.st_ino))
            candidates = [by_inode if by_inode is not None and self.marks.get(by_inode) == mark
                          else None, self.by_mark.get(mark) if mark is not None else None]
            here = self.jobs.get(run)
            # the job followed here is this run still (a copy's job whose original went
            # stays itself); another job followed here before means two runs swapped names
            # (that job is found at its new name by its own mark or inode)
            same = here is not None and (self.marks.get(here) == mark if mark is not None
                                         else self.inodes.get(here) == (st.st_dev, st.st_ino))
        if same:
            return None
        for job in candidates:
            old = self.monitor.directories.get(job) if job is not None else None
            if job is None or job == here or old is None or old == run:
                continue
            try:
                was = os.stat(old)
            except (OSError, ValueError):   # (a damaged row's path: a NUL in it)
                was = None
            # the old directory still there as it was (or at all, its inode not seen): a
            # copy of the run, not a rename
            if was is not None and self.inodes.get(job, (was.st_dev, was.st_ino)) == \
                    (was.st_dev, was.st_ino):
                continue
            return self._follow(job, old, run)
        return None

    def _follow(self, job: str, old: Path, run: Path) -> str:
        """The job follows its run from `old` to `run` (Monitor.move_job); its name."""
        self.monitor.move_job(job, run)
        with self._lock:
            for path in [p for p, j in self.jobs.items() if j == job]:
                del self.jobs[path]
            self.jobs[run] = job
            for path in [p for p in self.submitted if p.parent == old]:
                del self.submitted[path]
        return job

    def learn_gone_runs(self) -> None:
        """The run marks of watched jobs whose directories are gone (renamed while the
        monitor was down: known by the mark only, the inode was not seen), before the first
        scan finds them under their new names."""
        followed = {str(d) for d in self.monitor.directories.values()}
        for job, directory in list(self.monitor.directories.items()):
            if not any(directory.is_relative_to(r) for r in self.roots):
                continue
            if os.path.isdir(directory):
                # a job stored by a version that followed links: its run by its real path
                # (unless a job follows that path itself), not a second job over its files
                real = os.path.realpath(directory)
                if real != str(directory) and real not in followed:
                    with self._lock:
                        self.linked.setdefault(Path(real), job)
                continue
            try:
                row = self.monitor.store.job(job)
            except Exception:   # noqa: BLE001 - a damaged row: that job is not followed
                continue        # (it stopped the first scan)
            mark = run_start(row.meta) if row is not None and row.way == "files" else None
            if mark is not None:
                with self._lock:
                    self.by_mark.setdefault(mark, job)

    def _meta_refused(self, path: Path, seen: tuple | None, problem: str, held: bool) -> None:
        """A run's meta.json refused: named once until its file or the problem changes (every
        rescan re-read and named each bad meta.json again: a line per run every rescan_s); one
        refused for what it holds (`held`) is not read again until its file changes."""
        with self._lock:
            prior = self.meta_refused.get(path)
            self.meta_refused[path] = (seen, problem, held)
        if prior is None or prior[:2] != (seen, problem):
            self.monitor.reject("bad_meta", printable(str(path)), problem)

    def _part_seen(self, path: Path) -> None:
        run = path.parent
        ids = parse_part_name(path.name)
        if ids is None:
            return
        rank, part = ids
        job = self.jobs.get(run)
        tracker = self.monitor.tracker(job) if job else None
        if job is None or tracker is None:
            with self._lock:
                self.waiting.setdefault(run, set()).add(path)
            return
        if tracker.knows(rank, part):
            return
        world = tracker.meta.world_size if isinstance(tracker.meta, JobMeta) else 0
        if rank >= world or part > MAX_PART:
            if path not in self.refused:
                self.refused.add(path)
                self.monitor.reject("bad_part", printable(str(path)),
                                    f"rank {rank}, part {part}: expected "
                                    f"a rank below the world size ({world}) "
                                    f"and a part number up to {MAX_PART}")
            return
        try:
            st = os.stat(path)
        except OSError:   # gone again (or never a file we may see): nothing to queue
            return
        real = self._escapes(path)
        if real is not None:
            with self._lock:
                said = self.escaped.get(path) == real
                self.escaped[path] = real
            if not said:
                self.monitor.reject("bad_part", printable(str(path)), OUTSIDE)
            return
        # (its link count too: a part refused as a hard link is taken once its other name goes)
        seen = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_nlink)
        with self._lock:
            self.escaped.pop(path, None)
            if self.submitted.get(path) == seen:
                return   # queued already, or taken or refused as it is now
            self.submitted[path] = seen
        done: Future = Future()
        done.add_done_callback(lambda f: self._settled(path, seen, f))
        self.monitor.submit(PartIn(job, rank, part, "files", path=path, done=done))

    def _settled(self, path: Path, seen: tuple[int, ...], done: Future) -> None:
        """A queued part is stored, a duplicate, or refused (named once, until its file
        changes); when its ingest failed otherwise (the store could not take it), the next
        scan queues it again."""
        exc = done.exception()
        if exc is None:
            return
        if isinstance(exc, InputError) and not isinstance(exc, StuckRead):
            if exc.field != "job":   # (an unknown job was named by the monitor already)
                # a part past its job's max_job_bytes is named once too (until its file
                # changes), and the run's other parts are still looked at
                reason = "job_full" if isinstance(exc, JobFull) else "bad_part"
                self.monitor.reject(reason, printable(str(path)), exc.named)
            return
        with self._lock:
            if self.submitted.get(path) == seen:
                del self.submitted[path]

def _read_meta(job: tuple[Path, int, str, int]) -> object:
    return read_meta_file(*job)


def _is_run(d: Path) -> bool:
    try:
        return (d / META_FILE).exists() or any(parse_part_name(p.name) for p in d.iterdir())
    except OSError:
        return False
