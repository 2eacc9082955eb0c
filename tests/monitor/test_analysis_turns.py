"""The monitor's analysis queue serves jobs by turns (one job's backlog held every other job's)."""

from __future__ import annotations

import threading

from stragglers.monitor.turns import Turns


def test_a_keys_backlog_waits_behind_one_item_of_each_other_key():
    q: Turns[tuple[str, int]] = Turns(lambda item: item[0])
    for i in range(5):
        q.put(("a", i))
    q.put(("b", 0))
    q.put(("c", 0))
    q.put(("b", 1))
    got = [q.get() for _ in range(8)]
    assert got == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("b", 1), ("a", 2), ("a", 3),
                   ("a", 4)]
    assert q.qsize() == 0


def test_a_get_waits_for_a_put_from_another_thread():
    q: Turns[str] = Turns(lambda item: item)
    threading.Timer(0.05, q.put, args=("x",)).start()
    assert q.get() == "x"
