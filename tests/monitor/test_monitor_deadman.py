"""The dead-man (a job or a rank that stops sending) decides at its deadline: the tick thread
wakes at stall_after_s after the quietest part, not at its next tick, silence counts from when
a part was queued (not when its batch was stored), and a stall with nothing of its job on the
analysis queue is stored on the tick thread at once. Times are given, never waited for."""

from __future__ import annotations

import time

import pytest

from monitor_jobs import slow_job
from stragglers.monitor.service import Monitor, PartIn
from stragglers.monitor.settings import MonitorConfig
from stragglers.monitor.store import open_store
from stragglers.trace.runformat import rank_file_name, write_rank

STALL, TICK = 10.0, 2.0


@pytest.fixture
def monitor(tmp_path):
    """A monitor not started (no thread runs: the test calls what the threads call), with job
    `j` (dp 2 × pp 2) registered and its step-0 parts written in its run directory."""
    store = open_store(str(tmp_path / "mon.db"))
    mon = Monitor(store, MonitorConfig(window_steps=1, stall_after_s=STALL, tick_s=TICK,
                                       change_detector=False), data_dir=tmp_path / "up")
    trace = slow_job(steps=3, dp=2, pp=2, slow=None)
    run = tmp_path / "runs" / "j"
    for rank in range(trace.meta.world_size):
        for step in range(3):
            sel = (trace.ops["rank"] == rank) & (trace.ops["step"] == step)
            write_rank(run, rank, {k: v[sel] for k, v in trace.ops.items()}, part=step)
    mon.leases.beat()
    mon.register_job("j", run, "files", trace.meta.to_dict())
    mon.run = run
    yield mon
    mon.stop()
    store.close()


def feed(mon: Monitor, step: int, ranks, queued_ago: float = 0.0) -> None:
    """Parts of `step` of these ranks, queued `queued_ago` seconds ago, through one batch; the
    windows they close taken off the analysis queue as if analysed."""
    at = time.monotonic() - queued_ago
    mon._ingest_batch([PartIn("j", r, step, "files", path=mon.run / rank_file_name(r, step),
                              queued_at=at) for r in ranks])
    while not mon._analysis.empty():
        mon._unqueued(mon._analysis.get_nowait())


def test_silence_counts_from_when_a_part_was_queued_not_when_it_was_stored(monitor):
    feed(monitor, 0, range(4), queued_ago=5.0)
    tr = monitor.trackers["j"]
    # stored now, queued 5 s ago: the job has been quiet for 5 s already
    assert tr.last_arrival <= time.time() - 5.0
    assert all(tr.ranks[r].last_arrival <= time.time() - 5.0 for r in range(4))


def test_the_tick_thread_wakes_at_the_dead_man_deadline_not_at_its_next_tick(monitor):
    feed(monitor, 0, range(4))
    tr = monitor.trackers["j"]
    heard = tr.last_arrival
    assert monitor.silence_deadline(heard) == pytest.approx(heard + STALL)
    # 0.3 s before the deadline the tick thread sleeps 0.3 s, not tick_s
    assert monitor.tick_wait(heard + STALL - 0.3) == pytest.approx(0.3, abs=2e-3)
    # far from it: tick_s
    assert monitor.tick_wait(heard + 1.0) == TICK
    # rank 3 falls behind: its own silence comes first
    feed(monitor, 1, range(3))
    quiet = tr.ranks[3].last_arrival
    assert monitor.silence_deadline(quiet) == pytest.approx(quiet + STALL)
    # past every deadline (decided, or waiting for the ingest to catch up): the tick's pace
    assert monitor.silence_deadline(tr.last_arrival + STALL + 1) is None
    assert monitor.tick_wait(tr.last_arrival + STALL + 1) == TICK


def test_the_tick_loop_sleeps_until_the_deadline(monitor):
    feed(monitor, 0, range(4), queued_ago=STALL - 1.0)   # the job's deadline: 1 s from now
    waits = []

    class Stop:
        def wait(self, timeout):
            waits.append(timeout)
            return True   # the loop ends after its first sleep

    stop, monitor._stop = monitor._stop, Stop()
    monitor._tick_loop()
    monitor._stop = stop
    assert 0 < waits[0] <= 1.0 + 2e-3   # not tick_s (2 s)


def test_a_stall_is_stored_by_the_tick_itself_when_its_job_has_nothing_queued(monitor):
    feed(monitor, 0, range(4))
    deadline = monitor.trackers["j"].last_arrival + STALL
    monitor.tick(deadline - 0.01)
    assert monitor.states["j"] == "running"
    monitor.tick(deadline)
    # no analysis thread runs: the state and the `stalled` alert were stored by tick()
    assert monitor.states["j"] == "stalled"
    assert monitor.store.job("j").state == "stalled"
    assert [a.rule for a in monitor.store.alerts(job="j", status="firing")] == ["stalled"]
    assert monitor._analysis.empty()


def test_a_stall_behind_its_jobs_queued_windows_keeps_their_order(monitor):
    feed(monitor, 0, range(4))
    monitor._queue_analysis(("j", "running"))   # something of the job not analysed yet
    monitor.tick(monitor.trackers["j"].last_arrival + STALL)
    assert monitor.states["j"] == "stalled"
    assert monitor.store.job("j").state == "running"   # queued behind it, not stored yet
    assert [monitor._analysis.get_nowait(), monitor._analysis.get_nowait()] == \
        [("j", "running"), ("j", "stalled")]


def test_a_stall_decided_on_the_tick_is_dropped_once_parts_came_again(monitor):
    feed(monitor, 0, range(4))
    monitor.states["j"] = "running"   # parts came after the stall was decided
    monitor._state_changed("j", "stalled", current=True)
    assert monitor.store.job("j").state == "running"
    assert not monitor.store.alerts(job="j", status="firing")
