"""A clock the adapt tests move by hand (a store's, a pace's `clock`): time passes only when a
test sets `now`; the big-shuffle pauses held on it."""

from __future__ import annotations

import asyncio
import threading


class Clock:
    """A clock the test moves: `now`, called."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


BIG = (1 << 20) + 1   # samples: a big shuffle (over 2**20), ~40 ms


def held_pauses(computing) -> tuple[Clock, threading.Event, threading.Event]:
    """A service's shuffle pacer (`app.state.shuffling`) on a stopped clock, its pauses held
    until the test sets `go`: (the clock, `pausing`: set when a pause begins, `go`)."""
    clock = computing.clock = Clock()   # (a pause never passes on its own, however loaded)
    pausing, go = threading.Event(), threading.Event()

    async def held_pause(seconds: float) -> None:
        pausing.set()
        await asyncio.get_running_loop().run_in_executor(None, go.wait, 60)
    computing.sleep = held_pause
    return clock, pausing, go


def two_big_datasets(c, worker: str = "w") -> dict[str, int]:
    """Data sets a and b (BIG samples, 64-sample shards, seeds 1 and 2) created over client `c`
    and joined by `worker`: their fences."""
    fences = {}
    for name, seed in (("a", 1), ("b", 2)):
        assert c.post("/datasets", json={"name": name, "num_samples": BIG, "shard_size": 64,
                                         "seed": seed}).status_code == 200
        fences[name] = c.post(f"/datasets/{name}/join", json={"worker": worker}
                              ).json()["fence"]
    return fences
