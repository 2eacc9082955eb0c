"""Fair shares of the shard service's threads: one owner's many calls cannot hold another
job's for a whole batch (the commit thread) or after one big call (the control thread)."""

from __future__ import annotations

import asyncio
import threading

from adapt_clock import Clock
from stragglers.adapt.control import PacedThread
from stragglers.adapt.service import GroupCommitter
from stragglers.adapt.shards import ShardStore
from stragglers.serving import REQUEST_CLIENT


def test_a_batch_takes_calls_of_each_key_in_turns(tmp_path):
    # One owner with 256 connections in a loop had 256 calls in every batch; another job's
    # call waited behind all of them (fails before: the other job's call ran 257th).
    store = ShardStore(tmp_path / "s.db")
    commit = GroupCommitter(store, max_batch=256)
    ran: list[str] = []
    gate = threading.Event()

    async def main():
        # (calls without a key are the requesting client's, as the service's status reads)
        REQUEST_CLIENT.set("10.0.0.1")
        blocker = asyncio.ensure_future(commit.run(lambda: gate.wait(30)))
        await asyncio.sleep(0.05)   # (the writer is inside the blocker's batch now)
        hog = [asyncio.ensure_future(commit.run(lambda i=i: ran.append(f"hog{i}")))
               for i in range(256)]
        await asyncio.sleep(0)
        REQUEST_CLIENT.set("10.0.0.2")
        other = asyncio.ensure_future(commit.run(lambda: ran.append("other")))
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(blocker, *hog, other)

    try:
        asyncio.run(main())
    finally:
        commit.close()
        store.close()
    assert ran.index("other") <= 8, ran[:12]
    # each key's calls keep their order
    assert [x for x in ran if x != "other"] == [f"hog{i}" for i in range(256)]
    assert commit.calls == 258


def test_one_long_control_call_does_not_pause_other_tokens_for_three_times_as_long():
    # a 65,536-rank window (3-12 s of work) paused every control call 3x as long (9-36 s);
    # now every call waits at most max_pause_s, the rest is the long call's token's own
    # (fails before: the other token's call waited the whole 36 s)
    clock = Clock()
    paced = PacedThread(0.25, max_pause_s=0.05, clock=clock)
    order: list[str] = []

    def long_window():
        clock.now += 12.0     # 12 s of work: 36 s of pause owed
        order.append("window")

    def short(name: str):
        def call():
            clock.now += 0.001
            order.append(name)
        return call

    try:
        paced.submit(long_window, "big").result(10)
        paced.submit(short("big again"), "big")
        # real time passes, the fake clock moves only by max_pause_s: the other token's call
        # must run anyway, the big token's must still wait its own 36 s
        t = threading.Thread(target=lambda: (threading.Event().wait(0.1),
                                             setattr(clock, "now", clock.now + 0.06)))
        t.start()
        paced.submit(short("other"), "other").result(30)
        t.join()
        assert order == ["window", "other"], order
        clock.now += 36.0
        with paced._wake:
            paced._wake.notify_all()
        deadline = threading.Event()
        for _ in range(300):
            if len(order) == 3:
                break
            deadline.wait(0.1)
        assert order == ["window", "other", "big again"], order
    finally:
        paced.close()


def test_short_control_calls_still_pause_every_call_by_their_share():
    clock = Clock()
    paced = PacedThread(0.25, max_pause_s=1.0, clock=clock)
    starts: list[float] = []

    def call():
        starts.append(clock.now)
        clock.now += 0.01    # a 10 ms call: 30 ms of pause before any next one
    try:
        paced.submit(call, "a").result(10)
        fut = paced.submit(call, "b")
        threading.Event().wait(0.2)
        assert not fut.done()     # (the fake clock has not moved: still paused)
        clock.now += 0.03
        with paced._wake:
            paced._wake.notify_all()
        fut.result(10)
        assert starts[1] - starts[0] >= 0.04 - 1e-9
    finally:
        paced.close()
