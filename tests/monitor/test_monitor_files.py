"""Watched run directories end to end: a real service on loopback, real SQLite, real files."""

from __future__ import annotations

import httpx
import pytest

from conftest import eventually
from monitor_jobs import get, parts_of, rank_of, slow_job, start_run, write_parts
from stragglers.errors import InputError
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig

FAST = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, rescan_s=0.5)


def serve(tmp_path, watch, config=FAST):
    return MonitorServer(tmp_path / "mon.db", watch=watch, port=0, config=config).start()


@pytest.mark.slow
def test_watched_run_is_analysed_window_by_window_and_served(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    trace = slow_job(steps=20, slow=(1, 1, 3.0))
    parts = parts_of(trace, steps_per_part=4)
    server = serve(tmp_path, [runs])
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            run = runs / "job-a"
            start_run(run, trace)                          # the run appears after the start
            write_parts(run, [p for p in parts if p[1] < 2])          # steps 0..7
            first = eventually(lambda: get(c, "/api/jobs/job-a")["windows"], what="window 0")
            assert [(w["first_step"], w["last_step"]) for w in first] == [(0, 4)]
            write_parts(run, [p for p in parts if p[1] >= 2])         # steps 8..19
            wins = eventually(lambda: len(get(c, "/api/jobs/job-a")["windows"]) == 4
                              and get(c, "/api/jobs/job-a")["windows"], what="4 windows")
            assert [w["first_step"] for w in wins] == [0, 5, 10, 15]
            job = get(c, "/api/jobs/job-a")
            slow_rank = rank_of(trace, 1, 1)
            hot = max(job["window"]["scores"], key=lambda s: s["score"])
            assert hot["rank"] == slow_rank and hot["score"] > 1.3
            jobs = get(c, "/api/jobs")["jobs"]
            assert [(j["job"], j["world_size"], j["state"]) for j in jobs] == \
                [("job-a", 4, "running")]
            stats = get(c, "/api/stats")
            assert stats["by_way"]["files"] == {"parts": len(parts), "records": len(trace)}
            text = c.get("/metrics").text
            assert f'stragglers_worker_score{{dp="1",host="host{slow_rank % 2}",job="job-a",' \
                   f'pp="1",rank="{slow_rank}"}}' in text
            assert 'stragglers_windows_total{job="job-a"} 4.0' in text
            assert f'stragglers_records_ingested_total{{way="files"}} {float(len(trace))}' in text
    finally:
        server.stop()
    # A restart re-reads nothing analysed and counts nothing twice.
    server = serve(tmp_path, [runs])
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert eventually(lambda: get(c, "/api/stats")["idle"], what="idle after restart")
            assert get(c, "/api/stats")["by_way"]["files"] == {"parts": len(parts),
                                                               "records": len(trace)}
            assert len(get(c, "/api/jobs/job-a")["windows"]) == 4
            assert 'stragglers_records_ingested_total{way="files"} 0.0' in c.get("/metrics").text
    finally:
        server.stop()


def test_bad_files_are_refused_and_named_without_changing_anything(tmp_path):
    run = tmp_path / "job-b"
    trace = slow_job(steps=10)
    start_run(run, trace)
    (run / "rank-00000.part-000000.parquet").write_bytes(b"not parquet at all")
    rank, part, cols = parts_of(trace, 5)[1]
    cols = {k: v for k, v in cols.items() if k != "duration"}   # a part with a column missing
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table(cols), run / f"rank-{rank:05d}.part-{part:06d}.parquet")
    server = serve(tmp_path, [run])
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            rejects = eventually(lambda: len(get(c, "/api/stats")["rejects"]) >= 2
                                 and get(c, "/api/stats")["rejects"], what="two refusals")
            problems = " | ".join(f"{r['source']}: {r['problem']}" for r in rejects)
            assert "rank-00000.part-000000.parquet" in problems
            assert "not a readable Parquet file" in problems
            assert "duration" in problems
            assert get(c, "/api/stats")["by_way"] == {}
            assert 'stragglers_ingest_rejected_total{reason="bad_part"}' in c.get("/metrics").text
    finally:
        server.stop()


def test_parts_are_taken_by_their_footers_and_rows_found_bad_later_are_refused_alone(tmp_path):
    # a part's footer is checked at ingest and its rows are read by its window; NaN times are
    # not in Parquet's min/max, so that part is refused when its window reads it, and the
    # window is analysed without it; a part written without statistics is read whole at ingest
    import numpy as np
    import pyarrow.parquet as pq
    from stragglers.trace.columns import columns_to_table
    run = tmp_path / "job-c"
    trace = slow_job(steps=10, slow=(1, 1, 3.0))
    parts = parts_of(trace, steps_per_part=5)
    start_run(run, trace)
    assert [(r, p) for r, p, _ in parts[:6]] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1)]
    nan_rank, nan_part, cols = parts[5]                       # rank 1's steps 5..9
    cols = {**cols, "duration": np.where(np.arange(len(cols["step"])) == 3, np.nan,
                                         cols["duration"])}
    bare_rank, bare_part, bare = parts[2]
    write_parts(run, [p for i, p in enumerate(parts) if i not in (5, 2)])
    pq.write_table(columns_to_table(cols), run / f"rank-{nan_rank:05d}.part-{nan_part:06d}.parquet")
    pq.write_table(columns_to_table(bare), run / f"rank-{bare_rank:05d}.part-{bare_part:06d}"
                   ".parquet", write_statistics=False)
    server = serve(tmp_path, [run])
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            # (the first scan runs in the background: until it is done the job is unknown,
            # and each read of it a refusal counted below)
            eventually(lambda: not get(c, "/health")["scanning"], what="first scan done")
            wins = eventually(lambda: len(get(c, "/api/jobs/job-c")["windows"]) == 2
                              and get(c, "/api/jobs/job-c")["windows"], what="2 windows")
            assert get(c, "/api/stats")["by_way"]["files"] == {"parts": len(parts),
                                                               "records": len(trace)}
            rejects = get(c, "/api/stats")["rejects"]
            assert len(rejects) == 1 and rejects[0]["source"].endswith(
                f"rank-{nan_rank:05d}.part-{nan_part:06d}.parquet")
            assert "NaN" in rejects[0]["problem"] and rejects[0]["reason"] == "bad_part"
            by_first = {w["first_step"]: server.store.window("job-c", w["idx"]) for w in wins}
            assert by_first[0].error is None and by_first[0].missing_ranks == []
            # the window without rank 1's rows: analysed on the DP replica that is whole
            # (it was an error row: "ops missing from workers"), rank 1 named missing
            assert by_first[5].missing_ranks == [nan_rank]
            assert by_first[5].error is None and by_first[5].slowdown is not None
            nan_dp = int(trace.ops["dp_rank"][trace.ops["rank"] == nan_rank][0])
            assert {s.dp for s in by_first[5].scores} == {1 - nan_dp}
            assert 'stragglers_ingest_rejected_total{reason="bad_part"} 1.0' in \
                c.get("/metrics").text
    finally:
        server.stop()


def test_bad_watch_dir_and_config_are_one_line_errors(tmp_path):
    with pytest.raises(InputError, match="not a directory"):
        MonitorServer(tmp_path / "m.db", watch=[tmp_path / "nope"], port=0)
    cfg = tmp_path / "rules.yaml"
    cfg.write_text("rules:\n  - name: x\n    when: slowdown >> 2\n")
    with pytest.raises(InputError, match=r"rules\[0\]\.when"):
        MonitorServer(tmp_path / "m.db", port=0, config_file=cfg)
    cfg.write_text("settings:\n  window_steps: 0\n")
    with pytest.raises(InputError, match="window_steps"):
        MonitorServer(tmp_path / "m.db", port=0, config_file=cfg)


def test_the_service_analyses_in_a_process_unless_its_config_says_otherwise(tmp_path):
    # `stragglers monitor serve` passes this default; a program embedding the server does not
    serve_default = {"analysis_process": True}
    cases = [(None, None, False), (None, serve_default, True),
             ("settings:\n  analysis_process: false\n", serve_default, False),
             ("settings:\n  window_steps: 3\n", serve_default, True)]
    for i, (text, defaults, expected) in enumerate(cases):
        cfg = None
        if text is not None:
            cfg = tmp_path / f"c{i}.yaml"
            cfg.write_text(text)
        server = MonitorServer(tmp_path / f"m{i}.db", port=0, config_file=cfg, defaults=defaults)
        try:
            assert server.monitor.config.analysis_process is expected, (text, defaults)
            assert server.monitor.analyser.in_process is (not expected)
        finally:
            server.sock.close()
            server.store.close()


def test_a_rescan_queues_again_only_parts_that_changed_or_failed_to_store(tmp_path):
    # a rescan once queued every part that was seen but not stored: a refused part was read and
    # refused again every rescan_s (a log line and a re-read each time), and parts still queued
    # behind a long backlog were queued once more per rescan (the queue grew without bound)
    from stragglers.monitor.ingest_files import DirectoryWatcher
    from stragglers.monitor.service import Monitor
    from stragglers.monitor.store import open_store
    run = tmp_path / "job-r"
    trace = slow_job(steps=10)
    parts = parts_of(trace, 5)
    start_run(run, trace)
    write_parts(run, parts[1:])
    bad = run / "rank-00000.part-000000.parquet"
    bad.write_bytes(b"PAR1 not parquet at all")
    store = open_store(tmp_path / "mon.db", durable=False)
    monitor = Monitor(store, FAST.replace(rescan_s=3600)).start()
    try:
        watcher = DirectoryWatcher(monitor, [run])
        for _ in range(3):
            watcher.scan()
            assert monitor.wait_idle(120)
        refused = [r for r in monitor.recent_rejects if r["source"].endswith(bad.name)]
        assert len(refused) == 1, refused
        assert store.totals()["by_way"]["files"].parts == len(parts) - 1
        # the file replaced by a good one (atomically, as the recorder writes): taken next scan
        write_parts(run, parts[:1])
        watcher.scan()
        assert monitor.wait_idle(120)
        assert store.totals()["by_way"]["files"].parts == len(parts)
        assert len([r for r in monitor.recent_rejects if r["source"].endswith(bad.name)]) == 1
    finally:
        monitor.stop()
        store.close()


def test_parts_still_queued_are_not_queued_again_by_a_rescan(tmp_path):
    from stragglers.monitor.ingest_files import DirectoryWatcher
    from stragglers.monitor.service import Monitor
    from stragglers.monitor.store import open_store
    run = tmp_path / "job-q"
    trace = slow_job(steps=10)
    parts = parts_of(trace, 5)
    start_run(run, trace)
    write_parts(run, parts)
    store = open_store(tmp_path / "mon.db", durable=False)
    monitor = Monitor(store, FAST.replace(rescan_s=3600))   # not started: nothing is taken
    try:
        watcher = DirectoryWatcher(monitor, [run])
        watcher.scan()
        queued = monitor._ingest.qsize()
        assert queued == len(parts)
        watcher.scan()
        watcher.scan()
        assert monitor._ingest.qsize() == queued
    finally:
        store.close()


@pytest.mark.slow
def test_a_watched_batch_is_handed_over_as_noticed_since_the_batch_before(tmp_path):
    # the dead-man holds a silence while a watcher hands over events that may hold the job's
    # last part (written before the deadline, not yet queued): every part the watcher queues is
    # queued inside `noticing(after)`, with `after` no later than the part's file got its name
    import os
    from contextlib import contextmanager
    from pathlib import Path

    from stragglers.monitor.ingest_files import DirectoryWatcher
    from stragglers.monitor.service import Monitor
    from stragglers.monitor.store import open_store
    run = tmp_path / "job-n"
    trace = slow_job(steps=10)
    parts = parts_of(trace, 5)
    start_run(run, trace)
    store = open_store(tmp_path / "mon.db", durable=False)
    monitor = Monitor(store, FAST.replace(rescan_s=3600))   # not started: parts stay queued
    entered: list[float] = []
    active: list[float] = []
    queued: list[tuple[object, list[float]]] = []
    real_noticing, real_submit = monitor.noticing, monitor.submit

    @contextmanager
    def noticing(after):
        entered.append(after)
        with real_noticing(after):
            active.append(after)
            try:
                yield
            finally:
                active.pop()

    def submit(item):
        queued.append((item.path, list(active)))
        return real_submit(item)

    monitor.noticing, monitor.submit = noticing, submit
    watcher = DirectoryWatcher(monitor, [run]).start()
    try:
        eventually(lambda: entered, what="the watcher's first batch (it follows changes now)")
        write_parts(run, parts)
        names = {p.name for p in run.glob("rank-*.parquet")}
        eventually(lambda: {Path(p).name for p, _ in queued} >= names, what="every part queued")
        for path, batches in queued:
            assert batches, f"{path} was queued outside a watcher's batch"
            # file times come from the kernel's coarse clock (a tick behind time.time())
            assert batches[-1] <= os.stat(path).st_ctime + 0.02, (path, batches)
    finally:
        watcher.stop()
        store.close()


def test_links_out_of_the_watched_folder_are_refused_once_and_links_inside_followed(tmp_path):
    # a run's file linked to a file elsewhere (a part, a meta.json) was read and stored: the
    # monitor reads only what lies under the folders it was told to watch
    from stragglers.monitor.ingest_files import DirectoryWatcher
    from stragglers.monitor.service import Monitor
    from stragglers.monitor.store import open_store
    root, outside = tmp_path / "runs", tmp_path / "elsewhere"
    run, other = root / "job-l", root / "job-m"
    trace = slow_job(steps=10)
    parts = parts_of(trace, 5)
    start_run(run, trace)
    write_parts(run, [p for p in parts if p[1] > 0])
    first = [p for p in parts if p[1] == 0]
    write_parts(outside, first)
    for rank, part, _ in first:   # rank 0's part links inside the root, the others out
        name = f"rank-{rank:05d}.part-{part:06d}.parquet"
        target = (root / "kept" / name) if rank == 0 else (outside / name)
        if rank == 0:
            target.parent.mkdir(exist_ok=True)
            (outside / name).rename(target)
        (run / name).symlink_to(target)
    start_run(outside / "meta-run", trace)
    other.mkdir()
    (other / "meta.json").symlink_to(outside / "meta-run" / "meta.json")
    store = open_store(tmp_path / "mon.db", durable=False)
    monitor = Monitor(store, FAST.replace(rescan_s=3600)).start()
    try:
        watcher = DirectoryWatcher(monitor, [root])
        for _ in range(3):
            watcher.scan()
            assert monitor.wait_idle(120)
        links = [r for r in monitor.recent_rejects if "outside the watched folder" in r["problem"]]
        assert sorted((r["reason"], r["source"].rsplit("/", 2)[-2]) for r in links) == \
            [("bad_meta", "job-m")] + [("bad_part", "job-l")] * (len(first) - 1)
        assert store.totals()["by_way"]["files"].parts == len(parts) - len(first) + 1
        assert store.job("job-m") is None
        # the link replaced by the file itself: taken on the next scan
        for rank, part, cols in first[1:]:
            (run / f"rank-{rank:05d}.part-{part:06d}.parquet").unlink()
        write_parts(run, first[1:])
        watcher.scan()
        assert monitor.wait_idle(120)
        assert store.totals()["by_way"]["files"].parts == len(parts)
    finally:
        monitor.stop()
        store.close()


def test_a_part_swapped_for_a_link_out_after_its_name_was_checked_is_refused(tmp_path,
                                                                           monkeypatch):
    # the name was checked (a regular file inside the watched folder) and the open followed
    # whatever lay there by then: a link swapped in between led out of the folder and was
    # read. The attacker wins the race here for certain: the swap runs right after the check.
    from stragglers.monitor.ingest_files import DirectoryWatcher
    from stragglers.monitor.service import Monitor
    from stragglers.monitor.store import open_store
    root, outside = tmp_path / "runs", tmp_path / "elsewhere"
    run = root / "job-r"
    trace = slow_job(steps=10)
    parts = parts_of(trace, 5)
    start_run(run, trace)
    write_parts(run, parts)
    write_parts(outside, parts)   # the same parts, outside: valid Parquet the swap leads to
    swapped = []
    checked = DirectoryWatcher._escapes

    def check_then_swap(self, path):
        got = checked(self, path)
        if got is None and path.name.startswith("rank-00001.") and path.name != "meta.json":
            path.unlink()
            path.symlink_to(outside / path.name)
            swapped.append(path.name)
        return got

    monkeypatch.setattr(DirectoryWatcher, "_escapes", check_then_swap)
    store = open_store(tmp_path / "mon.db", durable=False)
    monitor = Monitor(store, FAST.replace(rescan_s=3600)).start()
    try:
        watcher = DirectoryWatcher(monitor, [root])
        watcher.scan()
        assert monitor.wait_idle(120)
        assert sorted(swapped) == sorted(f"rank-00001.part-{p:06d}.parquet" for p in (0, 1))
        refused = sorted(r["source"].rsplit("/", 1)[-1] for r in monitor.recent_rejects
                         if "outside the watched folder" in r["problem"])
        assert refused == sorted(swapped)
        assert store.totals()["by_way"]["files"].parts == len(parts) - 2
        assert not store.has_part("job-r", 1, 0) and store.has_part("job-r", 0, 0)
    finally:
        monitor.stop()
        store.close()


def test_a_link_swapped_in_after_a_part_was_stored_is_not_read_by_its_window(tmp_path):
    # a stored part's rows are read again by its window (in the analysis process): the file
    # is judged where it is opened there too, not only at ingest
    from stragglers.monitor.parts import read_part_files
    root, outside = tmp_path / "runs", tmp_path / "elsewhere"
    trace = slow_job(steps=4)
    parts = [p for p in parts_of(trace, 4) if p[0] == 0]
    write_parts(root / "job", parts)
    write_parts(outside, parts)
    (root / "kept").mkdir()
    name = "rank-00000.part-000000.parquet"
    (root / "kept" / name).symlink_to(root / "job" / name)
    inside = read_part_files([root / "kept" / name], within=[str(root)])
    assert not isinstance(inside[0], InputError), inside   # a link inside is followed
    (root / "job" / name).unlink()
    (root / "job" / name).symlink_to(outside / name)
    got = read_part_files([root / "job" / name], within=[str(root)])
    assert isinstance(got[0], InputError) and "outside the watched folder" in got[0].problem


@pytest.mark.slow
def test_a_watched_backlog_is_queued_before_the_watch_is_built_and_caught_up_after(
        tmp_path, monkeypatch):
    # the first scan waited for the watch child's first batch (~1.5 s of a 2.3 s backlog's
    # ingest); it runs at once now, inside `noticing`, and once the watch is built a scan
    # again finds a part written in between (no event of it ever comes). Here the child's
    # start waits on the test's event, and the wait for it on no clock.
    import threading
    from contextlib import contextmanager

    from stragglers.monitor import ingest_files
    from stragglers.monitor.ingest_files import DirectoryWatcher
    from stragglers.monitor.service import Monitor
    from stragglers.monitor.store import open_store
    monkeypatch.setattr(ingest_files, "FIRST_BATCH_WAIT_S", 3600.0)
    release = threading.Event()
    real_follow = DirectoryWatcher._follow_child

    def held(self, catch_up=False):
        release.wait(300)
        return real_follow(self, catch_up)

    monkeypatch.setattr(DirectoryWatcher, "_follow_child", held)
    run = tmp_path / "job-b"
    trace = slow_job(steps=10)
    parts = parts_of(trace, 5)
    start_run(run, trace)
    write_parts(run, [p for p in parts if p[1] == 0])
    store = open_store(tmp_path / "mon.db", durable=False)
    monitor = Monitor(store, FAST.replace(rescan_s=3600))   # not started: parts stay queued
    active: list[float] = []
    queued: list[tuple[str, list[float]]] = []
    real_noticing, real_submit = monitor.noticing, monitor.submit

    @contextmanager
    def noticing(after):
        with real_noticing(after):
            active.append(after)
            try:
                yield
            finally:
                active.remove(after)

    def submit(item):
        queued.append((item.path.name, list(active)))
        return real_submit(item)

    monitor.noticing, monitor.submit = noticing, submit
    watcher = DirectoryWatcher(monitor, [run]).start()
    try:
        first = {p.name for p in run.glob("rank-*.parquet")}
        eventually(lambda: {n for n, _ in queued} >= first,
                   what="the backlog queued while the watch is not built")
        assert monitor.scanning()
        write_parts(run, [p for p in parts if p[1] == 1])
        release.set()
        names = {p.name for p in run.glob("rank-*.parquet")}
        eventually(lambda: {n for n, _ in queued} >= names and not monitor.scanning(),
                   what="the parts written before the watch was built queued by a scan")
        assert sorted(n for n, _ in queued) == sorted(names)   # each once
        assert all(batches for _, batches in queued), queued   # each inside `noticing`
    finally:
        release.set()
        watcher.stop()
        store.close()
