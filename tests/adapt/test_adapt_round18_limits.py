"""Round 17's leftover: a data set deleted and created again with another shard_size while a
lease read the old one's limits — the index pace must use the data set as it is. Real server on
loopback, real SQLite; the pace's clock and sleep are the test's (nothing timed)."""

from __future__ import annotations

import threading

import httpx

from adapt_clock import Clock
from conftest import eventually
from stragglers.adapt import service
from stragglers.adapt.service import EmbeddedServer, ServiceConfig

TOKEN = {"Authorization": "Bearer round18-limits-token-0123456789"}
SHARD = 8192   # over INLINE_INDICES: its leases are paced before their commit


def test_limits_read_across_a_delete_are_not_kept_for_the_data_set_created_again(
        tmp_path, monkeypatch):
    # (fails before: the read of the deleted data set's limits (shards of 64) ended after
    # the delete dropped them and was kept: the one created again with shards of 8,192 had
    # its leases paced as 64-sample ones, its second lease sent before its indices were
    # paid for — slept [] where the pace asks [1.0])
    config = ServiceConfig(refusal_delay_s=0.0, auth_failure_delay_s=0.0,
                           lease_indices_per_token_s=float(SHARD),
                           contended_max_turn_wait_s=1.0)
    server = EmbeddedServer(tmp_path / "s.db", durable=False, config=config).start()
    reading, go = threading.Event(), threading.Event()
    read = service._lease_limits

    def held_read(conn, name):   # (the reader's read of b's limits, held once it has them)
        limits = read(conn, name)
        if not reading.is_set():
            reading.set()
            go.wait(30)
        return limits
    monkeypatch.setattr(service, "_lease_limits", held_read)
    out: dict = {}
    try:
        with httpx.Client(base_url=server.url, timeout=60, headers=TOKEN) as c:
            def create(shard_size: int) -> int:
                assert c.post("/datasets", json={"name": "b", "num_samples": 4 * SHARD,
                                                 "shard_size": shard_size, "lease_s": 600}
                              ).status_code == 200
                return c.post("/datasets/b/join", json={"worker": "w"}).json()["fence"]
            old = create(64)
            t = threading.Thread(target=lambda: out.setdefault("r", c.post(
                "/datasets/b/lease", json={"worker": "w", "fence": old})))
            t.start()
            eventually(reading.is_set, timeout=30, interval=0.005,
                       what="the lease never read b's limits")
            assert c.request("DELETE", "/datasets/b", json={}).status_code == 200
            fence = create(SHARD)
            go.set()
            t.join(60)
            assert out["r"].status_code == 409 and out["r"].json()["kind"] == "Fenced", \
                out["r"].text
            pace = server.app.state.index_pace
            pace._clock, slept = Clock(), []

            async def sleep(s: float) -> None:
                slept.append(s)
            pace._sleep, pace._due = sleep, {}
            codes = [c.post("/datasets/b/lease", json={"worker": "w", "fence": fence}
                            ).status_code for _ in range(3)]
            # one second's burst (the first), one second's wait at most (the second, waited
            # before its commit), then 429: a shard of 8,192 is a second of this token's pace
            assert slept == [1.0], slept
            assert codes == [200, 200, 429], codes
    finally:
        go.set()
        server.stop()
