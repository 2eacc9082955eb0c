"""Hostile cases of an eighth round: a job's first control record, disk full on one call."""

from __future__ import annotations

import httpx
import pytest

from stragglers.adapt.control import ControlPlane
from stragglers.adapt.controller import ControlConfig
from stragglers.adapt.service import EmbeddedServer
from stragglers.errors import InputError


def _plane(now: list, **config) -> ControlPlane:
    """A control plane with job "j" (2 ranks) configured at `now[0]` on a clock the test moves."""
    plane = ControlPlane()
    plane.configure("j", ControlConfig(policy="dd", world_size=2, global_batch=64, **config), None)
    _clocked(plane, now)
    return plane


def _clocked(plane: ControlPlane, now: list) -> None:
    monitor = plane._jobs["j"][1].monitor
    monitor.clock = lambda: now[0]
    monitor._started_at = now[0]


@pytest.mark.parametrize("records,field", [([(15_000, 0.5, 32)], "records[0][0]"),
                                           ([(2, 0.5, 32), (15_000, 0.5, 32)], "records[1][0]")])
def test_a_wild_step_in_a_jobs_first_record_is_refused(records, field):
    # (fails before: a job's first report had no bound: 15,000 steps ahead of the real ones
    # counted every later record of its rank up to it as resent, and actions waited for it)
    now = [1000.0]
    plane = _plane(now)
    with pytest.raises(InputError) as refused:
        plane.report("j", 0, records, "", 0, 0, None)
    assert refused.value.field == field and "implausible" in str(refused.value)
    assert plane._jobs["j"][1].monitor.latest_step == -1   # nothing of it applied
    for step in range(2, 8):
        for rank in (0, 1):
            plane.report("j", rank, [(step, 0.5, 32)], "", 0, 0, None)
    assert plane._jobs["j"][1].monitor.latest_step == 7


def test_honest_first_records_are_taken():
    now = [1000.0]
    # the job ran an hour before its first report reached the service: 7,200 steps of 0.5 s
    plane = _plane(now)
    now[0] += 3600.0
    plane.report("j", 0, [(7_000, 0.5, 32)], "", 0, 0, None)
    # a job resuming at its checkpoint's step, said in its config
    plane = _plane(now, start_step=50_000)
    plane.report("j", 0, [(50_001, 0.5, 32)], "", 0, 0, None)
    with pytest.raises(InputError):   # (and bounded from there)
        plane.report("j", 1, [(50_001 + 15_000, 0.5, 32)], "", 0, 0, None)
    # any step up to the steps the job said it runs
    plane = _plane(now, total_steps=100_000)
    plane.report("j", 0, [(60_000, 0.5, 32)], "", 0, 0, None)
    # a later incarnation, no start_step: it resumed at or before the step the last one reached
    plane = _plane(now)
    for step in range(2, 50):
        plane.report("j", 0, [(step * 100, 0.001, 32)], "", 0, 0, None)
    plane.configure("j", ControlConfig(policy="dd", world_size=2, global_batch=64,
                                       incarnation=1), None)
    _clocked(plane, now)
    plane.report("j", 1, [(4_850, 0.5, 32)], "", 1, 0, None)
    assert plane._jobs["j"][1].monitor.latest_step == 4_850


@pytest.mark.slow
def test_a_wild_first_step_over_http_is_a_400_naming_the_record(tmp_path):
    srv = EmbeddedServer(tmp_path / "s.db").start()
    h = {"Authorization": "Bearer job-token-0123456789"}
    try:
        with httpx.Client(base_url=srv.url, headers=h, timeout=60) as c:
            for job, extra in (("j", {}), ("k", {"start_step": 1 << 30})):
                r = c.post(f"/jobs/{job}/control/config", json={
                    "policy": "dd", "world_size": 2, "global_batch": 64, **extra})
                assert r.status_code == 200, r.text
            r = c.post("/jobs/j/control/report", json={"rank": 0, "incarnation": 0,
                                                       "records": [[1 << 30, 0.5, 32]]})
            assert r.status_code == 400, r.text
            assert r.json()["field"] == "records[0][0]" and "implausible" in r.json()["error"]
            r = c.post("/jobs/k/control/report", json={"rank": 0, "incarnation": 0,
                                                       "records": [[(1 << 30) + 5, 0.5, 32]]})
            assert r.status_code == 200, r.text
            r = c.post("/jobs/k/control/config", json={
                "policy": "dd", "world_size": 2, "global_batch": 64, "start_step": -1,
                "incarnation": 1})
            assert r.status_code == 400 and r.json()["field"] == "start_step", r.text
    finally:
        srv.stop()


PER_CALL = """
import asyncio, os, resource, signal, sys
from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.errors import DiskFull
from stragglers.adapt.service import GroupCommitter
from stragglers.adapt.shards import ShardStore
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit fails (EFBIG), no kill
db = sys.argv[1]
store = ShardStore(db)
store.create_dataset(DatasetConfig("small", 100, 10))
store.fold_wal()
# a small page cache: a big call's pages spill to the WAL inside its own savepoint
store._conn.execute("PRAGMA cache_size=-64")
biggest = max(os.stat(db + s).st_size for s in ("", "-wal") if os.path.exists(db + s))
resource.setrlimit(resource.RLIMIT_FSIZE, (biggest + (1 << 19), resource.RLIM_INFINITY))
commit = GroupCommitter(store)

def big():
    for i in range(400):   # ~1,000 shard rows each: megabytes, past the limit
        store.create_dataset(DatasetConfig(f"big{i}", 1 << 14, 16))

async def main():
    try:
        await commit.run(big, key="a")
        print("stored")
    except DiskFull as exc:
        print("DiskFull", "nothing of it was" in str(exc))
    await commit.run(lambda: store.create_dataset(DatasetConfig("after", 100, 10)), key="b")
    print("after")

asyncio.run(main())
commit.close()
# the same batch by hand: the refused call first, a small one after it
store._conn.execute("PRAGMA cache_size=-64")
try:
    store.run_batch([big, lambda: store.create_dataset(DatasetConfig("later", 100, 10))])
    print("batch-stored")
except Exception as exc:
    print("batch-refused")
rows = store._conn.execute("SELECT name FROM datasets ORDER BY name").fetchall()
print(",".join(r[0] for r in rows))
"""


@pytest.mark.slow
def test_a_call_refused_at_the_file_size_limit_is_507_and_no_call_after_it_is_stored(tmp_path):
    # a call of the group commit whose own writes hit the file-size limit is DiskFull (507)
    # with nothing of it stored, the next call is taken (the WAL folded before it), and no call
    # batched after it is stored while answered as failed
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", PER_CALL, str(tmp_path / "s.db")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # (fails before: SQLite rolled the whole transaction back for the refused call, its
    # savepoint gone: "no such savepoint" hid the error, the batch was 503, and a call after it
    # in the batch ran in autocommit: stored while answered as failed)
    assert out.stdout.split() == ["DiskFull", "True", "after", "batch-refused", "after,small"
                                  ], out.stdout


def test_a_call_refused_sqlite_full_ends_its_batch_507_and_nothing_of_the_batch_is_stored(
        tmp_path):
    # SQLite's "database or disk is full" (here its page limit: the SQLITE_FULL a full file
    # system gives) rolls the whole transaction back, not the call's savepoint. (Fails before:
    # "no such savepoint" hid it, and the call batched after it ran in autocommit: stored while
    # the batch was answered as failed.) Now every call of the batch is DiskFull, none stored.
    import asyncio

    from stragglers.adapt.dataset import DatasetConfig
    from stragglers.adapt.errors import DiskFull
    from stragglers.adapt.service import GroupCommitter
    from stragglers.adapt.shards import ShardStore

    store = ShardStore(tmp_path / "s.db")
    store.create_dataset(DatasetConfig("small", 100, 10))
    pages = store._conn.execute("PRAGMA page_count").fetchone()[0]
    store._conn.execute(f"PRAGMA max_page_count={pages + 8}")

    def big(tag: str) -> None:
        for i in range(50):
            store.create_dataset(DatasetConfig(f"{tag}{i}", 1 << 14, 16))

    with pytest.raises(Exception) as failed:
        store.run_batch([lambda: big("a"),
                         lambda: store.create_dataset(DatasetConfig("later", 100, 10))])
    assert getattr(failed.value, "sqlite_errorname", None) == "SQLITE_FULL"
    commit = GroupCommitter(store)
    try:
        async def main() -> Exception | None:
            try:
                await commit.run(lambda: big("b"), key="a")
            except DiskFull as exc:
                return exc
            return None

        refused = asyncio.run(main())
    finally:
        commit.close()
    assert isinstance(refused, DiskFull) and "nothing of it was" in str(refused)
    names = [r[0] for r in store._conn.execute("SELECT name FROM datasets ORDER BY name")]
    assert names == ["small"]
    assert store.status("small").dataset.name == "small"   # the store still answers
    store.close()


def test_the_step_records_controllers_keep_are_bounded_per_token_and_in_all():
    # (fails before: a controller kept 256 records of every rank whatever its window, ~100
    # bytes each, and ~960 bytes a rank before any; nothing counted them: one token's 16
    # controllers of 65,536 ranks could hold 28 GB, 1,024 empty ones 64 GB)
    from stragglers.adapt.errors import QuotaExceeded
    from stragglers.adapt.monitor import records_kept

    wide = {"policy": "bsp", "world_size": 1 << 16, "global_batch": 1 << 16}
    with pytest.raises(QuotaExceeded, match="max_control_records="):
        ControlPlane().configure("j", ControlConfig(**wide, window=64), "token")
    cost = 16 * (records_kept(5) + 10)   # a 16-rank controller of window 5
    plane = ControlPlane(max_records=5 * cost, max_records_per_token=2 * cost)
    job = {"policy": "bsp", "world_size": 16, "global_batch": 16}
    plane.configure("a1", ControlConfig(**job), "a")
    plane.configure("a2", ControlConfig(**job), "a")
    with pytest.raises(QuotaExceeded, match="max_control_records_per_token"):
        plane.configure("a3", ControlConfig(**job), "a")
    for name, token in (("b1", "b"), ("b2", "b"), ("c1", "c")):
        plane.configure(name, ControlConfig(**job), token)
    with pytest.raises(QuotaExceeded, match="max_control_records="):
        plane.configure("d1", ControlConfig(**job), "d")
    # a later incarnation counts what it adds beyond what its last one kept
    plane.configure("a1", ControlConfig(**job, incarnation=1), "a")
    with pytest.raises(QuotaExceeded):
        plane.configure("a1", ControlConfig(**{**job, "world_size": 17, "global_batch": 17},
                                            incarnation=2), "a")
    with pytest.raises(QuotaExceeded):   # a wider window keeps more
        plane.configure("a1", ControlConfig(**job, window=6, incarnation=2), "a")
    # a monitor keeps what its windows read, no more
    now = [1000.0]
    plane = _plane(now)
    now[0] += 150.0   # (the time 300 steps of 0.5 s take)
    plane.report("j", 0, [(2 + k, 0.5, 32) for k in range(300)], "", 0, 0, None)
    assert len(plane._jobs["j"][1].monitor.workers[0].records) == records_kept(5) < 256


def test_a_wrong_step_within_the_replay_span_does_not_hold_its_ranks_records():
    # (fails before: a record 15,000 steps ahead of its rank — within the bound and the
    # replay span — made the rank's next records count as a report sent again, ignored until
    # the rank reached it: no window of the job closed; now the kept records above a step the
    # rank never reported are dropped as wild)
    from stragglers.adapt.monitor import SpeedMonitor
    mon = SpeedMonitor(world_size=2, window=3, warmup_steps=0)
    for step in range(1, 6):
        for rank in (0, 1):
            mon.record(rank, step, 1.0, 8)
    mon.evaluate()
    mon.record(0, 15_000, 1.0, 8)
    assert mon.latest_step == 15_000
    for step in range(6, 9):
        for rank in (0, 1):
            mon.record(rank, step, 1.0, 8)
    assert [r.step for r in mon.workers[0].records][-4:] == [5, 6, 7, 8]
    assert mon.window_ready() and mon.latest_step == 8
    # a report sent again still changes nothing (its steps are kept ones)
    for step in range(6, 9):
        mon.record(0, step, 1.0, 8)
    assert mon.workers[0].since_eval == 3 and len(mon.workers[0].records) == 8
