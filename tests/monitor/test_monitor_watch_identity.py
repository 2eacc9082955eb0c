"""Watched runs as the operator's folders are (issue 34, round three): the first scan of a big
root in the background, one job per real run directory however it is reached, a renamed run
still its job."""

from __future__ import annotations

import copy
import json
import os
import shutil
import threading

import httpx
import pytest

from monitor_jobs import get, parts_of, slow_job, start_run, write_parts
from stragglers.monitor.ingest_files import DirectoryWatcher
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.service import Monitor
from stragglers.monitor.settings import MonitorConfig
from stragglers.monitor.store import open_store

CFG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, rescan_s=3600)


@pytest.mark.slow
def test_health_answers_while_the_first_scan_runs_and_says_so(tmp_path, monkeypatch):
    # the first scan of the watched roots ran before the server answered anything: 30,000
    # folders held /health (and every upload) ~8 s. Here the scan waits on the test's event
    # at its first run: /health must answer meanwhile, saying the scan is under way.
    runs = tmp_path / "runs"
    trace = slow_job(steps=10)
    for name in ("job-a", "job-b"):
        start_run(runs / name, trace)
        write_parts(runs / name, parts_of(trace, 5))
    release, entered = threading.Event(), threading.Event()
    real = DirectoryWatcher._scan_run

    def held(self, run):
        entered.set()
        release.wait(60)
        return real(self, run)

    monkeypatch.setattr(DirectoryWatcher, "_scan_run", held)
    box: dict = {}
    starter = threading.Thread(target=lambda: box.update(s=MonitorServer(
        tmp_path / "mon.db", watch=[runs], port=0, config=CFG).start()))
    starter.start()
    try:
        assert entered.wait(60)
        starter.join(30)   # (before: start() returned only after the scan, 60 s from now)
        assert "s" in box, "the server did not start while its first scan was under way"
        s = box["s"]
        with httpx.Client(base_url=s.url, timeout=60) as c:
            health = get(c, "/health")
            assert health["scanning"] is True and health["idle"] is False
            release.set()
            assert s.monitor.wait_idle(120)
            health = get(c, "/health")
            assert health["scanning"] is False and health["jobs"] == 2
            assert s.monitor.store.totals()["by_way"]["files"].parts == 2 * len(
                parts_of(trace, 5))
    finally:
        release.set()
        starter.join(120)
        if "s" in box:
            box["s"].stop()


def _monitor(tmp_path) -> Monitor:
    return Monitor(open_store(tmp_path / "mon.db", durable=False), CFG).start()


def _stop(monitor: Monitor) -> None:
    monitor.stop()
    monitor.store.close()


@pytest.mark.slow
def test_a_run_reached_by_links_or_two_watched_folders_is_one_job(tmp_path):
    # a link to a run dir beside it, a link to it from a second watched folder: each was a job
    # of its own over the same files (every part stored and analysed twice)
    runs, other = tmp_path / "runs", tmp_path / "other"
    trace = slow_job(steps=10)
    parts = parts_of(trace, 5)
    start_run(runs / "job-a", trace)
    write_parts(runs / "job-a", [p for p in parts if p[1] == 0])
    os.symlink("job-a", runs / "alias")
    other.mkdir()
    os.symlink(runs / "job-a", other / "from-other")
    monitor = _monitor(tmp_path)
    try:
        watcher = DirectoryWatcher(monitor, [runs, other])
        for _ in range(2):
            watcher.scan()
            assert monitor.wait_idle(120)
        assert sorted(monitor.directories) == ["job-a"]
        assert monitor.directories["job-a"] == (runs / "job-a").resolve()
        assert monitor.store.totals()["by_way"]["files"].parts == len(parts) // 2
        said = sorted(r["source"] for r in monitor.recent_rejects if r["reason"] == "bad_run")
        assert said == ["alias", "from-other"], list(monitor.recent_rejects)   # once each
        # a part written through a link is the run's part, stored once
        write_parts(runs / "alias", [p for p in parts if p[1] == 1])
        watcher._path_changed(runs / "alias" / "rank-00000.part-000001.parquet")
        watcher._path_changed(other / "from-other" / "rank-00000.part-000001.parquet")
        watcher.scan()
        assert monitor.wait_idle(120)
        assert sorted(monitor.directories) == ["job-a"]
        assert monitor.store.totals()["by_way"]["files"].parts == len(parts)
    finally:
        _stop(monitor)


@pytest.mark.slow
def test_links_out_of_the_watched_folders_and_loops_are_refused_once(tmp_path):
    # a link back to the watched folder (a loop) was a run of the folder's stray parts; a
    # link to a run outside every watched folder was a job over files the operator never chose
    runs, outside = tmp_path / "runs", tmp_path / "outside"
    trace = slow_job(steps=10)
    parts = parts_of(trace, 5)
    start_run(runs / "job-a", trace)
    write_parts(runs / "job-a", parts)
    write_parts(runs, [parts[0]])                    # a stray part at the folder's top
    start_run(outside / "job-x", trace)
    write_parts(outside / "job-x", parts)
    os.symlink(runs, runs / "loop")
    os.symlink(outside / "job-x", runs / "elsewhere")
    monitor = _monitor(tmp_path)
    try:
        watcher = DirectoryWatcher(monitor, [runs])
        for _ in range(2):
            watcher.scan()
            assert monitor.wait_idle(120)
        assert sorted(monitor.directories) == ["job-a"]
        assert monitor.store.totals()["by_way"]["files"].parts == len(parts)
        said = sorted((r["source"], "loop" in r["problem"]) for r in monitor.recent_rejects
                      if r["reason"] == "bad_run")
        assert said == [("elsewhere", False), ("loop", True)], list(monitor.recent_rejects)
    finally:
        _stop(monitor)


def _with_start(trace, start):
    """meta.json as the recorder writes it once its ranks met (its run mark known)."""
    raw = copy.deepcopy(trace.meta.to_dict())
    raw["extra"]["clock"] = {"start": start}
    return raw


def _steps_analysed(store, job: str) -> list[int]:
    return sorted(s for w in store.windows(job) for s in range(w.first_step, w.last_step + 1))


@pytest.mark.slow
def test_a_renamed_run_stays_its_job_and_a_copy_is_another(tmp_path):
    # `mv runs/job-a runs/job-b` mid-run made job-b a new job: every part stored and analysed
    # again under it, and job-a left running with its rank frontiers stuck
    runs = tmp_path / "runs"
    trace = slow_job(steps=20)
    parts = parts_of(trace, 5)
    start_run(runs / "job-a", trace)                 # no run mark yet: known by its inode
    write_parts(runs / "job-a", [p for p in parts if p[1] < 2])
    monitor = _monitor(tmp_path)
    try:
        watcher = DirectoryWatcher(monitor, [runs])
        watcher.scan()
        assert monitor.wait_idle(120)
        os.rename(runs / "job-a", runs / "job-b")
        write_parts(runs / "job-b", [p for p in parts if p[1] >= 2])
        (runs / "job-a").mkdir()                     # its old name taken by an empty folder
        watcher.scan()
        assert monitor.wait_idle(120)
        assert dict(monitor.directories) == {"job-a": (runs / "job-b").resolve()}
        assert monitor.store.job("job-a").directory == str((runs / "job-b").resolve())
        assert monitor.store.totals()["by_way"]["files"].parts == len(parts)
        assert _steps_analysed(monitor.store, "job-a") == list(range(20))
        shutil.copytree(runs / "job-b", runs / "job-c")   # a copy: its own job
        watcher.scan()
        assert monitor.wait_idle(120)
        assert sorted(monitor.directories) == ["job-a", "job-c"]
    finally:
        _stop(monitor)


@pytest.mark.slow
def test_a_run_renamed_while_the_monitor_was_down_is_known_by_its_run_mark(tmp_path):
    runs = tmp_path / "runs"
    trace = slow_job(steps=20)
    parts = parts_of(trace, 5)
    raw = _with_start(trace, [{"offset_ns": 1}] * trace.meta.world_size)
    (runs / "job-a").mkdir(parents=True)
    (runs / "job-a" / "meta.json").write_text(json.dumps(raw))
    write_parts(runs / "job-a", [p for p in parts if p[1] < 2])
    monitor = _monitor(tmp_path)
    try:
        watcher = DirectoryWatcher(monitor, [runs])
        watcher.scan()
        assert monitor.wait_idle(120)
    finally:
        _stop(monitor)
    os.rename(runs / "job-a", runs / "renamed")
    write_parts(runs / "renamed", [p for p in parts if p[1] >= 2])
    other = raw | {"run_id": "another"}              # another run: its own job
    (runs / "job-x").mkdir()
    (runs / "job-x" / "meta.json").write_text(json.dumps(other))
    monitor = _monitor(tmp_path)
    try:
        DirectoryWatcher(monitor, [runs]).start()   # (its first scan learns the gone runs)
        assert monitor.wait_idle(120)
        assert dict(monitor.directories) == {"job-a": (runs / "renamed").resolve(),
                                             "job-x": (runs / "job-x").resolve()}
        assert monitor.store.totals()["by_way"]["files"].parts == len(parts)
        assert _steps_analysed(monitor.store, "job-a") == list(range(20))
    finally:
        _stop(monitor)


@pytest.mark.slow
def test_the_file_events_come_from_a_child_started_again_when_killed(tmp_path):
    # the watch is built in a child process (watchfiles held the interpreter lock 2-3 s per
    # 30,000 folders); a child killed is started again, and new runs are seen by their events
    import signal

    from conftest import eventually

    runs = tmp_path / "runs"
    runs.mkdir()
    trace = slow_job(steps=10)
    monitor = _monitor(tmp_path)
    watcher = DirectoryWatcher(monitor, [runs], rescan_s=3600).start()
    try:
        first = eventually(lambda: watcher._child, what="the watch process")
        assert first.pid != os.getpid() and first.poll() is None
        start_run(runs / "job-a", trace)
        eventually(lambda: "job-a" in monitor.directories, what="job-a seen")
        os.kill(first.pid, signal.SIGKILL)
        second = eventually(lambda: watcher._child is not first and watcher._child,
                            what="a new watch process")
        start_run(runs / "job-b", trace)   # seen by its events (rescans are an hour apart)
        eventually(lambda: "job-b" in monitor.directories, what="job-b seen")
    finally:
        watcher.stop()
        _stop(monitor)
    assert second.poll() is not None   # (stop ends it)


@pytest.mark.slow
def test_two_runs_that_swap_names_keep_their_jobs_and_a_copy_outlives_its_original(tmp_path):
    # a swap (a → tmp, b → a, tmp → b) once read b's meta.json at a's path as a new run of
    # job a: job a's history was reset and its parts numbered again from b's files
    runs = tmp_path / "runs"
    traces = {n: slow_job(steps=10, seed=i) for i, n in enumerate(("a", "b"))}
    for i, (name, trace) in enumerate(traces.items()):
        raw = _with_start(trace, [{"offset_ns": 10 + i}] * trace.meta.world_size)
        (runs / name).mkdir(parents=True)
        (runs / name / "meta.json").write_text(json.dumps(raw))
        write_parts(runs / name, parts_of(trace, 5))
    monitor = _monitor(tmp_path)
    try:
        watcher = DirectoryWatcher(monitor, [runs])
        watcher.scan()
        assert monitor.wait_idle(120)
        windows = {j: [(w.idx, w.slowdown) for w in monitor.store.windows(j)] for j in "ab"}
        os.rename(runs / "a", runs / "tmp")
        os.rename(runs / "b", runs / "a")
        os.rename(runs / "tmp", runs / "b")
        for _ in range(2):
            watcher.scan()
            assert monitor.wait_idle(120)
        assert dict(monitor.directories) == {"a": (runs / "b").resolve(),
                                             "b": (runs / "a").resolve()}
        assert {j: [(w.idx, w.slowdown) for w in monitor.store.windows(j)]
                for j in "ab"} == windows
        assert monitor.store.totals()["by_way"]["files"].parts == 2 * len(parts_of(
            traces["a"], 5))
        # a copy is its own job; its original gone, it stays that job (not the original's)
        shutil.copytree(runs / "a", runs / "c")
        watcher.scan()
        assert monitor.wait_idle(120)
        shutil.rmtree(runs / "a")
        watcher.scan()
        assert monitor.wait_idle(120)
        assert dict(monitor.directories) == {"a": (runs / "b").resolve(),
                                             "b": (runs / "a").resolve(),
                                             "c": (runs / "c").resolve()}
        # the copy renamed (its mark is its original's): still the copy's job
        os.rename(runs / "c", runs / "c2")
        watcher.scan()
        assert monitor.wait_idle(120)
        assert dict(monitor.directories)["c"] == (runs / "c2").resolve()
        assert sorted(monitor.directories) == ["a", "b", "c"]
    finally:
        _stop(monitor)


@pytest.mark.slow
def test_a_job_stored_under_a_link_by_an_earlier_version_follows_its_real_directory(tmp_path):
    # a store written when links were followed as names: the run's job is its link's, and the
    # real directory must not become a second job over the same parts
    from stragglers.monitor.parts import parse_part_name
    from stragglers.monitor.service import PartIn

    runs = tmp_path / "runs"
    trace = slow_job(steps=10)
    parts = parts_of(trace, 5)
    start_run(runs / "deep" / "real", trace)
    write_parts(runs / "deep" / "real", parts)
    os.symlink(runs / "deep" / "real", runs / "alias")
    monitor = _monitor(tmp_path)
    try:   # what the watcher did then: the link's path as the run's
        monitor.register_job("alias", runs / "alias", "files",
                             json.loads((runs / "alias" / "meta.json").read_text()))
        for path in sorted((runs / "alias").iterdir()):
            if parse_part_name(path.name):
                rank, part = parse_part_name(path.name)
                monitor.submit(PartIn("alias", rank, part, "files", path=path))
        assert monitor.wait_idle(120)
    finally:
        _stop(monitor)
    monitor = _monitor(tmp_path)
    try:
        DirectoryWatcher(monitor, [runs]).start()
        assert monitor.wait_idle(120)
        assert dict(monitor.directories) == {"alias": (runs / "deep" / "real").resolve()}
        assert monitor.store.totals()["by_way"]["files"].parts == len(parts)
    finally:
        _stop(monitor)


@pytest.mark.slow
def test_names_that_are_not_utf8_under_a_root_leave_the_watch_of_its_other_runs_up(tmp_path):
    # watchfiles cannot name a path that is not UTF-8: its recursive watch of a root holding
    # one failed at once, for as long as it was there, so every other run of the root was
    # seen only at the next rescan (here an hour: never). Now the watch goes on folder by
    # folder without such names; a run folder named so is refused in one line, once (issue 34)
    from conftest import eventually

    runs = tmp_path / "runs"
    runs.mkdir()
    os.mkdir(os.fsencode(runs) + b"/junk-\xff")
    trace = slow_job(steps=10)
    parts = parts_of(trace, 5)
    bad = runs / os.fsdecode(b"run-\xfe")
    start_run(bad, trace)
    monitor = _monitor(tmp_path)
    watcher = DirectoryWatcher(monitor, [runs], rescan_s=3600).start()
    try:
        eventually(lambda: watcher.watching, what="the watch up")
        assert monitor.wait_idle(120)
        start_run(runs / "job-a", trace)
        write_parts(runs / "job-a", parts)
        eventually(lambda: "job-a" in monitor.directories, what="job-a followed by the watch")
        # a folder not named in UTF-8 made while watched: the watch is made again and goes on
        start_run(runs / os.fsdecode(b"late-\xfd"), trace)
        start_run(runs / "job-b", trace)
        write_parts(runs / "job-b", parts)
        eventually(lambda: "job-b" in monitor.directories, what="job-b followed by the watch")
        assert monitor.wait_idle(120)
        assert monitor.store.totals()["by_way"]["files"].parts == 2 * len(parts)
        refused = [r for r in monitor.recent_rejects if "UTF-8" in r["problem"]]
        assert sorted(r["source"].split("/")[-2] for r in refused) == \
            ["late-\\xfd", "run-\\xfe"], refused
        assert watcher.watching and all(t.is_alive() for t in watcher._threads)
    finally:
        watcher.stop()
        _stop(monitor)


@pytest.mark.slow
def test_a_watched_folder_removed_and_made_again_is_watched_again(tmp_path):
    # the watch of a removed root went with it, silently: runs written in the folder made
    # again under its name were seen only at the next rescan (here an hour)
    from conftest import eventually

    runs = tmp_path / "runs"
    runs.mkdir()
    trace = slow_job(steps=10)
    monitor = _monitor(tmp_path)
    watcher = DirectoryWatcher(monitor, [runs], rescan_s=3600).start()
    try:
        eventually(lambda: watcher.watching, what="the watch up")
        shutil.rmtree(runs)
        eventually(lambda: not watcher.watching, what="the removal seen")
        runs.mkdir()
        eventually(lambda: watcher.watching, what="the watch back")
        start_run(runs / "job-a", trace)
        eventually(lambda: "job-a" in monitor.directories, what="job-a seen")
    finally:
        watcher.stop()
        _stop(monitor)
