"""replaycheck (the exact replay statement the real-job tests use) on synthetic pipelines: it
holds on a consistent record, allows what a torn transfer moves, and refuses anything else."""

from __future__ import annotations

import numpy as np
import pytest
from replaycheck import check_replay

from stragglers.trace.synth.actions import action_trace, single_orders
from stragglers.whatif import analyze


def _pipeline():
    return action_trace(single_orders(2, 4, "1F1B"), steps=4)


def _row(trace, step: int, rank: int, name: str, k: int = 0) -> int:
    o = trace.ops
    rows = np.flatnonzero((o["step"] == step) & (o["rank"] == rank)
                          & (trace.optype_names() == name))
    return int(rows[np.argsort(o["start_ts"][rows])][k])


def test_a_consistent_record_replays_exactly():
    got = check_replay(_pipeline())
    assert (got["torn_transfers"], got["exact_steps"], got["steps"]) == (0, 4, 4)
    assert got["sim_error"] < 1e-12


def test_a_send_done_before_its_receive_was_posted_may_move_what_follows():
    trace = _pipeline()
    o = trace.ops
    pairs = [(_row(trace, 2, a, f"{d}-send", k), _row(trace, 2, b, f"{d}-recv", k))
             for d, a, b in (("forward", 0, 1), ("backward", 1, 0)) for k in range(4)]
    # a transfer whose receive was posted after its send: the send completes buffered
    send, recv = next((s, r) for s, r in pairs if o["start_ts"][r] > o["start_ts"][s] + 2e-4)
    o["duration"][send] = o["start_ts"][recv] - o["start_ts"][send] - 1e-4
    got = check_replay(trace)
    assert got["torn_transfers"] == 1 and got["exact_steps"] == 3


def _started_early():
    trace = _pipeline()
    comp = _row(trace, 2, 1, "forward-compute")
    o = trace.ops
    o["start_ts"][comp] -= 0.002   # before its receive ended: no torn transfer explains it
    o["duration"][comp] += 0.002
    return trace


def test_an_op_started_before_its_dependency_ended_is_refused():
    with pytest.raises(AssertionError, match="no torn transfer upstream"):
        check_replay(_started_early())


def test_it_is_refused_where_the_engine_replays_its_own_rows_exactly():
    """The engine starts the op where its receive ended (whatif/timing.py), so its replay
    reproduces its own rows with no error; the check holds the replay against the trace's
    rows, and that op's recorded start is not where the replay starts it."""
    trace = _started_early()
    got = analyze(trace)
    assert got.sim_error < 1e-12 and any("before their input was there" in w
                                          for w in got.warnings), got.warnings
    with pytest.raises(AssertionError, match=r"\['forward-compute'\] replayed off their record"):
        check_replay(trace)
