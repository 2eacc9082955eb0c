"""A gc pause that falls while a posted recv waits: the replay must not count the wait twice."""

from __future__ import annotations

from stragglers.trace.model import JobMeta, Trace
from stragglers.trace.synth import generate
from stragglers.whatif import analyze

MS = 1e-3
COLUMNS = ("rank", "dp_rank", "stage", "step", "optype", "start_ts", "duration", "seq_id",
           "mb_id", "mc", "gmc")


def one_f_one_b(rows: dict, step: int, t0: float, pause: tuple[float, float] | None) -> None:
    """A pp 2, 2-microbatch 1F1B step; stage 1 waits 19 ms on its second forward-recv.

    `pause`: a gc pause on stage 1 (start, end in ms) in the slot before its second forward.
    """
    f1 = 52.0 if pause is None else max(52.0, pause[1])  # stage 1's second forward starts
    table = [  # (stage, optype, seq, start ms, end ms, mb)
        # stage 0: F0 F1 B0 B1; its long F1 keeps stage 1 waiting
        (0, "forward-compute", 0, 0, 10, 0), (0, "forward-send", 0, 10, 12, 0),
        (0, "forward-compute", 1, 10, 50, 1), (0, "forward-send", 1, 50, 52, 1),
        (0, "backward-recv", 0, 50.5, 52.5, 0), (0, "backward-compute", 0, 52.5, 62.5, 0),
        (0, "backward-recv", 1, 63, 80, 1), (0, "backward-compute", 1, 80, 90, 1),
        # stage 1: F0 B0 F1 B1; the recv of F1 is posted right after B0 and waits for stage 0
        (1, "forward-recv", 0, 0, 12, 0), (1, "forward-compute", 0, 12, 22, 0),
        (1, "backward-compute", 0, 22, 32, 0), (1, "backward-send", 0, 32, 52.5, 0),
        (1, "forward-recv", 1, 33, 52, 1), (1, "forward-compute", 1, f1, f1 + 10, 1),
        (1, "backward-compute", 1, f1 + 10, f1 + 20, 1),
        (1, "backward-send", 1, f1 + 20, max(f1 + 22, 82.0), 1),
    ] + ([(1, "gc", 2, *pause, -1)] if pause is not None else [])
    for stage, optype, seq, start, end, mb in table:
        for k, v in zip(COLUMNS, (stage, 0, stage, step, optype, t0 + start * MS,
                                  (end - start) * MS, seq, mb, 0, stage)):
            rows[k].append(v)


def trace(pause) -> Trace:
    rows = {k: [] for k in COLUMNS}
    for step in range(3):
        one_f_one_b(rows, step, step * 0.2, pause)
    return Trace.from_rows(rows, JobMeta(name="gc-wait", dp_size=1, pp_size=2))


def test_a_pause_after_the_recv_wait_replays_exactly():
    # the pause follows the wait (an allocation right after it triggered the collection)
    result = analyze(trace((53.0, 58.0)))
    assert result.sim_error < 1e-9, result.sim_error


def test_a_pause_before_the_recv_post_replays_exactly():
    # the pause falls between B0 and the recv's post: the recv is posted after the pause
    result = analyze(trace((32.1, 32.9)))
    assert result.sim_error < 1e-9, result.sim_error


def test_a_pause_before_each_recv_post_is_gc_not_a_host_stall():
    # the generator collects before every forward, before posting its recv: chained after the
    # previous compute op the recvs took each pause as a launch delay, and stage 1 (most pauses,
    # no DP peer) was named a host stall
    job = generate(dp=1, pp=4, vpp=1, microbatches=8, steps=6, seed=1, gc=(0.3, 0.2))
    assert {f.cause for f in analyze(job).diagnosis} == {"gc"}
