"""Red team round ten (issue 34): both services against clock jumps, numbers at the edges of
their fields, restarts and races between the steps of one operation.

Each test is one defect class, marked xfail(strict=True) until its fix lands (then the mark goes):
a pass before the fix fails the suite, so each flips exactly when its defect is gone. Real
servers on loopback (the shard service on a thread of this process, as tests/adapt's hostile
tests start it; the monitor on a thread too, as round nine's monitor tests start it).
"""

from __future__ import annotations

import sys

import httpx

from conftest import REPO, eventually
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.runformat import table_bytes

sys.path.insert(0, str(REPO / "tests" / "monitor"))
from monitor_jobs import get, parts_of, serving_job, slow_job  # noqa: E402

TOKEN = "hostile-round10-token-0123456789"
MONITOR = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05)


def _windows_read_healthy(c, windows: int, most: float) -> None:
    """Job j's first `windows` windows analysed, none slower than `most`, no alert fired."""
    eventually(lambda: get(c, "/api/jobs/j?history=10")["windows_total"] >= windows,
               what=f"windows 0-{windows - 1}")
    job = get(c, "/api/jobs/j?history=10")
    slowdowns = [round(w["slowdown"], 3) for w in job["windows"]]
    assert max(slowdowns) < most, slowdowns
    assert not [a["rule"] for a in job["alerts"]], job["alerts"]


def test_a_rank_whose_clock_steps_back_between_parts_does_not_make_a_straggler(tmp_path):
    """A healthy 2x2 job (no slow worker: every window S ~1.007). From its part 1 on, rank 3's
    clock is an hour behind (an NTP step, a host's clock set back by hand; a hostile uploader
    the same): its step 5 starts 3,600 s before its step 4 did. Every part is stored 200 and
    every later window is analysed at S ~1.19, and `straggling` fires for a job with no
    straggler. A rank's steps going back in time is a contradiction the monitor holds both
    sides of (the rank's earlier part): refused (422 naming start_ts), or the windows not
    poisoned."""
    trace = slow_job(steps=20, slow=None)
    with serving_job(tmp_path / "mon.db", trace, TOKEN, MONITOR) as c:
        refused = 0
        for rank, n, cols in parts_of(trace, 5):
            if rank == 3 and n >= 1:
                cols = {**cols, "start_ts": cols["start_ts"] - 3600.0}
            r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols))
            assert r.status_code in (200, 422), r.text
            refused += r.status_code == 422
        if refused:
            return
        _windows_read_healthy(c, 4, 1.1)


OWNER = {"Authorization": "Bearer owner-round10-token-0123456789"}


def test_a_lease_request_replayed_across_a_restore_gets_no_new_shards(tmp_path):
    """Worker w leases 2 of 4 shards with request_id r1; its owner snapshots the data set
    (those 2 DOING) and restores that snapshot (a resume from a checkpoint while the worker's
    process goes on: the restore neither fences off incarnations nor keeps their request ids,
    and puts the 2 back at the queue's front). w leases again (r2: the same 2 shards), then
    r1 arrives again (a proxy's or a client library's replay of the earlier request): 200
    with shards 2 and 3, indices and all, leased to w's incarnation that never asked for
    them: orphans held until their lease runs out, a retry counted each (the issue-34 class,
    through the restore). The same request id is the same answer (the README): its old
    shards (`held: false`, no indices), or a refusal."""
    from stragglers.adapt.service import EmbeddedServer

    server = EmbeddedServer(tmp_path / "s.db").start()
    try:
        with httpx.Client(base_url=server.url, timeout=60, headers=OWNER) as c:
            r = c.post("/datasets", json={"name": "d", "num_samples": 8, "shard_size": 2})
            assert r.status_code == 200, r.text
            fence = c.post("/datasets/d/join", json={"worker": "w"}).json()["fence"]
            lease = {"worker": "w", "fence": fence, "count": 2, "request_id": "r1"}
            first = c.post("/datasets/d/lease", json=lease).json()
            assert [x["shard"] for x in first["leases"]] == [0, 1], first
            snap = c.get("/datasets/d/snapshot")
            assert snap.status_code == 200, snap.text
            r = c.post("/datasets/d/restore", content=snap.content,
                       headers={"Content-Type": "application/json"})
            assert r.status_code == 200, r.text
            r2 = c.post("/datasets/d/lease", json={**lease, "request_id": "r2"})
            assert r2.status_code == 200, r2.text
            again = c.post("/datasets/d/lease", json=lease)
            if again.status_code >= 400:
                return   # (refused: nothing leased)
            new = [(x["shard"], x["indices"]) for x in again.json()["leases"]
                   if x["indices"] and x["shard"] not in (0, 1)]   # (r2 holds 0 and 1)
            assert not new, f"r1 replayed after the restore leased {new}"
    finally:
        server.stop()


def test_a_report_of_a_batch_past_the_global_batch_moves_no_controller(tmp_path):
    """A job of 2 ranks, global_batch 8, policy nd. Rank 0 reports what it ran (4 samples in
    0.1 s a step); rank 1's agent (a bug counting tokens as samples, or a hostile one with
    the job's token) reports 1,000,000 samples in 0.1 s a step: more than the whole job's
    batch, a per-sample time no device has. Every report is 200, rank 0 is classed a
    `persistent` straggler (r 2.0), KILL_RESTART rank 0 and ADJUST_BS [0, 8] follow: the
    healthy rank restarted and left without samples. Refused (400 naming records[i][2]: at
    most global_batch), or no action on it."""
    from stragglers.adapt.service import EmbeddedServer

    server = EmbeddedServer(tmp_path / "s.db").start()
    try:
        with httpx.Client(base_url=server.url, timeout=60, headers=OWNER) as c:
            r = c.post("/jobs/j/control/config", json={
                "policy": "nd", "world_size": 2, "global_batch": 8, "window": 2, "lag_s": 0,
                "persistent_windows": 1, "total_steps": 1000})
            assert r.status_code == 200, r.text
            refused = []
            for step in range(12):
                for rank, batch in ((0, 4), (1, 1_000_000)):
                    r = c.post("/jobs/j/control/report", json={
                        "rank": rank, "records": [[step, 0.1, batch]], "incarnation": 0})
                    assert r.status_code in (200, 400), r.text
                    if r.status_code == 400:
                        refused.append(r.json()["field"])
            if refused:
                assert all("records" in str(f) for f in refused), refused
                return
            state = c.get("/jobs/j/control/state").json()
            kinds = [(a["kind"], a.get("rank"), a.get("batch_sizes")) for a in state["actions"]]
            assert state["kills"] == 0 and state["batch_sizes"][0] > 0, kinds
    finally:
        server.stop()


def test_start_times_in_float32_are_refused_or_read_without_harm(tmp_path):
    """A healthy 2x2 job whose uploader writes `start_ts` as float32 (a Parquet writer's
    default for a float32 tensor, or a hostile one) at Unix-epoch times: from 1.7e9 s on,
    float32 numbers are 128 s apart, so every op of a part starts at one of a few instants
    and the ops' order within a step is gone. Each part is stored 200 (any float width is
    taken as a float column) and the windows read S ~1.15 where the same job in float64
    reads ~1.006. Refused (422 naming start_ts: seconds need float64), or read without
    harm."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    trace = slow_job(steps=10, slow=None)
    with serving_job(tmp_path / "mon.db", trace, TOKEN, MONITOR) as c:
        for rank, n, cols in parts_of(trace, 5):
            table = pq.read_table(pa.BufferReader(table_bytes(
                {**cols, "start_ts": cols["start_ts"] + 1.7e9})))
            at = table.column_names.index("start_ts")
            table = table.set_column(at, "start_ts", pa.array(
                table["start_ts"].to_numpy().astype(np.float32)))
            sink = pa.BufferOutputStream()
            pq.write_table(table, sink)
            r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}",
                      content=sink.getvalue().to_pybytes())
            assert r.status_code in (200, 422), r.text
            if r.status_code == 422:
                assert "start_ts" in r.json()["error"], r.text
                return
        _windows_read_healthy(c, 2, 1.05)
