"""The watched roots' file events, from a child process (`python -m stragglers.monitor.watch_child
ROOT...`): one JSON line per batch on stdout, `[time, [[change, path], ...]]`, `time` the
wall clock when watchfiles handed the batch over (an empty batch every second); `[time, null]`
when events may have been missed (a watch made again): the parent scans the runs that changed.

Why a process: watchfiles builds its recursive inotify watch in native code holding the
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
    whole = True
    try:
        while True:   # (tried once even if stdin is closed already: a root refused is said)
            try:
                status = _follow(roots, whole, stop)
                if status is not None or stop.is_set():
                    break
            except WatchfilesRustInternalError as exc:
                # a name not in UTF-8 under a root ('Unable to decode path'): watchfiles
                # cannot name it, and its recursive watch failed at once for as long as it
                # was there (every other run of the root was seen a rescan later); now each
                # root and each folder in it is watched on its own, such names left out, and
                # the watch is made again when an event names one (one a second at most)
                if whole:
                    whole = False
                    continue
                if "decode" not in str(exc):
                    raise
                if stop.wait(1.0):
                    break
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


def _follow(roots: list[str], whole: bool, stop: threading.Event) -> int | None:
    """Write the batches of one watch: the roots' whole trees (`whole`), else each root and
    each folder in it whose path is UTF-8. Its status when the child is to end (UNWATCHABLE:
    a root removed; 0: stopped); None when a watch of the folders is to be made again (a
    folder added to a root). A watch of the folders is followed by a catch-up line,
    `[time, null]`, once built: the parent scans what changed before it was."""
    paths = roots if whole else _folders(roots)
    caught_up = whole
    for changes in watchfiles.watch(*paths, recursive=whole, stop_event=stop, debounce=50,
                                    step=20, yield_on_timeout=True, rust_timeout=1000,
                                    raise_interrupt=False):
        if not caught_up:
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
        if not whole and any(change == watchfiles.Change.added and os.path.dirname(name)
                             in roots and os.path.isdir(name) for change, name in changes):
            return None   # (a new run folder: watched once the watch is made again)
    return 0


def _folders(roots: list[str]) -> list[str]:
    """Each root and each folder in it whose path is UTF-8 (run folders lie at most one
    level down: their files are what is watched)."""
    out = []
    for root in roots:
        out.append(root)
        with os.scandir(root) as entries:
            out.extend(e.path for e in entries if utf8(e.path) and e.is_dir())
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
