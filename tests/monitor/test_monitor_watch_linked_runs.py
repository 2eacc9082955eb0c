"""The watch child watches the real folder of a run a root links to from deeper inside it
(runs/latest -> runs/archive/…/run, hV50 #5), and no other place a link leads to: nothing out
of the roots, no loop, nothing below a link. Real watch child, real inotify."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

from stragglers.monitor.watch_child import _folders


def test_only_links_the_ingest_follows_add_their_real_folder(tmp_path):
    root = tmp_path / "runs"
    deep = root / "archive" / "2026-12-07" / "run"
    deep.mkdir(parents=True)
    (root / "done").mkdir()
    outside = tmp_path / "elsewhere"
    (outside / "tree").mkdir(parents=True)
    (root / "latest").symlink_to(deep)                # in the root: its real folder watched
    (root / "again").symlink_to("archive/2026-12-07/run")   # (the same one, once)
    (root / "alias").symlink_to(root / "done")        # a folder watched already
    (root / "out").symlink_to(outside)                # out of the root: refused by the ingest
    (root / "slash").symlink_to("/")
    (root / "loop").symlink_to(".")                   # the folder it lies in: a loop
    (root / "up").symlink_to("..")
    (root / "dangling").symlink_to("nowhere")
    (root / "file").write_text("x")
    (root / "to-file").symlink_to(root / "file")
    assert sorted(_folders([str(root)])) == sorted(
        [str(root), str(root / "archive"), str(root / "done"), str(deep)])


def test_a_link_made_after_the_watch_is_built_is_watched_once_it_is_made_again(tmp_path):
    """runs/latest pointed at a new run deeper in the root while the child watches: its
    watch is made again (a catch-up line), and then the run's parts come as events."""
    root = tmp_path / "runs"
    deep = root / "archive" / "2026-12-08" / "run"
    deep.mkdir(parents=True)
    (root / "other").mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    child = subprocess.Popen([sys.executable, "-m", "stragglers.monitor.watch_child",
                              str(root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(json.loads(x)) for x in child.stdout],
                     daemon=True).start()
    try:
        lines.get(timeout=60)   # (its first batch: the watch is built; bounds stop hangs)
        (root / "latest").symlink_to("archive/2026-12-08/run")
        bound = time.monotonic() + 60   # (a bound against a hang: empty batches come each second)
        while lines.get(timeout=60)[1] is not None:   # (until the catch-up line: made again)
            assert time.monotonic() < bound, "the watch was not made again"
        part = deep / "rank0.part0.parquet"
        part.write_bytes(b"x")
        later = root / "other" / "rank0.part0.parquet"
        later.write_bytes(b"x")   # (its event comes after the first one's, if that is watched)
        seen: set[str] = set()
        while str(later) not in seen:
            _, changes = lines.get(timeout=60)
            seen |= {name for _, name in changes or []}
        assert str(part) in seen, sorted(seen)
    finally:
        child.stdin.close()
        child.wait(30)
