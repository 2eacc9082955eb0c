"""The recorder side: PartUploader never blocks, buffers through an outage, counts overflow."""

from __future__ import annotations

import io
import time

import httpx
import pyarrow.parquet as pq
import pytest

from monitor_jobs import get, parts_of, slow_job
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.record.upload import PartUploader
from stragglers.trace.columns import columns_to_table

from conftest import eventually, free_port

CFG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05)


def blob(cols) -> bytes:
    buf = io.BytesIO()
    pq.write_table(columns_to_table(cols), buf)
    return buf.getvalue()


def test_parts_submitted_while_the_monitor_is_down_are_delivered_when_it_comes_up(tmp_path):
    trace = slow_job(steps=20)
    parts = parts_of(trace, steps_per_part=2)          # 10 parts per rank
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    uploaders = {r: PartUploader(url, "tok", "job-u", r, max_buffer=6, backoff_s=0.05,
                                 max_backoff_s=0.5) for r in range(4)}
    uploaders[0].submit_meta(trace.meta.to_dict())
    for rank, part, cols in parts:                     # nobody listens: all of this must return
        uploaders[rank].submit(part, blob(cols))
    for up in uploaders.values():
        s = up.stats()
        assert s.submitted == 10 and s.dropped == 4 and s.pending == 6
        assert s.retries >= 1 and s.sent == 0
    server = MonitorServer(tmp_path / "m.db", port=port, token="tok", config=CFG).start()
    try:
        for up in uploaders.values():
            assert up.close(timeout=120)
            s = up.stats()
            assert s.sent == 6 and s.pending == 0 and s.rejected == 0
        kept = [(r, p, c) for r, p, c in parts if p >= 4]   # the oldest 4 per rank were dropped
        with httpx.Client(base_url=server.url, timeout=30) as c:
            stats = eventually(lambda: get(c, "/api/stats"), what="stats")
            assert stats["by_way"]["http"] == {"parts": len(kept),
                                               "records": sum(len(x["step"]) for _, _, x in kept)}
            job = get(c, "/api/jobs/job-u")
            assert job["upload_dropped"] == {str(r): 4 for r in range(4)}
            # parts 0-3 never come: after gap_wait the windows of steps 8.. still close
            assert job["windows"] == [] or job["windows"][0]["first_step"] >= 8
    finally:
        server.stop()


@pytest.mark.slow
def test_a_refusing_monitor_neither_blocks_nor_raises_and_refusals_are_counted(tmp_path):
    trace = slow_job(steps=4)
    server = MonitorServer(tmp_path / "m.db", port=0, token="right", config=CFG).start()
    try:
        up = PartUploader(server.url, "wrong", "job-r", 0, backoff_s=0.01)
        up.submit_meta(trace.meta.to_dict())
        for rank, part, cols in parts_of(trace, 2):
            if rank == 0:
                up.submit(part, blob(cols))
        assert up.close(timeout=60)
        s = up.stats()
        assert s.rejected == 2 and s.sent == 0 and "401" in s.last_error
        with httpx.Client(base_url=server.url) as c:
            assert get(c, "/api/jobs")["jobs"] == []
    finally:
        server.stop()


@pytest.mark.slow
def test_close_gives_up_after_its_timeout_when_nobody_answers():
    up = PartUploader(f"http://127.0.0.1:{free_port()}", None, "job", 0, backoff_s=0.05)
    up.submit(0, b"x" * 100)
    assert up.close(timeout=0.5) is False
    assert up.stats().pending == 1


def test_a_job_expired_before_its_first_part_is_announced_again_by_its_uploader(tmp_path):
    """A slow first step outlives `empty_job_expiry_s`: the part's 404 makes rank 0 send its
    meta.json again, and the part is stored instead of being retried against 404 for ever."""
    trace = slow_job(steps=4)
    rank0 = [(p, c) for r, p, c in parts_of(trace, steps_per_part=2) if r == 0]
    server = MonitorServer(tmp_path / "m.db", port=0, token="tok", config=CFG,
                           data_dir=tmp_path / "uploads").start()
    up = PartUploader(server.url, "tok", "job-late", 0, backoff_s=0.05, max_backoff_s=0.2)
    try:
        up.submit_meta(trace.meta.to_dict())
        assert up.drain(timeout=60)
        # the job has no part yet: a sweep past its expiry forgets it (clock passed in)
        assert server.monitor.expire_empty_jobs(time.time() + 10 * CFG.empty_job_expiry_s) \
            == ["job-late"]
        for part, cols in rank0:
            up.submit(part, blob(cols))
        assert up.close(timeout=120)
        s = up.stats()
        assert s.sent == len(rank0) and s.rejected == 0 and s.pending == 0
        with httpx.Client(base_url=server.url, timeout=30) as c:
            stats = eventually(lambda: get(c, "/api/stats"), what="stats")
            assert stats["by_job"]["job-late"]["parts"] == len(rank0)
    finally:
        server.stop()


def test_a_run_replaced_under_its_job_name_stops_uploading_and_the_new_run_keeps_its_windows(
        tmp_path):
    # two trainings under one job name (the recorder's default: the trace folder's name): the
    # second's metadata replaces the first; the first's later parts are refused 409
    # (superseded_run), its uploader sends nothing more, and none of it is stored as the
    # second run's
    a, b = slow_job(steps=10, seed=1), slow_job(steps=10, seed=2)
    mine = [cols for rank, _, cols in parts_of(a, 5) if rank == 0]   # rank 0's parts of run a
    server = MonitorServer(tmp_path / "m.db", port=0, token="tok", config=CFG).start()
    try:
        old = PartUploader(server.url, "tok", "train", 0, run="run-a", backoff_s=0.05)
        meta_a = a.meta.to_dict()
        meta_a["extra"].update(run="run-a", clock={"start": [1.0] * a.meta.world_size})
        old.submit_meta(meta_a)
        old.submit(0, blob(mine[0]))
        eventually(lambda: old.stats().sent == 1, what="run a's first part stored")
        new = PartUploader(server.url, "tok", "train", 0, run="run-b", backoff_s=0.05)
        meta_b = b.meta.to_dict()
        meta_b["extra"].update(run="run-b", clock={"start": [2.0] * b.meta.world_size})
        new.submit_meta(meta_b)
        assert new.drain(timeout=60)
        old.submit(1, blob(mine[1]))
        eventually(lambda: old.superseded, what="run a told it was replaced")
        old.submit(2, blob(mine[1]))        # dropped at once, nothing sent
        assert old.stats().sent == 1 and old.pending == 0 and old.stats().dropped >= 1
        # run b's own part is taken (its run is the job's now)
        new.submit(0, blob(next(c for r, _, c in parts_of(b, 5) if r == 0)))
        assert new.drain(timeout=60) and new.stats().sent == 1, new.stats()
        old.close(timeout=5)
        new.close(timeout=5)
    finally:
        server.stop()


@pytest.mark.parametrize("restart", [False, True], ids=["same-monitor", "after-a-restart"])
def test_a_replaced_run_announcing_itself_again_is_refused_and_the_new_runs_parts_stay(
        tmp_path, restart):
    # the replaced run's tokens were an instance's memory: after a restart (or at another
    # instance of a shared store) the old run's next meta.json (its end clock, a re-announce
    # after a 404) read as a newer run and reset the job, the new run's parts deleted
    a, b = slow_job(steps=10, seed=1), slow_job(steps=10, seed=2)
    metas = {}
    for name, trace, start in (("run-a", a, 1.0), ("run-b", b, 2.0)):
        metas[name] = trace.meta.to_dict()
        metas[name]["extra"].update(run=name, clock={"start": [start] * trace.meta.world_size})
    auth = {"Authorization": "Bearer tok"}
    part_b = blob(next(c for r, _, c in parts_of(b, 5) if r == 0))
    server = MonitorServer(tmp_path / "m.db", port=0, token="tok", config=CFG,
                           data_dir=tmp_path / "uploads").start()
    try:
        with httpx.Client(base_url=server.url, timeout=30, headers=auth) as c:
            assert c.put("/api/jobs/train/meta", json=metas["run-a"]).status_code == 200
            assert c.put("/api/jobs/train/meta", json=metas["run-b"]).status_code == 200
            done = c.put("/api/jobs/train/ranks/0/parts/0", content=part_b,
                         headers={"X-Stragglers-Run": "run-b"})
            assert done.status_code == 200, done.text
        if restart:
            server.stop()
            server = MonitorServer(tmp_path / "m.db", port=0, token="tok", config=CFG,
                                   data_dir=tmp_path / "uploads").start()
        with httpx.Client(base_url=server.url, timeout=30, headers=auth) as c:
            again = c.put("/api/jobs/train/meta", json=metas["run-a"])
            assert again.status_code == 409 and again.json()["kind"] == "superseded_run", \
                again.text
            stats = eventually(lambda: get(c, "/api/stats"), what="stats")
            assert stats["by_job"]["train"]["parts"] == 1   # run b's part is still stored
            # run b itself goes on: its metadata again is its own run's
            assert c.put("/api/jobs/train/meta", json=metas["run-b"]).status_code == 200
    finally:
        server.stop()
