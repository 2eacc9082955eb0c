"""part_files.FileReaders, the threads that read watched files: a read past its deadline is given
up on (StuckRead), its thread left behind and replaced up to max_stuck, its file not read again
while that read is stuck, and read again once it returned. Here a read blocks on an Event (the
real hanging file, a FUSE mount, is test_stuck_watched_file.py's); the deadlines are what is
tested, and a read that does not block finishes far inside them."""

from __future__ import annotations

import threading

from conftest import eventually
from stragglers.monitor.part_files import FileReaders, StuckRead

TIMEOUT_S = 2.0


def reader(release: threading.Event):
    """A read of (file, hangs): the file's name back, once `release` is set if it hangs."""
    def read(item: tuple[str, bool]) -> str:
        name, hangs = item
        if hangs:
            release.wait()
        return name
    return read


def test_a_hanging_read_is_given_up_on_and_the_others_are_read():
    release = threading.Event()
    readers = FileReaders(threads=1, timeout_s=TIMEOUT_S, max_stuck=2)
    try:
        read = reader(release)
        got = list(readers.map(read, [("a", True), ("b", False), ("c", False)]))
        assert isinstance(got[0], StuckRead) and got[0].source == "a", got
        assert got[1:] == ["b", "c"]   # (on the thread started in the stuck one's place)
        assert list(readers.stuck_reads()) == ["a"]
        # found again while its read is stuck: answered at once, not read (nor waited) again
        got = list(readers.map(read, [("a", False), ("d", False)]))
        assert isinstance(got[0], StuckRead) and got[1] == "d", got
        assert readers.given_up == 1
        release.set()   # the read returns: the file is read again
        eventually(lambda: not readers.stuck_reads(), 60, what="the stuck read back")
        assert list(readers.map(read, [("a", False)])) == ["a"]
    finally:
        release.set()
        readers.shutdown()


def test_at_most_max_stuck_threads_are_left_behind():
    release = threading.Event()
    readers = FileReaders(threads=1, timeout_s=TIMEOUT_S, max_stuck=2)
    try:
        read = reader(release)
        got = list(readers.map(read, [("a", True), ("b", True), ("c", False)]))
        assert all(isinstance(g, StuckRead) for g in got), got
        # two left behind, no third thread: the rest are left for later unread, at once
        assert "2 reads of watched files are stuck" in got[2].problem
        assert readers.given_up == 2 and sorted(readers.stuck_reads()) == ["a", "b"]
        got = list(readers.map(read, [("e", False)]))
        assert isinstance(got[0], StuckRead), got
        alive = [t for t in threading.enumerate() if t.name == readers.name]
        assert len(alive) == 2, alive   # (the two stuck ones)
        release.set()   # back: one reads again (the pool's one thread), the other ends
        eventually(lambda: not readers.stuck_reads(), 60, what="the stuck reads back")
        assert list(readers.map(read, [("a", False), ("e", False)])) == ["a", "e"]
        eventually(lambda: len([t for t in threading.enumerate()
                                if t.name == readers.name]) == 1, 60, what="one reader left")
    finally:
        release.set()
        readers.shutdown()


def test_a_read_asked_for_after_shutdown_is_not_begun():
    readers = FileReaders(threads=1, timeout_s=TIMEOUT_S, max_stuck=2)
    assert list(readers.map(reader(threading.Event()), [("a", False)])) == ["a"]
    readers.shutdown()
    got = list(readers.map(reader(threading.Event()), [("a", False)]))
    assert isinstance(got[0], StuckRead) and "shut down" in got[0].problem, got
