"""Review of session 47 (hR): the window last-step bound on ranks whose clocks are apart; a new
job's first meta not paced as a change; /health's stuck reads counting the window readers.
Real trackers and the engine's real analysis; real servers on loopback."""

from __future__ import annotations

import numpy as np
import pytest

from monitor_jobs import parts_of, slow_job
from stragglers.monitor.windows import JobTracker, analyse_window


def skewed_parts(shift: dict[int, float], steps: int = 12, per_part: int = 1,
                 poison: float = 0.0):
    """A dp2 x pp2 job's parts, each rank's timestamps moved by shift[rank] s (clocks not
    aligned); rank 3's latest op of step 4 lasts `poison` s where given."""
    trace = slow_job(steps=steps, slow=None)
    parts = []
    for rank, n, cols in parts_of(trace, per_part):
        cols = {k: v.copy() for k, v in cols.items()}
        if poison and rank == 3 and (cols["step"] == 4).any():
            end = cols["start_ts"] + cols["duration"]
            cols["duration"][int(np.argmax(np.where(cols["step"] == 4, end, -np.inf)))] = poison
        cols["start_ts"] = cols["start_ts"] + shift.get(rank, 0.0)
        parts.append((rank, n, cols))
    return trace, parts


@pytest.mark.parametrize("skew", [5.0, -5.0])
def test_a_rank_whose_clock_is_seconds_off_keeps_every_windows_last_step(skew):
    # (hR_skew.py: rank 3 +5 s refused step 4 and step 9, every window's last step, before)
    trace, parts = skewed_parts({3: skew})
    tracker = JobTracker("j", trace.meta, window_steps=5, gap_wait_s=0.0)
    for rank, n, cols in parts:
        tracker.add_part(rank, n, int(cols["step"].max()), cols, 1.0)
    windows = tracker.close_ready(2.0)
    assert [w.steps for w in windows] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    for w in windows:
        row, refused = analyse_window(w)
        assert row.error is None, row.error
        assert refused == [], refused
        assert row.steps == w.steps


@pytest.mark.parametrize("shift", [{3: -5.0}, {0: 5.0, 1: 5.0}, {}])
def test_one_poisoned_op_is_still_caught_with_clocks_apart_and_its_step_not_listed(shift):
    # parts of 5 steps, the window cut the moment rank 3's part 0 came (no step after known):
    # the op of 3,000 s is judged by the others' spans, whatever their clocks
    trace, parts = skewed_parts(shift, steps=6, per_part=5, poison=3000.0)
    tracker = JobTracker("j", trace.meta, window_steps=5, gap_wait_s=0.5)
    for rank, n, cols in [p for p in parts if p[1] == 0]:
        tracker.add_part(rank, n, int(cols["step"].max()), cols, 1.0)
    assert tracker.close_ready(1.1) == []   # (held for the others' step after)
    window = tracker.close_partial("finished", 2.0)
    row, refused = analyse_window(window)
    assert row.error is None, row.error
    assert row.slowdown < 1.5, row.slowdown
    assert [source for source, _ in refused] == ["job j rank 3"], refused
    assert refused[0][1].startswith("step 4: an op of 3000 s ends"), refused
    # (the row listed step 4 as analysed before)
    assert (row.first_step, row.last_step, row.steps) == (0, 4, [0, 1, 2, 3])


TOKEN = "round47-review-token-0123456789abc"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def paced_server(tmp_path, monkeypatch):
    import stragglers.monitor.ingest_http as ingest_http
    from stragglers.monitor.server import MonitorServer
    from stragglers.monitor.settings import MonitorConfig

    # (one writer off loopback: every request from one address, as a launcher host's; a
    # refusal answered after 0.05 s; another job uploading for the whole test)
    monkeypatch.setattr(ingest_http, "quota_client", lambda host: "192.0.2.7")
    monkeypatch.setattr(ingest_http, "META_CHANGE_MAX_WAIT_S", 0.05)
    monkeypatch.setattr(ingest_http, "META_ACTIVE_S", 3600.0)
    cfg = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05,
                        meta_changes_per_minute=0.1)
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=cfg).start()
    try:
        yield s
    finally:
        s.stop()


def test_new_jobs_first_metas_are_not_paced_as_changes(paced_server):
    import httpx

    from stragglers.trace.runformat import table_bytes

    trace = slow_job(steps=5)
    meta = trace.meta.to_dict()
    with httpx.Client(base_url=paced_server.url, timeout=60, headers=AUTH) as c:
        assert c.put("/api/jobs/up/meta", json=meta).status_code == 200
        rank, part, cols = parts_of(trace, 5)[0]
        r = c.put(f"/api/jobs/up/ranks/{rank}/parts/{part}", content=table_bytes(cols))
        assert r.status_code == 200, r.text
        # 8 new jobs from the same writer while "up" uploads: creations, not changes (before:
        # 4 taken, then 429 for the change pace)
        answers = [c.put(f"/api/jobs/new{i}/meta", json=meta).status_code for i in range(8)]
        assert answers == [200] * 8, answers
        # changes are still paced, and the creations took none of the writer's turns
        changed = []
        for i in range(5):
            meta["extra"]["note"] = f"change {i}"
            changed.append(c.put("/api/jobs/new0/meta", json=meta).status_code)
        assert changed == [200] * 4 + [429], changed


HANG = 60   # seconds: only a hang waits this long


@pytest.fixture
def hanging_window(tmp_path):
    """A 4-rank job's window of steps 0..3 read from part files, rank 1's hanging on read
    (its footer read before); a second job's window of readable files. Yields (window,
    other_window, StuckFile)."""
    import os

    from stragglers.monitor.parts import read_part_footer
    from stragglers.trace.runformat import rank_file_name
    from monitor_jobs import write_parts
    from test_stuck_watched_file import StuckFile

    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("needs root and /dev/fuse to mount a FUSE file whose reads hang")
    windows = []
    for name, timeout in (("hung", 1.0), ("other", 30.0)):
        trace = slow_job(steps=4)
        parts = parts_of(trace, steps_per_part=4)
        (tmp_path / name).mkdir()
        write_parts(tmp_path / name, parts)
        tracker = JobTracker(name, trace.meta, window_steps=4, gap_wait_s=0.0,
                             read_timeout_s=timeout)
        for rank, part, _ in parts:
            f = read_part_footer(tmp_path / name / rank_file_name(rank, part))
            assert tracker.add_part(rank, part, f.last_step, None, 1.0, f)
        [w] = tracker.close_ready(2.0)
        windows.append(w)
    stuck = StuckFile(tmp_path / "hung" / rank_file_name(1, 0))
    try:
        yield windows[0], windows[1], stuck
    finally:
        stuck.close()


def test_health_counts_a_stuck_window_read_and_each_tracker_keeps_its_timeout(
        hanging_window, tmp_path):
    import threading

    import httpx

    from conftest import eventually
    from stragglers.monitor import windows
    from stragglers.monitor.server import MonitorServer

    hung, other, fuse = hanging_window
    server = MonitorServer(tmp_path / "mon.db", port=0).start()
    try:
        with httpx.Client(base_url=server.url, timeout=HANG) as c:
            got = []
            t = threading.Thread(target=lambda: got.append(analyse_window(hung)), daemon=True)
            t.start()
            assert fuse.held.wait(HANG), "the window never read the hanging file"
            # another tracker's window read (30 s) while the first one's (1 s) is held: it set
            # the shared readers' timeout, and the held read waited 30 s, not 1
            row, refused = analyse_window(other)
            assert row.error is None and refused == [], (row.error, refused)
            t.join(15.0)
            assert got, "the hung read waited past its tracker's read_timeout_s (1 s)"
            row, refused = got[0]
            assert row.missing_ranks == [1], row
            assert "has not returned" in refused[0][1], refused
            # /health counts the window's stuck read (said 0 before: the monitor's own only,
            # and this monitor reads no file; other tests' stuck reads may be counted too)
            hung_file = str(hung.files[1].path)
            assert hung.files[1].rank == 1 and hung_file in windows.stuck_window_reads()
            assert not server.monitor.file_readers.stuck
            assert c.get("/health").json()["stuck_reads"] >= 1
            assert windows._readers().timeout_s == windows.READ_TIMEOUT_S   # (not rewritten)
            fuse.close()   # (the server gone: the held read fails and returns)
            eventually(lambda: hung_file not in windows.stuck_window_reads(), HANG,
                       what="the window readers no longer holding it")
    finally:
        server.stop()


def test_a_window_with_its_last_step_left_out_still_says_its_window_steps():
    from stragglers.monitor.app import _window_steps
    from stragglers.monitor.records import WindowRow

    row = WindowRow(job="j", idx=0, first_step=0, last_step=4, steps=[0, 1, 2, 3],
                    reason="complete")
    assert _window_steps(row, 10) == 5
    row.steps = [0, 1, 2, 3, 4]
    assert _window_steps(row, 10) == 5
