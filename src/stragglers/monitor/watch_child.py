"""The watched roots' file events, from a child process (`python -m stragglers.monitor.watch_child
ROOT...`): one JSON line per batch on stdout, `[time, [[change, path], ...]]`, `time` the
wall clock when watchfiles handed the batch over (an empty batch every second).

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

from stragglers.wording import printable


UNWATCHABLE = 3   # exit status: watchfiles cannot watch these roots now (a name not in
#                   UTF-8 under one, a root gone)


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
    status = 0
    try:
        for changes in watchfiles.watch(*roots, stop_event=stop, debounce=50, step=20,
                                        yield_on_timeout=True, rust_timeout=1000,
                                        raise_interrupt=False):
            batch = [[int(change), name] for change, name in changes]
            os.write(1, json.dumps([time.time(), batch]).encode() + b"\n")
            if any(change == watchfiles.Change.deleted and name in roots
                   for change, name in changes):
                # a root removed: its watch is gone with it, and one made again under its
                # name is not watched (runs written there were seen a rescan later)
                os.write(2, b"stragglers monitor: a watched folder was removed\n")
                status = UNWATCHABLE
                break
    except BrokenPipeError:
        pass
    except (WatchfilesRustInternalError, OSError, UnicodeError) as exc:
        # (one folder or file whose name is not UTF-8 anywhere under a root makes every
        # watch of it fail, at once and for as long as it is there; so does a root gone; a
        # root itself not named in UTF-8 is refused by watchfiles as UnicodeEncodeError)
        # (printable: a root not named in UTF-8 made this line's own encode raise)
        os.write(2, printable(f"stragglers monitor: cannot watch {', '.join(roots)}: "
                              f"{exc}").encode() + b"\n")
        status = UNWATCHABLE
    os._exit(status)   # (no interpreter shutdown beside the daemon thread)


if __name__ == "__main__":
    main(sys.argv[1:])
