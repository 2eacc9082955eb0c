"""The watched roots' file events, from a child process (`python -m stragglers.monitor.watch_child
ROOT...`): one JSON line per batch on stdout, `[time, [[change, path], ...]]`, `time` the
wall clock when watchfiles handed the batch over (an empty batch every second); `[time, null]`
when events may have been missed (a watch made again): the parent scans the runs that changed.

Why a process: watchfiles builds its inotify watches in native code holding the
interpreter lock, ~95 µs a folder: a root of 30,000 folders held every thread of the service
(`/health`, uploads) for 2–3 s at start, and again whenever the watch was rebuilt. The child
ends when its stdin closes (the monitor stopped, or died: `kill -9` included).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import watchfiles

from stragglers.wording import printable, utf8


UNWATCHABLE = 3   # exit status: watchfiles cannot watch these roots now (a root gone, or
#                   not named in UTF-8)


# a watch of the folders is made again at most this often, and no sooner than the last one
# took to build (runs added one after another rebuilt it at each: 30,000 folders, ~3 s each)
REBUILD_S = 1.0


def main(roots: list[str]) -> None:
    """Write the roots' event batches to stdout until stdin closes."""
    from watchfiles._rust_notify import WatchfilesRustInternalError

    stop = threading.Event()

    def parent_gone() -> None:
        try:
            while os.read(0, 65536):   # (unbuffered: a buffered read held a lock that
                pass                   # the interpreter's shutdown then aborted on)
        except OSError:
            pass
        stop.set()

    threading.Thread(target=parent_gone, daemon=True).start()
    status: int | None = 0
    first, built = True, [0.0, 0.0]   # (when the last watch began, how long it took)
    try:
        while True:   # (tried once even if stdin is closed already: a root refused is said)
            if not first and stop.wait(max(REBUILD_S, built[1]) - (time.monotonic()
                                                                   - built[0])):
                break
            try:
                status = _follow(roots, first, stop, built)
                first = False
                if status is not None or stop.is_set():
                    break
            except WatchfilesRustInternalError as exc:
                # a name not in UTF-8 under a root ('Unable to decode path'): watchfiles
                # cannot name it (such names are left out of the folders watched, and one
                # created since fails the watch at its event): the watch is made again
                if "decode" not in str(exc):
                    raise
                first = False
    except BrokenPipeError:
        pass
    except (WatchfilesRustInternalError, OSError, UnicodeError) as exc:
        # (a root gone, or the OS's watch limit; a root itself not named in UTF-8 is refused
        # by watchfiles as UnicodeEncodeError)
        # (printable: a root not named in UTF-8 made this line's own encode raise)
        os.write(2, printable(f"stragglers monitor: cannot watch {', '.join(roots)}: "
                              f"{exc}").encode() + b"\n")
        status = UNWATCHABLE
    os._exit(status or 0)   # (no interpreter shutdown beside the daemon thread)


def _follow(roots: list[str], first: bool, stop: threading.Event, built: list[float]
            ) -> int | None:
    """Write the batches of one watch of each root and each folder in it (_folders), each
    on its own, not recursively: a recursive watch follows links to folders, and a link in
    a watched folder to a tree of 2,000 folders took 2,000 inotify watches (the user's limit
    is shared by all of its processes; a link to / failed the watch under /proc, every run's
    live watch lost), while the ingest refuses any file reached through a link out. Its
    status when the child is to end (UNWATCHABLE: a root removed; 0: stopped); None when
    the watch is to be made again (a folder added to a root, or a link there to a run folder
    not watched yet). A watch made again is followed by a catch-up line, `[time, null]`,
    once built: the parent scans what changed before it was."""
    built[0] = time.monotonic()
    caught_up = first
    folders = _folders(roots)
    watched = set(folders)
    for changes in watchfiles.watch(*folders, recursive=False, stop_event=stop,
                                    debounce=50, step=20, yield_on_timeout=True,
                                    rust_timeout=1000, raise_interrupt=False):
        if not caught_up:
            built[1] = time.monotonic() - built[0]
            os.write(1, json.dumps([time.time(), None]).encode() + b"\n")
            caught_up = True
        batch = [[int(change), name] for change, name in changes]
        os.write(1, json.dumps([time.time(), batch]).encode() + b"\n")
        if any(change == watchfiles.Change.deleted and name in roots
               for change, name in changes):
            # a root removed: its watch is gone with it, and one made again under its
            # name is not watched (runs written there were seen a rescan later)
            os.write(2, b"stragglers monitor: a watched folder was removed\n")
            return UNWATCHABLE
        if any(change == watchfiles.Change.added and os.path.dirname(name) in roots
               and _unwatched_folder(name, roots, watched) for change, name in changes):
            return None   # (a new run folder: watched once the watch is made again)
    return 0


def _folders(roots: list[str]) -> list[str]:
    """Each root, each folder in it that is no link, and the real folder of each link in it
    that the ingest follows (_linked_folder), once each, their paths UTF-8: run folders lie
    at most one level down, or where such a link leads (their files are what is watched: a
    run linked from deeper in its root, runs/latest -> runs/archive/2026-12-07/run, was seen
    a rescan later). No folder is watched through a link, nor anything below one."""
    out: dict[str, None] = {}
    for root in roots:
        out[root] = None
        with os.scandir(root) as entries:
            for e in entries:
                if not utf8(e.path):
                    continue
                if e.is_dir(follow_symlinks=False):
                    out[e.path] = None
                elif e.is_symlink():
                    real = _linked_folder(e.path, roots)
                    if real is not None:
                        out[real] = None
    return list(out)


def _unwatched_folder(name: str, roots: list[str], watched: set[str]) -> bool:
    """Whether `name`, new in a root, is a folder to watch that is not watched: a folder, or
    a link the ingest follows to one (runs/latest -> runs/archive/…/run) not watched yet."""
    if not os.path.islink(name):
        return os.path.isdir(name)
    real = _linked_folder(name, roots)
    return real is not None and real not in watched


def _linked_folder(link: str, roots: list[str]) -> str | None:
    """The real folder a link in a root leads to where the ingest follows it by that path
    (ingest_files.canonical): inside a root and not the folder the link lies in or one above
    it (a loop); None for any other link, or none. A link whose target names a place out of
    every root is not resolved at all (no lookup out there: a dead mount hangs it)."""
    try:
        target = os.readlink(link)
    except OSError:
        return None
    if not _inside(os.path.normpath(os.path.join(os.path.dirname(link), target)), roots):
        return None
    real = os.path.realpath(link)
    if not _inside(real, roots) or _inside(os.path.dirname(link), [real]) or not utf8(real) \
            or not os.path.isdir(real):
        return None
    return real


def _inside(path: str, roots: list[str]) -> bool:
    """Whether `path` is a root or lies in one."""
    return any(path == r or path.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


if __name__ == "__main__":
    main(sys.argv[1:])
