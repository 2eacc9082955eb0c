"""Instances of one PostgreSQL store whose `--data-dir` is not one shared folder: each started
before any part was stored marked its own folder with the store's id and ran, every upload was
acknowledged (200) and none analysed (a job's holder could not read the parts the other wrote).
Each instance now writes a probe file into its uploads folder and records it with its
heartbeat: one that cannot see every live instance's probe is refused at the start, and a
folder that stops being shared afterwards refuses uploads 503 until it is shared again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from pg_cluster import postgres_cluster, postgres_url  # noqa: F401 - fixtures

from conftest import REPO, eventually, listening_url, up
from monitor_jobs import parts_of, slow_job
from stragglers.trace.runformat import table_bytes

SETTINGS = {"window_steps": 5, "stall_after_s": 600, "tick_s": 0.05, "lease_s": 1.5,
            "analysis_process": False}


def _serve(db: str, tmp: Path, name: str, data: Path) -> subprocess.Popen:
    cfg = tmp / "monitor.yaml"
    cfg.write_text(json.dumps({"settings": SETTINGS}))
    return subprocess.Popen([sys.executable, "-m", "stragglers.monitor", "serve", "--db", db,
                             "--port", "0", "--config", str(cfg), "--data-dir", str(data)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=open(tmp / f"{name}.log", "w"))


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()


def _upload_all(urls: list[str], jobs: list[str]) -> list[str]:
    """Each job's meta and parts, spread over the instances; the jobs whose every upload was
    acknowledged."""
    trace = slow_job(steps=10, slow=(0, 1, 3.0))
    parts = parts_of(trace, 5)
    acked: list[str] = []
    if not urls:   # (every instance refused at its start: nothing to upload to, none acked)
        return acked
    with httpx.Client(timeout=60) as c:
        for job in jobs:
            codes = [c.put(f"{u}/api/jobs/{job}/meta", json=trace.meta.to_dict()).status_code
                     for u in urls]
            for i, (rank, n, cols) in enumerate(parts):
                codes.append(c.put(f"{urls[i % len(urls)]}/api/jobs/{job}/ranks/{rank}/parts/"
                                   f"{n}", content=table_bytes(cols)).status_code)
            if all(code == 200 for code in codes):
                acked.append(job)
    return acked


def _analysed(url: str, jobs: list[str]) -> bool:
    got = {j["job"]: j for j in httpx.get(f"{url}/api/jobs", timeout=30).json()["jobs"]}
    return all(job in got and (got[job].get("window") or -1) >= 1 for job in jobs)


def _wait_up_or_exit(p: subprocess.Popen) -> str:
    url = listening_url(p)
    if url and up(p, url):
        return url
    p.wait(timeout=120)
    return ""


@pytest.mark.slow
def test_a_second_instance_with_a_folder_of_its_own_is_refused_at_the_start(postgres_url,
                                                                            tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = _serve(postgres_url, tmp_path, "a", tmp_path / "a")
    procs = [a]
    try:
        url_a = _wait_up_or_exit(a)
        assert url_a, (tmp_path / "a.log").read_text()
        b = _serve(postgres_url, tmp_path, "b", tmp_path / "b")
        procs.append(b)
        assert _wait_up_or_exit(b) == "" and b.returncode == 2
        err = (tmp_path / "b.log").read_text().strip().splitlines()
        assert len(err) == 1 and "not the one the other instances of this store write to" in \
            err[0] and "Traceback" not in err[0], err
        # the first instance goes on, its leases its own, and what it acknowledges is analysed
        assert _upload_all([url_a], ["j1", "j2"]) == ["j1", "j2"]
        eventually(lambda: _analysed(url_a, ["j1", "j2"]), 120, what="both jobs analysed")
    finally:
        _stop(procs)


@pytest.mark.slow
def test_two_instances_with_folders_of_their_own_started_together_never_acknowledge_what_they_cannot_analyse(
        postgres_url, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    procs = [_serve(postgres_url, tmp_path, n, tmp_path / n) for n in ("a", "b")]
    try:
        urls = [_wait_up_or_exit(p) for p in procs]
        live = [u for u in urls if u]
        assert len(live) <= 1, "both instances started on folders of their own"
        jobs = [f"j{i}" for i in range(4)]
        acked = _upload_all(live, jobs)
        for u in live:
            eventually(lambda u=u: _analysed(u, acked), 120, what="every acknowledged job analysed")
    finally:
        _stop(procs)


@pytest.mark.slow
def test_a_folder_that_stops_being_shared_refuses_uploads_until_it_is_again(postgres_url,
                                                                         tmp_path):
    shared, other = tmp_path / "shared", tmp_path / "other"
    shared.mkdir()
    other.mkdir()
    link = tmp_path / "link"   # B's --data-dir: the shared folder by another path, for now
    os.symlink(shared, link)
    procs = [_serve(postgres_url, tmp_path, "a", shared), _serve(postgres_url, tmp_path, "b", link)]
    try:
        urls = [_wait_up_or_exit(p) for p in procs]
        assert all(urls), [(tmp_path / f"{n}.log").read_text()[-2000:] for n in "ab"]
        assert _upload_all(urls, ["j0"]) == ["j0"]
        eventually(lambda: _analysed(urls[0], ["j0"]), 120, what="j0 analysed")
        os.unlink(link)   # B's folder is another one now (a mount gone, a volume replaced)
        os.symlink(other, link)

        def refused(u: str) -> bool:
            r = httpx.put(f"{u}/api/jobs/j1/meta", json=slow_job(steps=10).meta.to_dict(),
                          timeout=30)
            return r.status_code == 503 and "not the one the other instances" in \
                r.json()["error"]

        for u in urls:   # each sees a live instance's probe missing from its folder
            eventually(lambda u=u: refused(u), 120, what="uploads refused 503")
            assert "uploads_refused" in httpx.get(f"{u}/health", timeout=30).json()
        os.unlink(link)
        os.symlink(shared, link)
        for u in urls:
            eventually(lambda u=u: "uploads_refused" not in
                       httpx.get(f"{u}/health", timeout=30).json(), 120, what="shared again")
        assert _upload_all(urls, ["j1"]) == ["j1"]
        eventually(lambda: _analysed(urls[1], ["j0", "j1"]), 120, what="j1 analysed")
    finally:
        _stop(procs)
