"""A key's turn is handed on when its item's work finishes, not when the item is taken (issue
34): taken, a key went to the back at once, so a job whose window arrived while another job's
long analysis ran waited behind that job's next window too, and a second taker could run a
key's next item beside the one still being worked on (its items out of order)."""

from __future__ import annotations

import queue
import threading

from stragglers.monitor.turns import Turns


def test_a_key_arriving_during_anothers_work_is_served_next():
    q: Turns[tuple[str, int]] = Turns(lambda item: item[0])
    q.put(("a", 0))
    q.put(("a", 1))
    assert q.get() == ("a", 0)
    q.put(("b", 0))   # arrives while a's first item is worked on: a has had its turn
    assert q.get() == ("b", 0)   # (the next get finishes a's item)
    assert q.get() == ("a", 1)
    assert q.qsize() == 0


def test_done_hands_the_turn_on_and_a_keys_items_are_never_worked_on_at_once():
    q: Turns[tuple[str, int]] = Turns(lambda item: item[0])
    for i in range(3):
        q.put(("a", i))
    q.put(("b", 0))
    taken, release, order = threading.Event(), threading.Event(), []

    def worker() -> None:
        item = q.get()
        order.append(item)
        taken.set()
        release.wait(timeout=30)   # a long analysis
        q.done()

    t = threading.Thread(target=worker)
    t.start()
    assert taken.wait(timeout=30)
    assert order == [("a", 0)]
    # another taker meanwhile: b's item, then nothing (a's next waits for a's first to finish)
    assert q.get_nowait() == ("b", 0)
    q.done()
    try:
        got = q.get_nowait()
    except queue.Empty:
        got = None
    assert got is None, f"{got} taken while ('a', 0) was still being worked on"
    assert q.qsize() == 2
    release.set()
    t.join(timeout=30)
    assert [q.get(), q.get()] == [("a", 1), ("a", 2)]
