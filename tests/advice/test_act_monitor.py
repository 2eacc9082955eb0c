"""The act loop fed by a real live monitor on loopback: step timings uploaded as parts, the
monitor's analysed windows polled over HTTP, each priced by AdvisePolicy.observe_window."""

from __future__ import annotations


import pytest
from conftest import eventually

from stragglers.advice.act import APPLY, KEEP, AdvisePolicy
from stragglers.advice.live import MonitorWindows, TimingPublisher, window_of
from stragglers.advice.window import StepTiming
from stragglers.errors import InputError
from stragglers.monitor.records import WindowSummary

N, B, W = 4, 64, 4   # ranks, global batch, monitor window steps


def step_timings(step: int, t0: float, batches: list[int], slow: float = 2.5) -> list[StepTiming]:
    """One DDP step: rank 3 computes each sample `slow`× slower (compute ∝ batch); all leave
    the sync together."""
    compute = [b * 0.001 * (slow if r == 3 else 1.0) for r, b in enumerate(batches)]
    done = t0 + max(compute) + 0.01
    return [StepTiming(r, step, t0, t0, t0 + c / 3, t0 + c, done, done + 0.005, batches[r],
                       4 << 20) for r, c in enumerate(compute)]


@pytest.fixture()
def monitor(tmp_path):
    from stragglers.monitor import MonitorConfig, MonitorServer

    cfg = MonitorConfig(window_steps=W, stall_after_s=600, tick_s=0.05, durable=False)
    server = MonitorServer(tmp_path / "mon.db", port=0, config=cfg).start()
    yield server
    server.stop()


def wait_for(windows: MonitorWindows, deadline_s: float = 60.0) -> list[WindowSummary]:
    """The next analysed window(s): the monitor analyses on its own threads."""
    return eventually(windows.poll, deadline_s, interval=0.05, what="a newly analysed window")


@pytest.mark.slow
def test_monitor_windows_drive_apply_and_keep(monitor):
    job = "advised-job"
    policy = AdvisePolicy(N, B, window=W, settle=1)
    publishers = [TimingPublisher(monitor.url, job, r, N, B) for r in range(N)]
    windows = MonitorWindows(monitor.url, job)
    held: dict[int, list[StepTiming]] = {}
    decisions, t = [], 0.0
    for step in range(6 * W):
        timings = step_timings(step, t, policy.batch_sizes)
        t = timings[0].optimizer_end + 0.001
        held[step] = timings
        for p in publishers:
            p.add(timings)
        if (step + 1) % W:
            continue
        # the job goes on only once the monitor closed this window: the test's verdict must
        # not depend on how fast the monitor is under load
        for summary in wait_for(windows):
            assert summary.error is None, summary
            trace = window_of(summary, held, job, B)
            decisions += policy.observe_window(trace, summary.slowdown,
                                               source=f"monitor:{job}#{summary.idx}")
    for p in publishers:
        assert p.close(10.0)
    kinds = [(d.kind, d.remedy) for d in decisions]
    assert kinds == [(APPLY, "antdt-dd"), (KEEP, "antdt-dd")], kinds
    apply, keep = decisions
    # the first window was straggling and analysed by the monitor; DD was decided on it
    assert apply.source == f"monitor:{job}#0" and apply.step == W
    assert apply.params.batch_sizes[3] < apply.params.batch_sizes[0]
    assert sum(apply.params.batch_sizes) == B
    # the window right after the switch holds the settle step: the verdict is the one after
    assert keep.source == f"monitor:{job}#2"
    assert keep.measured_speedup == pytest.approx(apply.predicted_speedup, rel=0.02)


def test_a_healthy_monitor_window_is_not_priced(monitor):
    job = "healthy-job"
    policy = AdvisePolicy(N, B, window=W)
    publishers = [TimingPublisher(monitor.url, job, r, N, B, every=W) for r in range(N)]
    windows = MonitorWindows(monitor.url, job)
    held, t = {}, 0.0
    for step in range(W):
        timings = step_timings(step, t, [16] * N, slow=1.0)
        t = timings[0].optimizer_end + 0.001
        held[step] = timings
        for p in publishers:
            p.add(timings)
    [summary] = wait_for(windows)
    assert summary.idx == 0 and (summary.first_step, summary.last_step) == (0, W - 1)
    assert summary.slowdown is not None and summary.slowdown < policy.apply_gain
    assert policy.observe_window(window_of(summary, held, job, B), summary.slowdown) == []
    assert policy.plans == []   # not even priced
    for p in publishers:
        p.close(10.0)


def test_an_unreachable_monitor_gives_no_windows_and_bad_urls_are_refused():
    import socket

    with socket.socket() as s:   # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    windows = MonitorWindows(f"http://127.0.0.1:{port}", "job", timeout_s=0.5)
    assert windows.poll() == [] and windows.failures == 1
    with pytest.raises(InputError, match="url"):
        MonitorWindows("ftp://x", "job")
    with pytest.raises(InputError, match="job"):
        TimingPublisher("http://127.0.0.1:1", "../etc", 0, 2, 8)


def test_a_late_window_counts_from_the_step_the_switch_is_applied():
    # the monitor's window 0 (steps 0..3) is priced only at step 9: the switch happens then,
    # and the verifying window must start after 9 + settle, not after 4 + settle
    policy = AdvisePolicy(N, B, window=W, settle=1)
    held, t = {}, 0.0
    for step in range(20):
        held[step] = step_timings(step, t, [16] * N)
        t = held[step][0].optimizer_end + 0.001
    first = window_of(steps(0, 3), held, "j", B)
    [apply] = policy.observe_window(first, applied_at=9)
    assert apply.kind == APPLY and apply.step == 9 and policy.ready_from == 10
    assert policy.observe_window(window_of(steps(8, 11), held, "j", B)) == []
    [verdict] = policy.observe_window(window_of(steps(12, 15), held, "j", B))
    assert verdict.step == 16


def steps(first: int, last: int, idx: int = 0) -> WindowSummary:
    """A monitor window summary of steps first..last (its figures unset)."""
    return WindowSummary(idx, first, last, None, None, None, None, None, "complete", 0.0, 0.0, 0.0)


def test_a_window_held_only_in_part_gives_no_op_table():
    held = {s: step_timings(s, float(s), [16] * N) for s in (0, 1, 3)}
    assert window_of(steps(0, 3), held, "j", B) is None
    trace = window_of(steps(0, 1), held, "j", B)
    assert trace is not None and sorted(set(trace.ops["step"].tolist())) == [0, 1]


@pytest.mark.slow
def test_poll_returns_typed_windows_once_and_skips_what_is_not_one():
    """A stand-in monitor: the windows as the monitor's JSON, with one malformed entry."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    pages = [{"windows": [
        {"idx": 1, "first_step": 4, "last_step": 7, "slowdown": 1.8, "waste": 0.4, "m_w": 1.1,
         "m_s": 1.0, "error": None, "reason": "complete", "closed_at": 2.0, "analysed_at": 2.1,
         "analysis_s": 0.1, "causes": ["slow_compute"], "added_later": 1},
        {"idx": 0, "first_step": 0, "last_step": 3, "slowdown": None, "waste": None,
         "m_w": None, "m_s": None, "error": "rank 2 missing", "reason": "stalled",
         "closed_at": 1.0, "analysed_at": 1.0, "analysis_s": 0.0},
        {"idx": "2", "first_step": 8}]}]
    pages.append(pages[0])   # the same windows again: none is new

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(pages.pop(0)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        windows = MonitorWindows(f"http://127.0.0.1:{server.server_port}", "job")
        first = windows.poll()
        assert [type(w) for w in first] == [WindowSummary, WindowSummary]
        assert [w.idx for w in first] == [0, 1] and windows.failures == 1   # "2" is skipped
        assert first[0].error == "rank 2 missing" and first[0].causes == []
        assert first[1].slowdown == 1.8 and first[1].causes == ["slow_compute"]
        assert windows.poll() == [] and windows.failures == 2
    finally:
        server.shutdown()
        server.server_close()
