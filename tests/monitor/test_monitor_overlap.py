"""A part that repeats steps another part of its rank sent (other bytes, another number) is
refused alone, with nothing stored: its rows, counted twice, once failed the whole window."""

from __future__ import annotations

import numpy as np
import httpx
import pytest

from conftest import eventually
from monitor_jobs import get, parts_of, slow_job
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.service import Monitor, PartIn
from stragglers.monitor.settings import MonitorConfig
from stragglers.monitor.store import open_store
from stragglers.trace.runformat import rank_file_name, table_bytes, write_rank

TOKEN = "overlap-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CFG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05)


def rows_of(trace, rank: int, steps, slower: float = 1.0) -> dict:
    """Rank `rank`'s rows of `steps` (durations times `slower`: other bytes)."""
    o = trace.ops
    sel = (o["rank"] == rank) & np.isin(o["step"], list(steps))
    cols = {k: v[sel] for k, v in o.items()}
    cols["duration"] = cols["duration"] * slower
    return cols


def test_an_upload_repeating_another_parts_steps_is_refused_and_the_window_is_whole(tmp_path):
    trace = slow_job(steps=10, slow=(0, 1, 3.0))
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict(),
                         headers=AUTH).status_code == 200
            parts = parts_of(trace, steps_per_part=5)
            rank, part, cols = parts[0]
            url = "/api/jobs/j/ranks/{}/parts/{}"
            assert c.put(url.format(rank, part), content=table_bytes(cols),
                         headers=AUTH).status_code == 200
            # steps 3..7 of the same rank, as a part numbered 7, other durations
            r = c.put(url.format(rank, 7), content=table_bytes(rows_of(trace, rank, range(3, 8),
                                                                       slower=2.0)),
                      headers=AUTH)
            assert r.status_code == 409, r.text
            assert "steps 3..7" in r.json()["error"] and "part 0" in r.json()["error"]
            assert not s.monitor.store.has_part("j", rank, 7)
            assert not (s.monitor.data_dir / "j" / rank_file_name(rank, 7)).exists()
            for rank, part, cols in parts[1:]:
                r = c.put(url.format(rank, part), content=table_bytes(cols), headers=AUTH)
                assert r.status_code == 200, r.text
            job = eventually(lambda: len(get(c, "/api/jobs/j")["windows"]) == 2
                             and get(c, "/api/jobs/j"), what="2 windows")
            # both windows analysed (a step's rows twice once made the window an error row)
            assert [w["error"] for w in job["windows"]] == [None, None], job["windows"]
            assert all(w["slowdown"] and w["slowdown"] > 1.0 for w in job["windows"])
    finally:
        s.stop()


@pytest.fixture
def monitor(tmp_path):
    store = open_store(str(tmp_path / "mon.db"))
    mon = Monitor(store, MonitorConfig(window_steps=5, stall_after_s=600,
                                       change_detector=False), data_dir=tmp_path / "up")
    mon.leases.beat()
    yield mon
    mon.stop()
    store.close()


def test_two_watched_parts_of_one_batch_with_the_same_steps_keep_the_first(monitor, tmp_path):
    trace = slow_job(steps=10, slow=None)
    run = tmp_path / "runs" / "j"
    monitor.register_job("j", run, "files", trace.meta.to_dict())
    write_rank(run, 0, rows_of(trace, 0, range(0, 5)), part=0)
    write_rank(run, 0, rows_of(trace, 0, range(2, 4), slower=3.0), part=1)   # inside 0..4
    write_rank(run, 0, rows_of(trace, 0, range(5, 10)), part=2)              # the next ones
    monitor._ingest_batch([PartIn("j", 0, p, "files", path=run / rank_file_name(0, p))
                           for p in range(3)])
    assert [monitor.store.has_part("j", 0, p) for p in range(3)] == [True, False, True]
    [refused] = [r for r in monitor.recent_rejects if r["reason"] == "bad_part"]
    assert "steps 2..3 of rank 0 were sent already in its part 0" in refused["problem"]
    # and against a part stored before (another batch): refused the same way
    write_rank(run, 0, rows_of(trace, 0, range(9, 10), slower=2.0), part=3)
    monitor._ingest_batch([PartIn("j", 0, 3, "files", path=run / rank_file_name(0, 3))])
    assert not monitor.store.has_part("j", 0, 3)
    assert "in its part 2" in monitor.recent_rejects[0]["problem"]
