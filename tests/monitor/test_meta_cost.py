"""What a meta.json may cost the monitor (review H5): its size is bounded by what a recorder
writes for the job's world (not 1 MiB of anything), an unchanged one re-sent is not written
or stored again, and the file is written by the C encoder, readable."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from monitor_jobs import get, slow_job
from stragglers.monitor.ingest_http import write_meta_file
from stragglers.monitor.jobmeta import META_BYTES_PER_RANK, check_meta
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.model import JobMeta
from stragglers.trace.runformat import META_FILE, read_meta

TOKEN = "meta-cost-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CFG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05)


def recorder_meta(dp: int, pp: int) -> dict:
    """meta.json as the richest recorder writes it (attach on a DeviceMesh: a layout entry
    with host, CPU list, device and mesh places; start and end clock estimates per rank)."""
    world = dp * pp
    est = {"offset_ns": -123456789012, "error_ns": 123456, "rtt_ns": 2345678, "rounds": 16}
    layout = [{"rank": r, "dp_rank": r // pp, "stage": r % pp, "host": f"node-{r // 8:05d}."
               "cluster.example.com", "cpus": "0-11,48-59", "device": "cuda:7", "threads": 12,
               "replica": 0, "tp_rank": 0, "cp_rank": 0, "ep_rank": 0} for r in range(world)]
    meta = JobMeta(name="big", dp_size=dp, pp_size=pp)
    meta.extra.update({"recorded_by": "attach", "wrapper": "fsdp2", "run": "r" * 32,
                       "layout": layout, "clock": {
                           "start": [est] * world, "max_error_start_s": 1.2e-4,
                           "end": [est] * world, "max_error_end_s": 1e-4,
                           "max_drift_s": 2e-4}})
    return meta.to_dict()


def test_a_real_large_jobs_meta_fits_and_padding_of_a_small_one_does_not():
    # a recorder's meta.json of 4,096 ranks is 1.4 MB (over the old flat 1 MiB: its job could
    # not be monitored), while 100 KB of padding in a 4-rank job's meta (under it) was taken
    big = recorder_meta(512, 8)
    assert len(json.dumps(big)) > 1 << 20
    assert check_meta(big, "big/meta.json").world_size == 4096
    small = slow_job(steps=4).meta.to_dict()
    small["extra"]["blob"] = "x" * 100_000
    with pytest.raises(Exception, match="besides extra.layout and extra.clock"):
        check_meta(small, "small/meta.json")
    # the per-rank lists are bounded by the world they describe: a 4-rank layout's entries
    # padded past META_BYTES_PER_RANK each are refused
    padded = slow_job(steps=4).meta.to_dict()
    for e in padded["extra"]["layout"]:
        e["host"] = "h" * 200
        e["pad"] = "p" * META_BYTES_PER_RANK
    with pytest.raises(Exception, match="per rank"):
        check_meta(padded, "padded/meta.json")


def test_meta_json_is_written_readable_and_equal_to_what_was_checked(tmp_path):
    raw = recorder_meta(4, 2)
    meta = check_meta(raw, "x/meta.json")
    path = write_meta_file(tmp_path / "j", meta)
    text = path.read_text()
    assert text.startswith("{\n  \"dp_size\": 4,"), text[:40]   # indented, keys sorted
    assert json.loads(text) == raw
    assert read_meta(path).to_dict() == raw


@pytest.mark.slow
def test_an_unchanged_meta_sent_again_is_not_written_again_and_a_padded_one_is_413(tmp_path):
    trace = slow_job(steps=4)
    meta = trace.meta.to_dict()
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            body = json.dumps(meta)
            assert c.put("/api/jobs/j/meta", content=body, headers=AUTH).status_code == 200
            # (the second registration sets the job's tracker to the JobMeta it checked)
            assert c.put("/api/jobs/j/meta", content=body, headers=AUTH).status_code == 200
            path = next(tmp_path.rglob(f"j/{META_FILE}"))   # (the uploads folder's)
            ino = os.stat(path).st_ino
            for _ in range(5):
                r = c.put("/api/jobs/j/meta", content=body, headers=AUTH)
                assert r.status_code == 200 and r.json()["world_size"] == 4, r.text
            # (fails before: each PUT wrote a new file, a new inode, by rename)
            assert os.stat(path).st_ino == ino
            # a changed one is written and stored
            meta["extra"]["note"] = "changed"
            assert c.put("/api/jobs/j/meta", json=meta, headers=AUTH).status_code == 200
            assert os.stat(path).st_ino != ino
            assert json.loads(path.read_text())["extra"]["note"] == "changed"
            # 200 KB of padding in a 4-rank job's meta: 413 before parsing (fails before: 200)
            meta["extra"]["blob"] = [[i, i * 0.5, {"k": i}] for i in range(10_000)]
            r = c.put("/api/jobs/j2/meta", json=meta, headers=AUTH)
            assert r.status_code == 413, r.text
            assert "meta.json of 4 ranks" in r.json()["error"]
            assert [j["job"] for j in get(c, "/api/jobs")["jobs"]] == ["j"]
    finally:
        s.stop()
