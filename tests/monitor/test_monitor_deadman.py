"""The dead-man (a job or a rank that stops sending) decides at its deadline: the tick thread
wakes at stall_after_s after the quietest part, not at its next tick; silence counts from when
a part was written (a watched file's ctime, clamped to file_time_slack_s before its notice) or
queued, not when its batch was stored; a part in flight at the deadline defers the decision
until it landed; a stall is stored on the tick thread at once, whatever waits for the analysis
thread, in one transaction whose message is claimed and handed to the outbox's urgent sender.
Times are given, never waited for."""

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


def feed(mon: Monitor, step: int, ranks, queued_ago: float = 0.0,
         written_ago: float | None = None) -> None:
    """Parts of `step` of these ranks, queued `queued_ago` seconds ago (their files written
    `written_ago` seconds ago: no file time when None), through one batch; the windows they
    close taken off the analysis queue as if analysed."""
    at = time.monotonic() - queued_ago
    written = None if written_ago is None else time.time() - written_ago
    mon._ingest_batch([PartIn("j", r, step, "files", path=mon.run / rank_file_name(r, step),
                              queued_at=at, written_at=written) for r in ranks])
    drain(mon)


def within(t: float, low: float, high: float) -> bool:
    """low <= t <= high, give or take the monotonic → wall clock conversion (a bound from
    before and after the call: under load the call itself took more than 50 ms)."""
    return low - 0.002 <= t <= high + 0.002


def drain(mon: Monitor) -> list:
    """What the analysis queue held, taken off it as if analysed."""
    out = []
    while not mon._analysis.empty():
        out.append(mon._analysis.get_nowait())
        mon._count(-1)
    return out


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


def test_a_silence_held_back_by_another_instances_mark_is_looked_at_when_that_mark_is_due(
        monitor):
    # (a shared store) another instance's last mark was written 0.5 s before the deadline:
    # its next, a tick later, lets the silence go; the holder looked again only a whole tick
    # after its own check, so the silence was decided up to two ticks late
    from stragglers.monitor.records import IngestMark
    feed(monitor, 0, range(4))
    deadline = monitor.trackers["j"].last_arrival + STALL
    now = deadline + 0.1   # (the holder's tick at the deadline)
    monitor._marks = [IngestMark("B", deadline - 0.5, None)]
    assert not monitor.settled_elsewhere(deadline)
    due = deadline - 0.5 + TICK   # B's next mark
    assert monitor.tick_wait(now) == pytest.approx(due - now + TICK / 10, abs=2e-3)
    # B late by less than a tick (its tick under way): looked at every tenth of a tick
    assert monitor.tick_wait(due + 0.5) == pytest.approx(TICK / 10, abs=2e-3)
    # B later than that (stuck): the tick's pace (left out after lease_s)
    assert monitor.tick_wait(due + TICK + 0.5) == TICK
    # a tick that holds nothing back: the tick's pace again
    monitor.tick(now + 1.0)
    assert monitor.tick_wait(now + 1.0) == TICK


def test_the_tick_loop_sleeps_until_the_deadline(monitor):
    feed(monitor, 0, range(4), queued_ago=STALL - 1.0)   # the job's deadline: 1 s from now
    waits = []

    class Wake:
        def wait(self, timeout):
            waits.append(timeout)
            monitor._stop.set()   # the loop ends after its first sleep

        def clear(self):
            pass

    wake, monitor._tick_wake = monitor._tick_wake, Wake()
    monitor._tick_loop()
    monitor._tick_wake = wake
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


def test_a_stall_is_stored_at_once_even_with_its_jobs_windows_queued(monitor):
    feed(monitor, 0, range(4))
    feed(monitor, 1, range(2))   # step 1 half there: the stall closes a partial window
    monitor._queue_analysis(("j", "running"))   # and something of the job not analysed yet
    monitor.tick(monitor.trackers["j"].last_arrival + STALL)
    # stored by the tick, not behind the analysis queue (it waited ~0.14 s behind a partial
    # window of 64 ranks, measured)
    assert monitor.store.job("j").state == "stalled"
    assert [a.rule for a in monitor.store.alerts(job="j", status="firing")] == ["stalled"]
    queued = drain(monitor)
    assert queued[0] == ("j", "running")
    assert [(w.reason, w.steps) for w in queued[1:]] == [("stalled", [1])]
    # the older `running`, analysed after the stall was decided, does not undo it
    monitor._state_changed(*queued[0], current=True)
    assert monitor.store.job("j").state == "stalled"


def test_a_stall_decided_on_the_tick_is_dropped_once_parts_came_again(monitor):
    feed(monitor, 0, range(4))
    monitor.states["j"] = "running"   # parts came after the stall was decided
    monitor._state_changed("j", "stalled", current=True)
    assert monitor.store.job("j").state == "running"
    assert not monitor.store.alerts(job="j", status="firing")


# ---- silence from the write (file_time_slack_s) ----------------------------------------------

def test_silence_counts_from_the_files_write_when_it_lies_within_the_slack(monitor):
    # noticed now, written 0.4 s before (the watcher's and the ingest's delays): counted
    # from the write, so the deadline does not carry those delays
    before = time.time()
    feed(monitor, 0, range(4), written_ago=0.4)
    assert within(monitor.trackers["j"].last_arrival, before - 0.4, time.time() - 0.4)


def test_a_file_time_far_before_the_notice_moves_silence_by_the_slack_only(monitor):
    # a writer (or file server) clock 1 h behind: at most file_time_slack_s earlier
    slack = monitor.config.file_time_slack_s
    before = time.time()
    feed(monitor, 0, range(4), written_ago=3600.0)
    assert within(monitor.trackers["j"].last_arrival, before - slack, time.time() - slack)


def test_a_file_time_after_the_notice_is_not_trusted(monitor):
    # a clock ahead: never later than the notice (it would hide a silence)
    before = time.time()
    feed(monitor, 0, range(4), queued_ago=2.0, written_ago=-60.0)
    assert within(monitor.trackers["j"].last_arrival, before - 2.0, time.time() - 2.0)


def test_submit_takes_a_watched_files_ctime(monitor):
    path = monitor.run / rank_file_name(0, 0)
    item = PartIn("j", 0, 0, "files", path=path)
    monitor.submit(item)
    assert item.written_at == path.stat().st_ctime
    upload = PartIn("j", 0, 1, "http", body=b"PAR1")
    monitor.submit(upload)
    assert upload.written_at is None   # an upload arrives when its body was read


# ---- parts in flight at the deadline ---------------------------------------------------------

def test_a_part_in_flight_at_the_deadline_defers_the_stall_until_it_landed(monitor):
    # a job just slow: its next part, written (and noticed) 0.5 s before the deadline, is in
    # the ingest at the deadline
    feed(monitor, 0, range(4), queued_ago=STALL - 0.5)
    deadline = monitor.trackers["j"].last_arrival + STALL
    late = [PartIn("j", r, 1, "files", path=monitor.run / rank_file_name(r, 1))
            for r in range(4)]
    for it in late:
        monitor.submit(it)
    monitor.tick(deadline + 0.01)
    assert monitor.states["j"] == "running"     # not a false dead-man
    assert not monitor._tick_wake.is_set()
    batch = [monitor._ingest.get_nowait() for _ in late]
    monitor._ingest_batch(batch)
    monitor._landed(batch)
    assert monitor._tick_wake.is_set()          # the deferred decision is taken now
    monitor.tick(deadline + 0.02)
    assert monitor.states["j"] == "running"     # its part came in time
    assert monitor.store.job("j").state == "running"


def test_a_silent_job_stalls_once_its_refused_part_landed(monitor):
    feed(monitor, 0, range(4))
    deadline = monitor.trackers["j"].last_arrival + STALL
    junk = monitor.run / rank_file_name(0, 1)
    junk.write_bytes(b"not parquet")
    monitor.submit(PartIn("j", 0, 1, "files", path=junk))
    monitor.tick(deadline)
    assert monitor.states["j"] == "running"
    batch = [monitor._ingest.get_nowait()]
    monitor._ingest_batch(batch)
    monitor._landed(batch)
    monitor.tick(deadline + 0.01)
    assert monitor.states["j"] == "stalled"     # a refused part is no sign of life
    assert monitor.store.job("j").state == "stalled"


def test_a_rank_with_a_part_in_flight_is_not_called_silent(monitor):
    feed(monitor, 0, range(4))
    feed(monitor, 1, range(3))   # rank 3 behind the others
    quiet = monitor.trackers["j"].ranks[3].last_arrival
    monitor.submit(PartIn("j", 3, 1, "files", path=monitor.run / rank_file_name(3, 1),
                          written_at=quiet + STALL - 0.05))
    monitor.watchdog.check_silence(quiet + STALL + 0.01)
    assert not monitor.store.alerts(job="j", status="firing")
    assert monitor._deferred
    # without it in flight, the same moment is a silent rank
    batch = [monitor._ingest.get_nowait()]
    monitor._landed(batch)   # (refused, say: it never reached the tracker)
    monitor.watchdog.check_silence(quiet + STALL + 0.02)
    assert [(a.rule, a.labels.rank) for a in monitor.store.alerts(job="j", status="firing")] \
        == [("rank_silent", "3")]


# ---- the dead-man's own delivery path --------------------------------------------------------

def test_a_stalls_message_is_claimed_in_its_transaction_and_sent_at_once(monitor):
    feed(monitor, 0, range(4))
    monitor.tick(monitor.trackers["j"].last_arrival + STALL)
    [row] = monitor.store.outbox("j")
    assert row.claimed_by == monitor.instance and row.attempts == 1 and row.delivered_at is None
    [m] = [monitor.outbox._urgent.get_nowait()]
    assert (m.id, m.status, m.alert.rule) == (row.id, "firing", "stalled")
    # the poller does not claim it again while its claim runs
    assert monitor.store.claim_messages("other", 32, 30.0) == []


def test_a_dead_man_message_behind_an_unsent_one_of_its_alert_is_left_to_the_outbox(monitor):
    feed(monitor, 0, range(4))
    tr = monitor.trackers["j"]
    monitor.tick(tr.last_arrival + STALL)                 # stalled: firing, claimed
    monitor.outbox._urgent.get_nowait()
    feed(monitor, 1, range(4))
    monitor._state_changed("j", "running", current=True)   # resolved: in the outbox
    monitor.store.message_failed(monitor.store.outbox("j")[0].id, 5.0)   # firing not sent yet
    monitor.tick(tr.last_arrival + STALL)                 # stalled again
    assert monitor.outbox._urgent.empty()   # not sent before the older messages of its alert
    assert [r.claimed_by for r in monitor.store.outbox("j")] == [None, None, None]


@pytest.mark.slow
def test_the_urgent_sender_posts_to_a_real_receiver(monitor):
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    got, arrived = [], threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()
            arrived.set()

        def log_message(self, *args):
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        monitor.outbox.webhooks = [f"http://127.0.0.1:{http.server_address[1]}/"]
        feed(monitor, 0, range(4))
        monitor.outbox._urgent_thread = threading.Thread(target=monitor.outbox._run_urgent,
                                                         daemon=True)
        monitor.outbox._urgent_thread.start()
        monitor.tick(monitor.trackers["j"].last_arrival + STALL)
        assert arrived.wait(30)
        monitor.outbox.close()
        assert [a["labels"]["alertname"] for a in got[0]["alerts"]] == ["stalled"]
        [row] = monitor.store.outbox("j")
        assert row.delivered_by == monitor.instance
    finally:
        http.shutdown()


def test_a_watchers_batch_from_before_the_deadline_defers_it_until_handed_over(monitor):
    feed(monitor, 0, range(4), queued_ago=STALL + 1.0)   # quiet for 11 s already
    deadline = monitor.trackers["j"].last_arrival + STALL
    # events that came after the deadline cannot be the job's last part: no wait
    with monitor.noticing(after=deadline + 0.5):
        monitor.tick()
        assert monitor.states["j"] == "stalled"


def test_a_watchers_batch_that_may_hold_a_last_part_holds_the_stall(monitor):
    feed(monitor, 0, range(4), queued_ago=STALL + 1.0)
    deadline = monitor.trackers["j"].last_arrival + STALL
    with monitor.noticing(after=deadline - 0.2):   # a part written before the deadline may be
        monitor.tick()                              # in it, not queued yet
        assert monitor.states["j"] == "running"
        assert not monitor._tick_wake.is_set()
    assert monitor._tick_wake.is_set()   # decided once the batch was handed over
    monitor.tick()
    assert monitor.states["j"] == "stalled"   # it held none of the job's parts


# ---- deadlines that pass while a tick runs, landings between a check and its deferral -------

def test_a_deadline_that_passed_while_a_tick_ran_is_decided_at_once(monitor):
    # rank 3's last part 3 ms before the job's last: two deadlines 3 ms apart (a thousand
    # ranks' renames span a few ms of ctime)
    feed(monitor, 0, [3], queued_ago=STALL - 0.5)
    feed(monitor, 0, [0, 1, 2], queued_ago=STALL - 0.503)
    tr = monitor.trackers["j"]
    job_deadline = tr.last_arrival + STALL
    rank_deadline = tr.ranks[3].last_arrival + STALL
    assert job_deadline > rank_deadline
    monitor.tick(rank_deadline + 0.001)   # the tick for the earlier deadline ...
    assert monitor.states["j"] == "running"
    # ... ran past the job's deadline: the job's stall is decided now, not a tick_s later
    assert monitor.tick_wait(job_deadline + 0.002) == 0.0
    monitor.tick(job_deadline + 0.003)
    assert monitor.states["j"] == "stalled"
    # decided: no deadline left to wake for, the tick's own pace (no busy loop)
    assert monitor.tick_wait(job_deadline + 0.004) == TICK


def test_a_deferred_stall_does_not_spin_the_tick_thread(monitor):
    feed(monitor, 0, range(4), queued_ago=STALL - 0.5)
    deadline = monitor.trackers["j"].last_arrival + STALL
    monitor.submit(PartIn("j", 0, 1, "files", path=monitor.run / rank_file_name(0, 1)))
    monitor.tick(deadline + 0.01)
    assert monitor.states["j"] == "running"   # deferred over its part in flight
    # its wake is the landing, not the clock
    assert monitor.tick_wait(deadline + 0.02) == TICK


def test_a_batch_landing_between_the_check_and_the_deferral_wakes_the_tick(monitor):
    feed(monitor, 0, range(4), queued_ago=STALL - 0.5)
    deadline = monitor.trackers["j"].last_arrival + STALL
    junk = monitor.run / rank_file_name(0, 1)
    junk.write_bytes(b"not parquet")
    monitor.submit(PartIn("j", 0, 1, "files", path=junk))
    checked = monitor.in_flight

    def in_flight_then_landed(*args, **kwargs):
        # the part is seen in flight, then its batch lands before the tick defers: that
        # landing finds no deferral to wake
        seen = checked(*args, **kwargs)
        if seen and not monitor._ingest.empty():
            batch = [monitor._ingest.get_nowait()]
            monitor._ingest_batch(batch)
            monitor._landed(batch)
        return seen

    monitor.in_flight = in_flight_then_landed
    monitor.tick(deadline + 0.01)
    assert monitor.states["j"] == "running"
    assert monitor._tick_wake.is_set()   # the deferral itself wakes the tick
    monitor.in_flight = checked
    monitor._tick_wake.clear()
    monitor.tick(deadline + 0.02)
    assert monitor.states["j"] == "stalled"   # its part was refused: no sign of life


def test_a_rank_quiet_past_its_deadline_is_silent_once_the_others_go_past_its_steps(monitor):
    # rank 3 sent steps 0 and 1 at once, then nothing: its deadline passes while it is not
    # behind (the others are at step 1 too), so nothing is decided and no wake is due for it;
    # once the others' step 2 lands it is silent, and was decided a whole tick later
    feed(monitor, 0, range(4), queued_ago=STALL + 1.0)
    feed(monitor, 1, [3], queued_ago=STALL + 1.0)
    feed(monitor, 1, [0, 1, 2], queued_ago=STALL / 2)
    tr = monitor.trackers["j"]
    monitor.tick(tr.ranks[3].last_arrival + STALL + 0.5)
    assert monitor.states["j"] == "running" and not monitor.store.alerts(job="j")
    monitor._tick_wake.clear()
    feed(monitor, 2, [0, 1, 2])   # rank 3 now behind, quiet for longer than STALL
    assert monitor._tick_wake.is_set()   # the tick decides it now ...
    monitor.tick(tr.last_arrival + 0.001)
    assert [(a.rule, a.labels.rank) for a in monitor.store.alerts(job="j", status="firing")] \
        == [("rank_silent", "3")]


def test_ranks_sending_a_moment_after_the_first_one_when_a_job_resumes_are_not_silent(monitor):
    # the whole job quiet past stall_after_s (a checkpoint: its own silence, `stalled`), then
    # rank 0's part lands first: the others were quiet as long and are behind it for the
    # moment until theirs land, and were each called silent (an alert fired and resolved).
    # The scene is laid in the past (parts are stamped when queued, which can only be before
    # now), so every arrival is where the test puts it, however fast or slow the calls run.
    ago = STALL + 1.0
    feed(monitor, 0, range(4), queued_ago=ago + STALL + 1.0)
    tr = monitor.trackers["j"]
    feed(monitor, 1, [0], queued_ago=ago)
    resumed = tr.ranks[0].last_arrival
    monitor.tick(resumed + 0.01)
    assert monitor.states["j"] == "running" and not monitor.store.alerts(job="j")
    feed(monitor, 1, [1, 2], queued_ago=ago - 0.5)
    # rank 3's silence counts from the resume: called silent stall_after_s after it
    monitor.tick(resumed + STALL - 0.01)
    assert not monitor.store.alerts(job="j")
    # their next parts land a second before rank 3's deadline (give or take how long the
    # call took to start: the stamp is a time ago, taken before it)
    feed(monitor, 2, [0, 1, 2], queued_ago=time.time() - (resumed + STALL - 1.0))
    assert resumed + STALL - 1.0 <= tr.last_arrival + 0.002 and tr.last_arrival < resumed + STALL
    monitor.tick(resumed + STALL + 0.01)
    assert [(a.rule, a.labels.rank) for a in monitor.store.alerts(job="j", status="firing")] \
        == [("rank_silent", "3")]


def test_rank_silent_alerts_of_one_job_are_bounded(monitor):
    # a meta.json declaring a world of 1,000,000 ranks, four of which sent a part: every
    # other rank was silent, and one alert each was built and stored (GBs, the service stuck)
    monitor.config = monitor.config.replace(max_silent_alerts=1)
    feed(monitor, 0, range(4))
    feed(monitor, 1, [0, 1])   # ranks 2 and 3 behind the others
    quiet = monitor.trackers["j"].ranks[3].last_arrival
    monitor.watchdog.check_silence(quiet + STALL + 0.01)
    firing = monitor.store.alerts(job="j", status="firing")
    assert [(a.rule, a.labels.rank) for a in firing] == [("rank_silent", "2")], firing
    assert set(monitor.watchdog.silent["j"]) == {2, 3}   # (counted: stragglers_silent_ranks)


def test_a_wall_clock_set_back_does_not_hold_off_the_stall(monitor):
    # the wall clock set back an hour (NTP stepping it) after the job's parts arrived: their
    # arrivals lay an hour ahead of it, and the job stalled an hour late (no alert meanwhile)
    feed(monitor, 0, range(4))
    back = monitor.trackers["j"].last_arrival - 3600.0
    monitor.tick(back)   # the first tick after the step: silence counts from here
    assert monitor.states.get("j") != "stalled"
    monitor.tick(back + STALL + 0.01)
    assert monitor.states["j"] == "stalled"
    assert monitor.store.job("j").state == "stalled"


def test_a_part_heard_while_a_tick_runs_is_not_moved_back_to_its_clock(monitor):
    # the tick reads its clock, then follows the store (a slow shared store, a lock wait): a
    # part heard meanwhile arrived after that reading, and the clock-set-back rule moved it
    # back to it, so the job stalled early by as long as the tick took to get there
    feed(monitor, 0, range(4))
    follow, heard = monitor._follow_store, {}

    def follow_then_hear(now):
        out = follow(now)
        feed(monitor, 1, range(4))
        heard["at"] = monitor.trackers["j"].last_arrival
        return out

    monitor._follow_store = follow_then_hear
    monitor.tick()
    assert monitor.trackers["j"].last_arrival == heard["at"]
