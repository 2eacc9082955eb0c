"""Controller reports checked against the job's config (issue 34, round 10): a batch past the
most the controller handed the rank, a step given twice with other values, an incarnation
ahead of the controller's: each refused 400 naming the field, nothing applied."""

from __future__ import annotations

import pytest

from stragglers.adapt.control import ControlPlane
from stragglers.adapt.controller import ControlConfig
from stragglers.errors import InputError

JOB = dict(policy="nd", world_size=2, global_batch=8, window=2, lag_s=0,
           persistent_windows=1, total_steps=1000)


def plane_of() -> ControlPlane:
    plane = ControlPlane()
    plane.configure("j", ControlConfig(**JOB), None)
    return plane


def refused(plane: ControlPlane, rank: int, records: list, incarnation: int = 0) -> str:
    with pytest.raises(InputError) as exc:
        plane.report("j", rank, records, "", incarnation, 0, None)
    return f"{exc.value.field}: {exc.value}"


def test_a_batch_past_the_ranks_split_is_refused_and_moves_nothing():
    # (fails before: a rank claiming the whole global batch of 8 where its split is 4 made
    # healthy rank 0 r 1.33 > theta: ND killed it at the first window)
    plane = plane_of()
    for step in range(2, 6):
        plane.report("j", 0, [[step, 0.1, 4]], "", 0, 0, None)
        why = refused(plane, 1, [[step, 0.1, 4], [step + 100, 0.1, 8]])
        assert why.startswith("records[1][2]: ") and "at most 4" in why, why
        why = refused(plane, 1, [[step, 0.1, 1_000_000]])
        assert why.startswith("records[0][2]: ") and "global_batch 8" in why, why
    state = plane.state("j")
    assert state.kills == 0 and state.actions == [] and state.batch_sizes == [4, 4]
    assert len(plane._jobs["j"][1].monitor.workers[1].records) == 0   # nothing of rank 1 kept
    # once the controller hands rank 1 more (rank 0 slow: an ADJUST_BS of 2/6), 6 is taken
    plane.configure("j", ControlConfig(**{**JOB, "max_restarts": 0, "incarnation": 1}), None)
    ctl = plane._jobs["j"][1]
    for step in range(2, 4):
        plane.report("j", 0, [[step, 0.3, 4]], "", 1, 0, None)
        plane.report("j", 1, [[step, 0.1, 4]], "", 1, 0, None)
    assert ctl.batch_sizes == [2, 6] and ctl.most == [4, 6], ctl.actions
    plane.report("j", 1, [[4, 0.1, 6]], "", 1, 0, None)
    assert "expected at most 6 samples" in refused(plane, 1, [[5, 0.1, 7]], 1)


def test_a_step_given_twice_with_another_time_is_refused_whole():
    # (fails before: the first of the two counted, the other ignored: either time, unchecked)
    plane = plane_of()
    why = refused(plane, 0, [[2, 0.1, 4], [3, 0.1, 4], [2, 0.9, 4]])
    assert why.startswith("records[2][0]: ") and "records[0]" in why, why
    assert len(plane._jobs["j"][1].monitor.workers[0].records) == 0   # none of it applied
    plane.report("j", 0, [[2, 0.1, 4], [2, 0.1, 4]], "", 0, 0, None)   # (the same record: one)
    assert len(plane._jobs["j"][1].monitor.workers[0].records) == 1


def test_a_report_of_a_later_incarnation_than_the_controllers_is_refused():
    # (fails before: 200, its records ignored and the older incarnation's actions answered)
    plane = plane_of()
    why = refused(plane, 0, [[2, 0.1, 4]], incarnation=5)
    assert why.startswith("incarnation: ") and "at most 0" in why, why
    # an earlier incarnation's agent still flushing: answered, its records ignored
    plane.configure("j", ControlConfig(**{**JOB, "incarnation": 1}), None)
    assert plane.report("j", 0, [[2, 0.1, 1_000_000]], "", 0, 0, None).incarnation == 1
    assert len(plane._jobs["j"][1].monitor.workers[0].records) == 0
