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
import sys
import threading
import time

import watchfiles


def main(roots: list[str]) -> None:
    """Write the roots' event batches to stdout until stdin closes."""
    stop = threading.Event()

    def parent_gone() -> None:
        sys.stdin.buffer.read()   # (returns at EOF: the parent closed it, or is gone)
        stop.set()

    threading.Thread(target=parent_gone, daemon=True).start()
    out = sys.stdout.buffer
    try:
        for changes in watchfiles.watch(*roots, stop_event=stop, debounce=50, step=20,
                                        yield_on_timeout=True, rust_timeout=1000,
                                        raise_interrupt=False):
            batch = [[int(change), name] for change, name in changes]
            out.write(json.dumps([time.time(), batch]).encode() + b"\n")
            out.flush()
    except BrokenPipeError:
        pass


if __name__ == "__main__":
    main(sys.argv[1:])
