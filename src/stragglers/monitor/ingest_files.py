"""Way in #1: watch run directories (our run format) with watchfiles and queue each new part.

A watched directory is either a run directory itself (it holds meta.json or rank parts) or a
folder whose subdirectories are run directories, new ones included. A run's job name is its
directory's name. The watcher only names files; the monitor's ingest thread reads and checks
them. Directories are also rescanned now and then, for file systems that drop events.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from pathlib import Path

import watchfiles

from stragglers.errors import InputError
from stragglers.monitor.parts import JOB_NAME, parse_part_name
from stragglers.monitor.service import Monitor, PartIn
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
        self.jobs: dict[Path, str] = {}          # run directory -> job name
        self.waiting: dict[Path, set[Path]] = {}  # parts seen before their meta.json
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def start(self) -> "DirectoryWatcher":
        """Scan what is there now, then follow changes on a thread."""
        self.scan()
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
            if _is_run(root):
                out.append(root)
                continue
            try:
                out.extend(sorted(d for d in root.iterdir() if d.is_dir() and _is_run(d)))
            except OSError as exc:
                log.warning("cannot list %s: %s", root, exc)
        return out

    def scan(self) -> None:
        """Register every run and queue every part not yet known."""
        for run in self.run_dirs():
            self._meta_changed(run)
            try:
                names = [p for p in run.iterdir() if parse_part_name(p.name)]
            except OSError:
                continue
            for path in sorted(names):
                self._part_seen(path)

    def _rescan(self) -> None:
        while not self._stop.wait(self.rescan_s):
            try:
                self.scan()
            except Exception:
                log.exception("rescan failed")

    def _watch(self) -> None:
        try:
            for changes in watchfiles.watch(*self.roots, stop_event=self._stop,
                                            debounce=50, step=20, yield_on_timeout=True,
                                            rust_timeout=1000, raise_interrupt=False):
                for change, name in changes:
                    if change == watchfiles.Change.deleted:
                        continue
                    self._path_changed(Path(name))
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
            name = run.name if JOB_NAME.match(run.name) and ".." not in run.name else ""
            taken = set(self.jobs.values()) | set(self.monitor.directories)
            if not name or (name in taken and self.monitor.directories.get(name) != run):
                digest = hashlib.sha1(str(run).encode()).hexdigest()[:8]
                safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in run.name)[:100]
                name = f"{safe.lstrip('._-') or 'run'}-{digest}"
            self.jobs[run] = name
            return name

    def _meta_changed(self, run: Path) -> None:
        path = run / META_FILE
        if not path.exists():
            return
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            self.monitor.reject("bad_meta", str(path), f"not readable JSON ({exc})")
            return
        job = self._job_name(run)
        try:
            self.monitor.register_job(job, run, "files", raw)
        except InputError as exc:
            self.monitor.reject("bad_meta", str(path), str(exc))
            return
        with self._lock:
            waiting = self.waiting.pop(run, set())
        for p in sorted(waiting):
            self._part_seen(p)

    def _part_seen(self, path: Path) -> None:
        run = path.parent
        rank, part = parse_part_name(path.name)
        job = self.jobs.get(run)
        tracker = self.monitor.tracker(job) if job else None
        if tracker is None:
            with self._lock:
                self.waiting.setdefault(run, set()).add(path)
            return
        if tracker.knows(rank, part):
            return
        self.monitor.submit(PartIn(job, rank, part, "files", path=path))


def _is_run(d: Path) -> bool:
    try:
        return (d / META_FILE).exists() or any(parse_part_name(p.name) for p in d.iterdir())
    except OSError:
        return False
