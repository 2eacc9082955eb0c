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
    the watch is to be made again (a folder added to a root). A watch made again is followed
    by a catch-up line, `[time, null]`, once built: the parent scans what changed before
    it was."""
    built[0] = time.monotonic()
    caught_up = first
    for changes in watchfiles.watch(*_folders(roots), recursive=False, stop_event=stop,
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
               and os.path.isdir(name) and not os.path.islink(name)
               for change, name in changes):
            return None   # (a new run folder: watched once the watch is made again)
    return 0


def _folders(roots: list[str]) -> list[str]:
    """Each root and each folder in it whose path is UTF-8 and that is no link (run folders
    lie at most one level down: their files are what is watched; a run reached through a
    link is watched where it lies, in a watched folder, or its files are refused)."""
    out = []
    for root in roots:
        out.append(root)
        with os.scandir(root) as entries:
            out.extend(e.path for e in entries
                       if utf8(e.path) and e.is_dir(follow_symlinks=False))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
