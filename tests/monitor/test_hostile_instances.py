"""Two instances on one PostgreSQL store (issue 34): the empty-job expiry sweep of one and a
part stored by another in the same moment leave no orphan part row and no part acknowledged
for a job that is gone. Interleavings are forced with row locks held by a second connection
(the blocked statement is seen waiting in pg_locks), never with sleeps."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from conftest import eventually
from pg_cluster import postgres_cluster, postgres_url  # noqa: F401 - fixtures
from stragglers.monitor.store import open_store

pytestmark = pytest.mark.slow


def waiting_on_a_lock(db) -> bool:
    """Whether another backend waits for a row lock now."""
    return bool(db.execute("SELECT 1 FROM pg_locks WHERE NOT granted").fetchall())


def in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:   # noqa: BLE001 - handed to the test
            out["error"] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def while_another_holds(url: str, statements: list[str], call, what: str):
    """`call()`'s result, run while another instance's transaction has run `statements` and not
    yet committed: started once they hold their row locks, and let go once `call` is seen
    waiting for them (or is done); (result, the other instance's connection)."""
    import psycopg

    other = psycopg.connect(url, autocommit=True)
    with other.transaction():
        for sql in statements:
            other.execute(sql)
        t, out = in_thread(call)
        watch = psycopg.connect(url, autocommit=True)
        eventually(lambda: waiting_on_a_lock(watch) or not t.is_alive(), what=what)
    t.join(60)
    assert "error" not in out, out
    return out["value"], other


def part_row(job):
    return (job, 0, 0, 10, 0, 4, 100, "http", "digest")


def test_a_part_stored_while_the_sweep_waits_keeps_its_job(postgres_url):
    store = open_store(postgres_url)
    try:
        store.register_job("j", "/data/j", "http", {"name": "j"}, now=0.0)
        # another instance's add_parts: the job's row locked, its part inserted, not committed
        swept, _ = while_another_holds(
            postgres_url,
            ["SELECT part_seq FROM jobs WHERE job = 'j' FOR UPDATE",
             "INSERT INTO parts (job, rank, part, records, first_step, last_step, bytes, way, "
             "ingested_at, digest, seq) VALUES ('j', 0, 0, 10, 0, 4, 100, 'http', 1.0, 'd', 1)"],
            lambda: store.expire_empty_jobs(before=10.0, way="http"),
            "the sweep waiting for the job's row")
        assert swept == [], "the sweep deleted a job whose part was just stored"
        assert store.job("j") is not None
        assert store.parts("j") and len(store.parts("j")) == 1
    finally:
        store.close()


def test_a_part_for_a_job_the_sweep_is_deleting_is_not_stored(postgres_url):
    store = open_store(postgres_url)
    try:
        store.register_job("j", "/data/j", "http", {"name": "j"}, now=0.0)
        # another instance's sweep: the job's row deleted, not committed yet
        stored, other = while_another_holds(
            postgres_url,
            ["DELETE FROM jobs WHERE job = 'j'", "DELETE FROM leases WHERE job = 'j'"],
            lambda: store.add_parts([part_row("j")]),
            "add_parts waiting for the job's row")
        assert stored == [None], "a part of a deleted job was taken as stored"
        orphans = other.execute("SELECT COUNT(*) FROM parts").fetchone()[0]
        assert orphans == 0, "an orphan part row of a deleted job"
    finally:
        store.close()


def test_a_part_another_instance_stored_at_a_taken_place_is_set_aside_by_the_holder(
        postgres_url, tmp_path):
    # the instance that does not analyse a job stores its parts without knowing the places its
    # ranks took: rank 1's part at the place of another rank was taken by the holder, and its
    # window analysed the intruder there and named the place's own rank missing
    import concurrent.futures as cf

    from monitor_jobs import parts_of, slow_job
    from stragglers.monitor.part_names import fingerprint
    from stragglers.monitor.service import Monitor, PartIn
    from stragglers.monitor.settings import MonitorConfig
    from stragglers.trace.runformat import table_bytes
    cfg = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, lease_s=2.0,
                        gap_wait_s=1.0, analysis_process=False)
    trace = slow_job(steps=15)
    del trace.meta.extra["layout"]
    by = {(r, p): cols for r, p, cols in parts_of(trace, 5)}
    at = {r: (int(c["dp_rank"][0]), int(c["stage"][0])) for (r, p), c in by.items() if p == 0}
    holder = {place: r for r, place in at.items()}[(1 - at[1][0], 1 - at[1][1])]
    owner = Monitor(open_store(postgres_url), cfg, data_dir=tmp_path, instance="A").start()
    other = None
    try:
        owner.register_job("j", tmp_path / "j", "http", trace.meta.to_dict())
        other = Monitor(open_store(postgres_url), cfg, data_dir=tmp_path, instance="B").start()
        assert owner.leases.holds("j") and not other.leases.holds("j")

        def put(m, rank, part, cols):
            done: cf.Future = cf.Future()
            body = table_bytes(cols)
            m.submit(PartIn("j", rank, part, "http", body=body, digest=fingerprint(body),
                            done=done))
            return done.result(60)

        for rank in at:
            assert put(owner, rank, 0, by[(rank, 0)]) == "stored"
        cols = by[(1, 1)]
        there = {**cols, "dp_rank": cols["dp_rank"] * 0 + at[holder][0],
                 "stage": cols["stage"] * 0 + at[holder][1]}
        assert put(other, 1, 1, there) == "stored"   # not checked for places there
        eventually(lambda: owner.trackers["j"].knows(1, 1), what="the owner following it")
        for rank, part in [(r, 1) for r in at if r != 1] + [(r, 2) for r in at]:
            assert put(owner, rank, part, by[(rank, part)]) == "stored", (rank, part)
        eventually(lambda: len(owner.store.windows("j")) == 3, what="3 windows")
        assert [w.error for w in owner.store.windows("j")] == [None] * 3
        assert [owner.store.window("j", i).missing_ranks for i in range(3)] == [[], [1], []]
        assert any("set aside when read back" in r["problem"] for r in owner.recent_rejects)
    finally:
        for m in (owner, other):
            if m is not None:
                m.stop()
                m.store.close()


@pytest.mark.parametrize("change", ["sizes", "new run"])
def test_a_part_checked_before_another_instance_changed_the_job_is_checked_again(
        postgres_url, tmp_path, change):
    # in-flight checks see this instance's parts alone: the holder took new metadata (a
    # world of 2 ranks; or a new run with it) while the other instance's part of rank 3,
    # checked against the world of 4, waited to be committed; committed after, it was stored
    # (acknowledged) where the job has no rank 3, and the holder set the whole job aside
    import concurrent.futures as cf

    from monitor_jobs import parts_of, slow_job
    from stragglers.monitor.part_names import fingerprint
    from stragglers.monitor.service import Monitor, PartIn
    from stragglers.monitor.settings import MonitorConfig
    from stragglers.trace.runformat import table_bytes
    cfg = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, lease_s=2.0,
                        analysis_process=False)
    trace = slow_job(steps=10, dp=2, pp=2)
    del trace.meta.extra["layout"]
    meta = trace.meta.to_dict()
    meta["extra"]["clock"] = {"start": [1.0] * 4}
    small = {**meta, "dp_size": 1, "world_size": 2}
    if change == "new run":
        small["extra"] = {**meta["extra"], "clock": {"start": [2.0] * 2}}
    by = {(r, p): cols for r, p, cols in parts_of(trace, 5)}
    owner = Monitor(open_store(postgres_url), cfg, data_dir=tmp_path, instance="A").start()
    other = None
    try:
        owner.register_job("j", tmp_path / "j", "http", meta)
        other = Monitor(open_store(postgres_url), cfg, data_dir=tmp_path, instance="B").start()
        assert owner.leases.holds("j") and not other.leases.holds("j")
        entered, release = threading.Event(), threading.Event()
        real_add = other.store.add_parts

        def held_add(*args, **kwargs):
            if not release.is_set():   # (its first commit only: held until the change)
                entered.set()
                release.wait(120)
            return real_add(*args, **kwargs)

        other.store.add_parts = held_add
        done: cf.Future = cf.Future()
        body = table_bytes(by[(3, 0)])
        other.submit(PartIn("j", 3, 0, "http", body=body, digest=fingerprint(body), done=done))
        assert entered.wait(120)
        owner.register_job("j", tmp_path / "j", "http", small)   # nothing in flight there
        release.set()
        try:
            got = done.result(120)
        except Exception as exc:   # noqa: BLE001 - refused: what the test wants
            got = exc
        assert got != "stored", "rank 3 acknowledged in a job of 2 ranks"
        assert not owner.store.has_part("j", 3, 0)
        assert "j" not in owner.quarantined and "j" not in other.quarantined
    finally:
        for m in (owner, other):
            if m is not None:
                m.stop()
                m.store.close()


@pytest.mark.parametrize("silence", ["job", "rank"])
def test_no_silence_is_decided_over_a_part_another_instance_holds(postgres_url, tmp_path,
                                                                  silence):
    # the holder decided a job's stall (or a rank_silent) from what it had followed, while a
    # part heard by the other instance before the deadline was still on its way to the store:
    # a false alert, taken back a tick later when the part was followed (and then judged from
    # its commit, not from when it was heard). The scene is laid in the past, every arrival
    # stamped where the test puts it (queued_at); the real tick threads decide.
    import concurrent.futures as cf

    from monitor_jobs import parts_of, slow_job
    from stragglers.monitor.part_names import fingerprint
    from stragglers.monitor.service import Monitor, PartIn
    from stragglers.monitor.settings import MonitorConfig
    from stragglers.trace.runformat import table_bytes
    stall = 600.0   # (lease_s: a mark not written for that long is left out; under load)
    cfg = MonitorConfig(window_steps=5, stall_after_s=stall, tick_s=0.05, lease_s=30.0,
                        analysis_process=False, change_detector=False)
    trace = slow_job(steps=10)
    by = {(r, p): cols for r, p, cols in parts_of(trace, 5)}
    ranks = sorted({r for r, _ in by})

    def silences(m):
        return [(a.rule, a.status) for a in m.store.alerts(job="j")
                if a.rule in ("stalled", "rank_silent")]

    owner = Monitor(open_store(postgres_url), cfg, data_dir=tmp_path, instance="A").start()
    other = None
    try:
        owner.register_job("j", tmp_path / "j", "http", trace.meta.to_dict())
        other = Monitor(open_store(postgres_url), cfg, data_dir=tmp_path, instance="B").start()
        assert owner.leases.holds("j") and not other.leases.holds("j")
        entered, release = threading.Event(), threading.Event()
        real_add = other.store.add_parts

        def held_add(*args, **kwargs):
            entered.set()
            release.wait(120)
            return real_add(*args, **kwargs)

        other.store.add_parts = held_add

        def put(m, rank, part, ago):
            done: cf.Future = cf.Future()
            body = table_bytes(by[(rank, part)])
            m.submit(PartIn("j", rank, part, "http", body=body, digest=fingerprint(body),
                            done=done, queued_at=time.monotonic() - ago))
            return done

        # rank 0's second part, heard by B 800 s ago (before every deadline below), held there
        held = put(other, 0, 1, 800.0)
        assert entered.wait(120)
        eventually(lambda: any(m.oldest is not None for m in owner.store.ingest_marks("A")),
                   what="B saying it holds a part")
        for rank in ranks:   # every rank's first part, heard 900 s ago: the job's deadline,
            assert put(owner, rank, 0, 900.0).result(60) == "stored"   # 300 s ago, passed
        if silence == "rank":   # the others' second parts, 350 s ago (the job not silent
            for rank in ranks[1:]:   # then: its deadline in 250 s): rank 0 behind them
                assert put(owner, rank, 1, 350.0).result(60) == "stored"
        landed = time.time()
        eventually(lambda: (owner._ticked_at or 0) > landed, what="a tick after they landed")
        eventually(lambda: (owner._ticked_at or 0) > landed + 0.01, what="another")
        assert owner.states["j"] == "running", "a stall decided over a part B holds"
        assert not silences(owner), "an alert decided over a part B holds"
        # (held for B's parts, the decision waits for the next ticks: a batch landing here
        # does not wake the tick for it, which every landing of a busy instance did)
        assert not owner._deferred
        release.set()
        assert held.result(60) == "stored"
        eventually(lambda: owner.trackers["j"].knows(0, 1), what="the holder following it")
        if silence == "job":
            # heard 800 s ago: silent since then, which the holder decides once B said so
            eventually(lambda: silences(owner) == [("stalled", "firing")],
                       what="the real stall, stored")
            assert owner.states["j"] == "stalled"
        else:
            followed = time.time()
            eventually(lambda: (owner._ticked_at or 0) > followed, what="a tick after")
            assert owner.states["j"] == "running"
            assert not silences(owner), "rank 0 was never silent"
    finally:
        for m in (owner, other):
            if m is not None:
                m.stop()
                m.store.close()


def test_an_ingest_mark_that_cannot_be_written_is_one_line_not_a_traceback_a_tick(
        postgres_url, tmp_path, caplog):
    # the store full (PostgreSQL's disk_full reads as ENOSPC): the mark written every tick
    # failed the tick loop with a traceback every tick_s
    import errno
    import logging

    from stragglers.monitor.service import Monitor
    from stragglers.monitor.settings import MonitorConfig
    cfg = MonitorConfig(stall_after_s=600, tick_s=0.02, lease_s=2.0, analysis_process=False)
    m = Monitor(open_store(postgres_url), cfg, data_dir=tmp_path, instance="A").start()
    try:
        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "the store (PostgreSQL) cannot be written: its disk "
                          "is full")
        caplog.set_level(logging.WARNING, logger="stragglers.monitor.service")
        real = m.store.set_ingest_mark
        m.store.set_ingest_mark = full
        since = time.time()
        eventually(lambda: (m._ticked_at or 0) > since + 0.1, what="ticks meanwhile")
        m.store.set_ingest_mark = real
        eventually(lambda: any("written again" in r.getMessage() for r in caplog.records),
                   what="the mark written again")
        said = [r for r in caplog.records if "ingest mark" in r.getMessage()]
        assert len(said) == 2, [r.getMessage() for r in said]
        assert not [r for r in caplog.records if r.exc_info], "a traceback in the log"
    finally:
        m.stop()
        m.store.close()


def test_a_job_set_aside_by_its_holder_comes_back_when_another_instance_takes_good_metadata(
        postgres_url, tmp_path):
    # the holder set the job aside (its stored metadata damaged) and kept its lease; good
    # metadata PUT at the other instance lifted nothing there: the parts that instance then
    # acknowledged were never analysed
    import concurrent.futures as cf

    import psycopg

    from monitor_jobs import parts_of, slow_job
    from stragglers.monitor.part_names import fingerprint
    from stragglers.monitor.service import Monitor, PartIn
    from stragglers.monitor.settings import MonitorConfig
    from stragglers.trace.runformat import table_bytes
    cfg = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, lease_s=2.0,
                        analysis_process=False)
    trace = slow_job(steps=10)
    owner = Monitor(open_store(postgres_url), cfg, data_dir=tmp_path, instance="A").start()
    other = None
    try:
        owner.register_job("j", tmp_path / "j", "http", trace.meta.to_dict())
        other = Monitor(open_store(postgres_url), cfg, data_dir=tmp_path, instance="B").start()
        assert owner.leases.holds("j") and not other.leases.holds("j")
        with psycopg.connect(postgres_url, autocommit=True) as db:
            db.execute("UPDATE jobs SET meta = '{\"bad\": 1}' WHERE job = 'j'")
        eventually(lambda: "j" in owner.quarantined, what="the holder setting it aside")
        other.register_job("j", tmp_path / "j", "http", trace.meta.to_dict())
        for rank, part, cols in parts_of(trace, 5):
            body, done = table_bytes(cols), cf.Future()
            other.submit(PartIn("j", rank, part, "http", body=body, digest=fingerprint(body),
                                done=done))
            assert done.result(60) == "stored"
        eventually(lambda: len(owner.store.windows("j")) == 2, what="both windows analysed")
        assert owner.leases.holds("j") and "j" not in owner.quarantined
        assert [w.error for w in owner.store.windows("j")] == [None, None]
    finally:
        for m in (owner, other):
            if m is not None:
                m.stop()
                m.store.close()


def stalls_beside_another_instance(url: str, tmp_path, lease_s: float, other_marks,
                                   release=lambda: None) -> None:
    """A job held by instance A, its parts submitted there, stalls (0.5 s of silence) while
    instance B writes its ingest marks through `other_marks(write)` (B's set_ingest_mark);
    `release` runs before the instances stop."""
    from monitor_jobs import slow_job
    from stragglers.monitor.service import Monitor, PartIn
    from stragglers.monitor.settings import MonitorConfig
    from stragglers.trace.runformat import rank_file_name, write_rank
    cfg = MonitorConfig(window_steps=5, stall_after_s=0.5, tick_s=0.05, lease_s=lease_s,
                        analysis_process=False, change_detector=False)
    trace = slow_job(steps=5)
    run = tmp_path / "runs" / "j"
    for rank in range(trace.meta.world_size):
        write_rank(run, rank, {k: v[trace.ops["rank"] == rank] for k, v in trace.ops.items()},
                   part=0)
    owner = Monitor(open_store(url), cfg, data_dir=tmp_path, instance="A").start()
    other = None
    try:
        owner.register_job("j", run, "files", trace.meta.to_dict())
        other = Monitor(open_store(url), cfg, data_dir=tmp_path, instance="B").start()
        other.store.set_ingest_mark = other_marks(other.store.set_ingest_mark)
        for rank in range(trace.meta.world_size):
            owner.submit(PartIn("j", rank, 0, "files", path=run / rank_file_name(rank, 0)))
        eventually(lambda: owner.store.job("j").state == "stalled", what="the stall")
    finally:
        release()
        for m in (owner, other):
            if m is not None:
                m.stop()
                m.store.close()


def test_an_instance_whose_mark_stops_holds_no_silence_past_a_lease(postgres_url, tmp_path):
    # another instance's tick stuck (its mark no longer written, its heartbeat going on):
    # the holder waited for its mark to pass every deadline, and no job stalled any more
    stuck = threading.Event()
    stalls_beside_another_instance(postgres_url, tmp_path, 1.0,
                                   lambda write: lambda *a, **k: stuck.wait(120), stuck.set)


def test_an_instance_whose_clock_runs_ahead_holds_no_silence(postgres_url, tmp_path):
    # another instance's clock an hour ahead, a part in flight there that it never stores (it
    # was killed with it, say): its mark said "as of an hour from now, a part heard long ago in
    # flight", fresh for an hour, and no job of the holder stalled meanwhile
    stalls_beside_another_instance(
        postgres_url, tmp_path, 30.0,
        lambda write: lambda instance, as_of, oldest: write(instance, as_of + 3600.0, 1.0))


@contextlib.contextmanager
def heartbeat_on_time(m):
    """`m`'s heartbeat counted as on time (no thread runs here to renew it, and under load the
    0.5 s lease passed before the call inside was done: an ingest then took its parts as
    heard now, past a lapse, and a tick renewed first); the store's lease is left as written."""
    lease_s, m.leases.lease_s = m.leases.lease_s, 3600.0
    try:
        yield
    finally:
        m.leases.lease_s = lease_s


def paused_holder(url: str, tmp_path):
    """Instance A holding job `j` (its parts heard 20 s ago, past its 10 s stall deadline) and
    paused before its tick decided it: no thread runs (the test calls what they call), and
    its lease (0.5 s) has run out in the store by the time this returns."""
    import psycopg

    from monitor_jobs import slow_job
    from stragglers.monitor.service import Monitor, PartIn
    from stragglers.monitor.settings import MonitorConfig
    from stragglers.trace.runformat import rank_file_name, write_rank
    cfg = MonitorConfig(window_steps=5, stall_after_s=10.0, tick_s=0.5, lease_s=0.5,
                        analysis_process=False, change_detector=False)
    trace = slow_job(steps=5)
    run = tmp_path / "runs" / "j"
    for rank in range(trace.meta.world_size):
        write_rank(run, rank, {k: v[trace.ops["rank"] == rank] for k, v in trace.ops.items()},
                   part=0)
    a = Monitor(open_store(url), cfg, data_dir=tmp_path, instance="A")
    a.leases.beat()
    a.register_job("j", run, "files", trace.meta.to_dict())
    with heartbeat_on_time(a):   # (stored before the pause, its heartbeat thread beating)
        a._ingest_batch([PartIn("j", r, 0, "files", path=run / rank_file_name(r, 0),
                                queued_at=time.monotonic() - 20.0)
                         for r in range(trace.meta.world_size)])
    assert a.leases.holds("j") and a.trackers["j"].last_arrival <= time.time() - 19.0
    with psycopg.connect(url, autocommit=True) as db:
        eventually(lambda: db.execute("SELECT expires_at < extract(epoch from now()) FROM "
                                      "leases WHERE job = 'j'").fetchone()[0],
                   what="A's lease running out")
    return a, cfg


def test_a_holder_paused_past_its_lease_decides_nothing_of_a_job_taken_meanwhile(
        postgres_url, tmp_path):
    # A paused (SIGSTOP, a VM pause) past its lease; B took the job. A woke and its tick came
    # first: it decided the job stalled from what it saw before the pause — the fence refused
    # the write, but its state, its /metrics and its log said `stalled` (and its alert
    # engine logged the alert firing) of a job another instance holds
    from stragglers.monitor.service import Monitor
    a, cfg = paused_holder(postgres_url, tmp_path)
    b = Monitor(open_store(postgres_url), cfg, data_dir=tmp_path, instance="B")
    try:
        b.leases.beat()
        assert b.leases.holds("j")
        a.tick()   # A wakes: its heartbeat is late, so it renews before it decides
        assert a.states.get("j") != "stalled", "A decided a stall of a job B holds"
        assert not a.leases.holds("j") and "j" not in a.trackers
        assert a.store.job("j").state == "running"
    finally:
        for m in (a, b):
            m.stop()
            m.store.close()


def test_a_silence_is_not_stored_under_a_lease_that_ran_out(postgres_url, tmp_path):
    # nobody took the job yet: the fence found the same owner and epoch and stored the
    # stall A decided from before its pause; a silence is decided from a clock, under a
    # lease that has not run out
    a, _ = paused_holder(postgres_url, tmp_path)
    try:
        lease = a.leases.lease("j")
        assert a.store.add_dead_man("j", "stalled", [], [], lease, "A", 30.0) is None
        assert a.store.job("j").state == "running"
        a.tick()   # renewed first (nobody took it): the stall is A's to decide, and stored
        assert a.leases.holds("j") and a.store.job("j").state == "stalled"
    finally:
        a.stop()
        a.store.close()


def test_a_silence_the_fence_refused_renews_the_leases_before_it_is_decided_again(
        postgres_url, tmp_path):
    # the pause came between the tick's look at its heartbeat and its write: the fence
    # refused the stall, and every tick decided it again (refused again, an alert logged
    # firing each time) until the heartbeat thread came round
    from stragglers.monitor.service import Monitor
    a, cfg = paused_holder(postgres_url, tmp_path)
    b = Monitor(open_store(postgres_url), cfg, data_dir=tmp_path, instance="B")
    try:
        b.leases.beat()
        assert b.leases.holds("j")
        with heartbeat_on_time(a):
            a.tick()   # (its heartbeat looks fresh: the stall decided, and refused)
        assert a.store.job("j").state == "running" and a.states.get("j") != "stalled"
        a.tick()
        assert not a.leases.holds("j") and "j" not in a.trackers
    finally:
        for m in (a, b):
            m.stop()
            m.store.close()


def test_a_part_heard_before_a_pause_counts_as_heard_when_the_instance_is_back(
        postgres_url, tmp_path):
    # A heard a part, then was paused past its lease: the others left its ingest mark out
    # (it is dead to them) and decided silences without the part; A woke and stored it as
    # heard before those deadlines — a stall decided over a part A then acknowledged (false,
    # taken back once followed). Now it counts as heard when A came back.
    import psycopg

    from monitor_jobs import slow_job
    from stragglers.monitor.service import Monitor, PartIn
    from stragglers.monitor.settings import MonitorConfig
    from stragglers.trace.runformat import rank_file_name, write_rank
    cfg = MonitorConfig(window_steps=5, stall_after_s=600.0, lease_s=0.5,
                        analysis_process=False, change_detector=False)
    trace = slow_job(steps=5)
    run = tmp_path / "runs" / "j"
    write_rank(run, 0, {k: v[trace.ops["rank"] == 0] for k, v in trace.ops.items()}, part=0)
    a = Monitor(open_store(postgres_url), cfg, data_dir=tmp_path, instance="A")
    try:
        a.leases.beat()
        a.register_job("j", run, "files", trace.meta.to_dict())
        heard = PartIn("j", 0, 0, "files", path=run / rank_file_name(0, 0),
                       queued_at=time.monotonic())
        with psycopg.connect(postgres_url, autocommit=True) as db:
            eventually(lambda: not db.execute(
                "SELECT 1 FROM instances WHERE id = 'A' AND expires_at > extract(epoch from "
                "now())").fetchall(), what="A's heartbeat running out")
        woke = time.time()
        a._ingest_batch([heard])
        (stored,) = a.store.part_index("j")
        assert stored.ingested_at >= woke, "stored as heard while it was dead to the others"
    finally:
        a.stop()
        a.store.close()


def test_leases_that_cannot_be_renewed_are_one_line_not_one_a_tick(postgres_url, tmp_path,
                                                                   caplog):
    # the store out of reach: every tick found the heartbeat late and tried to renew first
    import logging

    from stragglers.monitor.service import Monitor
    from stragglers.monitor.settings import MonitorConfig
    cfg = MonitorConfig(stall_after_s=600, tick_s=0.02, lease_s=0.3, analysis_process=False)
    m = Monitor(open_store(postgres_url), cfg, data_dir=tmp_path, instance="A").start()
    try:
        def away(*args, **kwargs):
            raise OSError("the store (PostgreSQL) cannot be reached")
        caplog.set_level(logging.WARNING, logger="stragglers.monitor")
        real = m.store.heartbeat
        m.store.heartbeat = away
        eventually(lambda: m.leases.overdue(), what="the heartbeat late")
        since, beat = time.time(), m.leases.last_beat
        eventually(lambda: (m._ticked_at or 0) > since + 0.2, what="ticks meanwhile")
        for what in ("leases not renewed", "heartbeat failed"):   # (the tick's, the thread's)
            said = [r for r in caplog.records if what in r.getMessage()]
            assert len(said) == 1, [r.getMessage() for r in said]
        m.store.heartbeat = real
        eventually(lambda: m.leases.last_beat > beat and not m.leases.overdue(),
                   what="renewed again")
    finally:
        m.stop()
        m.store.close()
