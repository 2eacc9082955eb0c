"""Way in #1: watch run directories (our run format) with watchfiles and queue each new part.

A watched directory is either a run directory itself (it holds meta.json or rank parts) or a
folder whose subdirectories are run directories, new ones included. A run's job name is its
directory's name. The watcher only names files; the monitor's ingest thread reads and checks
them. Directories are also rescanned now and then, for file systems that drop events.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import watchfiles

from stragglers.errors import InputError
from stragglers.monitor.jobmeta import read_meta_file
from stragglers.monitor.part_files import OUTSIDE
from stragglers.monitor.parts import MAX_PART, is_job_name, parse_part_name
from stragglers.monitor.service import JobFull, Monitor, PartIn
from stragglers.trace.model import JobMeta
from stragglers.trace.runformat import META_FILE

log = logging.getLogger(__name__)


class DirectoryWatcher:
    """Feeds a Monitor from directories on disk."""

    def __init__(self, monitor: Monitor, roots: list[Path], rescan_s: float | None = None):
        self.monitor = monitor
        self.roots = [Path(r).resolve() for r in roots]
        for r in self.roots:
            if not r.is_dir():
                raise InputError(r, None, "not a directory (expected a run directory or a "
                                 "folder of run directories to watch)")
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
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def start(self) -> "DirectoryWatcher":
        """Scan what is there now, then follow changes on a thread."""
        try:
            self.scan()
        except Exception:   # noqa: BLE001 - listing a root failed: the rescans try again
            log.exception("first scan of %s failed", ", ".join(map(str, self.roots)))
        for target, name in ((self._watch, "watch"), (self._rescan, "rescan")):
            t = threading.Thread(target=target, name=f"stragglers-files-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        """Stop following changes."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)

    # ---- discovery ---------------------------------------------------------------------------

    def run_dirs(self) -> list[Path]:
        """Every run directory under the roots now."""
        out = []
        for root in self.roots:
            if (root / META_FILE).exists():
                out.append(root)
                continue
            try:
                runs = sorted(self._runs_in(root))
            except OSError as exc:
                log.warning("cannot list %s: %s", root, exc)
                continue
            # a root without meta.json is one run only when it holds parts and no runs: one
            # stray file named like a part at the top of a folder of runs hid every run in it
            out.extend(runs or ([root] if _is_run(root) else []))
        return out

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

    def scan(self) -> None:
        """Register every run and queue every part not yet known (a run that cannot be taken
        is refused and named; the others go on)."""
        for run in self.run_dirs():
            self._guarded(self._scan_run, run)

    def _scan_run(self, run: Path) -> None:
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
            self.monitor.reject("bad_run", str(path), f"{type(exc).__name__}: {str(exc)[:200]}")

    def _rescan(self) -> None:
        while not self._stop.wait(self.rescan_s):
            try:
                self.scan()
            except Exception:
                log.exception("rescan failed")

    def _watch(self) -> None:
        try:
            previous = time.time()   # a batch holds the events since the previous one came
            for changes in watchfiles.watch(*self.roots, stop_event=self._stop,
                                            debounce=50, step=20, yield_on_timeout=True,
                                            rust_timeout=1000, raise_interrupt=False):
                arrived = time.time()
                # a part written just before a job's dead-man deadline may be in this batch,
                # not yet submitted: the silence is decided once the batch is handed over
                with self.monitor.noticing(previous):
                    for change, name in changes:
                        if change == watchfiles.Change.deleted:
                            continue
                        self._guarded(self._path_changed, Path(name))
                previous = arrived
        except Exception:
            log.exception("watching %s failed; rescans continue every %.0f s",
                          ", ".join(map(str, self.roots)), self.rescan_s)

    def _path_changed(self, path: Path) -> None:
        if path.name == META_FILE:
            self._meta_changed(path.parent)
        elif parse_part_name(path.name):
            self._part_seen(path)
        elif path.is_dir() and _is_run(path):
            self._meta_changed(path)

    # ---- jobs and parts ----------------------------------------------------------------------

    def _job_name(self, run: Path) -> str:
        with self._lock:
            if run in self.jobs:
                return self.jobs[run]
            name = run.name if is_job_name(run.name) else ""
            taken = set(self.jobs.values()) | set(self.monitor.directories)
            if not name or (name in taken and self.monitor.directories.get(name) != run):
                digest = hashlib.sha1(str(run).encode()).hexdigest()[:8]
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
        roots = [r for r in self.roots if path.is_relative_to(r)] or self.roots
        if any(Path(real).is_relative_to(r) for r in roots):
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
        try:
            # a regular file of bounded size, opened without blocking (a FIFO named meta.json
            # once blocked the watcher for good)
            raw = read_meta_file(path, self.monitor.config.max_meta_bytes,
                                 self.monitor.part_root(run))
        except InputError as exc:
            return self._meta_refused(path, seen, exc.problem, True)
        except OSError as exc:
            return self._meta_refused(path, seen, f"cannot be read ({exc.strerror})", False)
        if not isinstance(raw, dict):
            return self._meta_refused(path, seen, "expected a JSON object", True)
        job = self._job_name(run)
        try:
            self.monitor.register_job(job, run, "files", raw)
        except InputError as exc:
            # what the file holds (its source is the file), or a name taken / the monitor
            # full, which may change without the file: tried again, said once
            return self._meta_refused(path, seen, str(exc), str(exc.source) == str(path))
        with self._lock:
            self.meta_refused.pop(path, None)
        with self._lock:
            waiting = self.waiting.pop(run, set())
        for p in sorted(waiting):
            self._part_seen(p)

    def _meta_refused(self, path: Path, seen: tuple | None, problem: str, held: bool) -> None:
        """A run's meta.json refused: named once until its file or the problem changes (every
        rescan re-read and named each bad meta.json again: a line per run every rescan_s); one
        refused for what it holds (`held`) is not read again until its file changes."""
        with self._lock:
            prior = self.meta_refused.get(path)
            self.meta_refused[path] = (seen, problem, held)
        if prior is None or prior[:2] != (seen, problem):
            self.monitor.reject("bad_meta", str(path), problem)

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
                self.monitor.reject("bad_part", str(path), f"rank {rank}, part {part}: expected "
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
                self.monitor.reject("bad_part", str(path), OUTSIDE)
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
        if isinstance(exc, InputError):
            if exc.field != "job":   # (an unknown job was named by the monitor already)
                # a part past its job's max_job_bytes is named once too (until its file
                # changes), and the run's other parts are still looked at
                reason = "job_full" if isinstance(exc, JobFull) else "bad_part"
                self.monitor.reject(reason, str(path), exc.problem)
            return
        with self._lock:
            if self.submitted.get(path) == seen:
                del self.submitted[path]

def _is_run(d: Path) -> bool:
    try:
        return (d / META_FILE).exists() or any(parse_part_name(p.name) for p in d.iterdir())
    except OSError:
        return False
