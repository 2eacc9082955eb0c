"""A window says what its analysis changed of its rows (`notes`): a rank whose clock was moved
onto the others' (monitor/clocks.py) was only logged, so a user saw a healthy S and no sign
why. Stored with the window (SQLite and PostgreSQL alike, a store from before gains the
column), served in the job's windows API and shown with the window on the dashboard."""

from __future__ import annotations

import sqlite3

import msgspec
import numpy as np
import pytest
from pg_cluster import postgres_cluster, postgres_url  # noqa: F401 - fixtures

from conftest import REPO, eventually
from monitor_jobs import get, parts_of, serving_job, slow_job
from stragglers.monitor.records import WindowRow
from stragglers.monitor.settings import MonitorConfig
from stragglers.monitor.store import open_store
from stragglers.monitor.store_sqlite import SCHEMA
from stragglers.monitor.windows import MAX_NOTES, clock_notes
from stragglers.trace.model import Trace
from stragglers.trace.runformat import table_bytes

TOKEN = "window-notes-token-0123456789abcdef"
MOVED = "rank 3: its clock was moved by -50000 s in steps 0-4 ("


def test_a_window_whose_ranks_clock_was_moved_says_so_in_its_api(tmp_path):
    # a healthy 2x2 job with rank 3's clock 5e4 s ahead: analysed as on one clock (S ~1.007)
    # and, before, nothing in the window said rank 3's starts were moved
    trace = slow_job(steps=10, slow=None)
    o = {k: v.copy() for k, v in trace.ops.items()}
    o["start_ts"][o["rank"] == 3] += 5e4
    config = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05)
    with serving_job(tmp_path / "mon.db", Trace(o, trace.meta, trace.source), TOKEN,
                     config) as c:
        for rank, n, cols in parts_of(Trace(o, trace.meta, trace.source), 5):
            r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols))
            assert r.status_code == 200, r.text
        eventually(lambda: get(c, "/api/jobs/j?history=10")["windows_total"] >= 2,
                   what="windows 0-1")
        first = get(c, "/api/jobs/j/windows/0")
        assert first["slowdown"] < 1.05, first["slowdown"]
        assert [n[:len(MOVED)] for n in first["notes"]] == [MOVED], first["notes"]
        second = get(c, "/api/jobs/j/windows/1")
        assert second["notes"] == [MOVED.replace("0-4", "5-9")[:len(MOVED)]
                                   + second["notes"][0][len(MOVED):]], second["notes"]
    # the dashboard shows them with the window
    js = (REPO / "src/stragglers/monitor/static/dashboard.js").read_text()
    assert "win.notes" in js


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.slow)])
def target(request, tmp_path):
    """A store's address: a SQLite file, or a PostgreSQL database (skipped where none runs)."""
    if request.param == "sqlite":
        return str(tmp_path / "mon.db")
    return request.getfixturevalue("postgres_url")


def window(idx: int, notes: list[str]) -> WindowRow:
    return WindowRow(job="j", idx=idx, first_step=idx * 5, last_step=idx * 5 + 4,
                     steps=list(range(idx * 5, idx * 5 + 5)), slowdown=1.0, notes=notes)


def test_notes_are_stored_with_their_window_and_read_back(target):
    store = open_store(target)
    try:
        store.register_job("j", "/nowhere/j", "http", {"dp_size": 1, "pp_size": 1})
        assert store.add_window(window(0, ["rank 1: moved"]), [], []) is True
        assert store.add_window(window(1, []), [], []) is True
        assert store.window("j", 0).notes == ["rank 1: moved"]
        assert store.window("j", 1).notes == []
        assert [w.notes for w in store.recent_windows("j", 2)] == [[], ["rank 1: moved"]]
    finally:
        store.close()


def test_a_store_from_before_notes_gains_the_column_and_its_windows_read_none(tmp_path):
    # the windows table as stores before this change made it (no notes column)
    old = SCHEMA.replace(" notes TEXT NOT NULL DEFAULT '[]',", "")
    assert old != SCHEMA
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript(old)
    db.execute("INSERT INTO windows (job, idx, first_step, last_step, steps, scores, diagnosis, "
               "missing_ranks, reason, closed_at, analysed_at, analysis_s) VALUES "
               "('j', 0, 0, 4, '[0,1,2,3,4]', '[]', '[]', '[]', 'complete', 1, 2, 0.1)")
    db.commit()
    db.close()
    store = open_store(str(path))
    try:
        assert store.window("j", 0).notes == []
        assert store.add_window(window(1, ["rank 0: moved"]), [], []) is True
        assert store.window("j", 1).notes == ["rank 0: moved"]
    finally:
        store.close()


def test_a_thousand_ranks_moved_are_at_most_max_notes_lines():
    moved = {(r, s): 7.0 for r in range(1000) for s in range(3)}
    lines = clock_notes(moved)
    assert len(lines) == MAX_NOTES, len(lines)
    assert lines[0].startswith("rank 0: its clock was moved by -7 s in steps 0-2 ("), lines[0]
    assert lines[-1].startswith(f"{1000 - MAX_NOTES + 1} more ranks' clocks"), lines[-1]
    assert len(msgspec.json.encode(lines)) < 16_000
    # offsets that differ between steps: the largest named
    assert "by +2 s at most in steps 4-5" in clock_notes({(2, 4): -1.0, (2, 5): -2.0})[0]


def test_a_long_windows_moved_steps_stay_a_short_line():
    """A rank moved in every step of a 2,000-step window is one range; moved in every other
    step, its list is cut and counted, so no line nears the read-back cut (NOTE_CHARS)."""
    whole = clock_notes({(1, s): 3.0 for s in range(2000)})[0]
    assert "in steps 0-1999 (" in whole, whole
    scattered = clock_notes({(1, s): 3.0 for s in range(0, 4000, 2)})[0]
    assert "… (2000 in all)" in scattered and len(scattered) < 700, scattered



def test_rows_cut_to_their_workers_own_timeline_are_named_in_the_window():
    """A healthy 2x2 job whose rank 3's backward-sends start 0.05 s before the compute that
    feeds them (ends kept): the engine charges them from that compute's end
    (whatif/timing.clip_to_own_timeline), and the window's notes say so (before, only the
    engine's warnings held it: the window named nothing)."""
    import time

    from stragglers.trace.synth import generate
    from stragglers.trace.model import OPTYPE_CODES
    from stragglers.monitor.windows import Window, analyse_window

    t = generate(dp=2, pp=2, microbatches=4, steps=4, seed=0)
    o = {k: v.copy() for k, v in t.ops.items()}
    early = (o["rank"] == 3) & (o["optype"] == OPTYPE_CODES["backward-send"])
    o["start_ts"][early] -= 0.05
    o["duration"][early] += 0.05
    row, _ = analyse_window(Window("j", 0, list(range(4)), Trace(o, t.meta, t.source),
                                   missing_ranks=[], closed_at=time.time()))
    assert row.error is None, row.error
    assert any(n.startswith("rows cut to their worker's own timeline") for n in row.notes), \
        row.notes


def test_a_workers_computes_left_out_of_the_ideal_are_named_in_the_window():
    """A healthy 2x2 job whose rank 3 writes its computes as 0 s: the engine leaves its
    computes out of the ideal (whatif/metrics.py, nobody waits on its gaps) and the window's
    notes say so (before: only in the engine's warnings)."""
    import time

    from stragglers.monitor.windows import Window, analyse_window
    from stragglers.trace.model import OPTYPE_CODES
    from stragglers.trace.synth import generate

    t = generate(dp=2, pp=2, microbatches=4, steps=4, seed=0)
    o = {k: v.copy() for k, v in t.ops.items()}
    work = (o["rank"] == 3) & np.isin(o["optype"], [OPTYPE_CODES[n] for n in (
        "forward-compute", "backward-compute", "optimizer")])
    o["duration"][work] = 0.0
    row, _ = analyse_window(Window("j", 0, list(range(4)), Trace(o, t.meta, t.source),
                                   missing_ranks=[], closed_at=time.time()))
    assert row.error is None, row.error
    assert any(n.startswith("computes of worker (dp ") and "left out of the ideal" in n
               for n in row.notes), row.notes


def test_a_left_out_worker_with_no_rows_is_named_by_its_place():
    """A worker the engine left out that sent no rows has no rank: the note read "rank(s)  ran
    ops unlike their stage peers'" (an empty list); it names its place instead."""
    from stragglers.monitor.windows import left_out_note
    from stragglers.whatif.result import LeftOut

    note = left_out_note([LeftOut(1, 1, None, missing=["its rows or its compute"]),
                          LeftOut(1, 0, 1, reason="replica")])
    assert "worker(s) (dp 1, pp 1) ran ops unlike" in note, note
    assert "rank(s)  " not in note and "replicas' rank(s) 1 with them" in note, note
