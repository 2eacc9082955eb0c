"""A shuffle thread's calls in turns by token (adapt/turns.py): one token's queue of slow
calls is not another token's wait. Real threads; the order is decided by events, not time."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from stragglers.adapt.turns import TakeTurns


def test_a_tokens_queued_calls_take_turns_with_another_tokens():
    """H's four calls come first (the first one holding the thread), V's one after them: V's
    runs second, not fourth (a FIFO thread ran all of H's first); a waiting call cancelled
    (its client gone) and one that raises pass the thread on."""
    pool, order, gate = ThreadPoolExecutor(1), [], threading.Event()

    def call(tag: str) -> str:
        if tag == "h1":
            gate.wait(30)
        order.append(tag)
        if tag == "h3":
            raise ValueError(tag)
        return tag

    async def calls():
        turns = TakeTurns(pool)
        h = [asyncio.create_task(turns.run("H", call, f"h{i}")) for i in (1, 2, 3, 4)]
        await asyncio.sleep(0)   # (each of H's at its first wait: h1 on the thread)
        v = asyncio.create_task(turns.run("V", call, "v1"))
        await asyncio.sleep(0)
        h[1].cancel()
        gate.set()
        assert await v == "v1"
        with pytest.raises(asyncio.CancelledError):
            await h[1]
        with pytest.raises(ValueError):
            await h[2]
        assert [await h[0], await h[3]] == ["h1", "h4"]

    try:
        asyncio.run(calls())
    finally:
        pool.shutdown()
    assert order == ["h1", "v1", "h3", "h4"]
