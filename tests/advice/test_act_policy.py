"""AdvisePolicy on hand-made windows: it applies the advised remedy, keeps what pays, rolls back what doesn't."""

from __future__ import annotations

import pytest

from stragglers.advice.act import APPLY, KEEP, ROLLBACK, AdvisePolicy, Forced, GCParams
from stragglers.advice.window import StepTiming, window_trace
from stragglers.errors import InputError
from stragglers.protocols import CONTROLLER_POLICIES


def step_timings(step: int, t0: float, compute: list[float], sync: float = 0.01,
                 batches: list[int] | None = None) -> list[StepTiming]:
    """One DDP step: rank r computes compute[r] s, all leave the sync together."""
    n = len(compute)
    batches = batches or [16] * n
    done = t0 + max(compute) + sync
    return [StepTiming(r, step, t0, t0, t0 + c / 3, t0 + c, done, done + 0.005, batches[r],
                       4 << 20) for r, c in enumerate(compute)]


def run(policy: AdvisePolicy, compute_of, steps: int) -> list:
    t, out = 0.0, []
    for step in range(steps):
        timings = step_timings(step, t, compute_of(step, policy), batches=policy.batch_sizes)
        t = timings[0].optimizer_end + 0.001
        out += policy.observe(timings)
    return out


def slow_rank_3(step, policy):
    """Rank 3 computes each sample 2.5× slower; compute ∝ batch (what DD can fix)."""
    return [b * (0.0025 if r == 3 else 0.001) for r, b in enumerate(policy.batch_sizes)]


def test_policy_applies_dd_for_a_slow_device_and_keeps_it():
    policy = AdvisePolicy(4, 64, window=4, settle=1)
    decisions = run(policy, slow_rank_3, 20)
    kinds = [(d.kind, d.remedy) for d in decisions]
    assert kinds == [(APPLY, "antdt-dd"), (KEEP, "antdt-dd")]
    apply, keep = decisions
    assert apply.params.batch_sizes[3] < apply.params.batch_sizes[0]
    assert sum(apply.params.batch_sizes) == 64
    # compute ∝ batch exactly here, so the replay's prediction is what happens
    assert keep.measured_speedup == pytest.approx(apply.predicted_speedup, rel=0.02)


def test_policy_rolls_back_a_remedy_that_made_things_worse():
    # forced planned GC; the "job" gets 3× slower once it is on (a collection per step on a big heap)
    def harmed(step, policy):
        base = [0.02] * 4
        return [3 * c for c in base] if policy.active is not None else base

    policy = AdvisePolicy(4, 64, window=4, settle=1, force={"name": "planned-gc", "every": 1})
    decisions = run(policy, harmed, 16)
    assert [(d.kind, d.remedy) for d in decisions[:2]] == [(APPLY, "planned-gc"), (ROLLBACK, "planned-gc")]
    assert decisions[0].params == GCParams(every=1)
    assert decisions[1].measured_speedup < 0.5
    assert "planned-gc" in policy.rejected
    assert all(d.remedy != "planned-gc" for d in decisions[2:])


def test_policy_does_nothing_for_a_balanced_job():
    policy = AdvisePolicy(4, 64, window=4)
    assert run(policy, lambda s, p: [0.02, 0.0201, 0.0199, 0.02], 16) == []


def test_policy_checks_its_config():
    with pytest.raises(InputError, match="runtime"):
        AdvisePolicy(4, 64, remedies=("antdt-nd",))
    with pytest.raises(InputError, match="world_size"):
        AdvisePolicy(1, 64)
    with pytest.raises(InputError, match="force.*runtime"):
        AdvisePolicy(4, 64, force={"name": "antdt-nd"})
    with pytest.raises(InputError, match="force.*every"):
        AdvisePolicy(4, 64, force={"name": "planned-gc", "period": 2})
    assert AdvisePolicy(4, 64, force=Forced("planned-gc", every=3)).force == \
        AdvisePolicy(4, 64, force={"name": "planned-gc", "every": 3}).force


def test_policy_is_not_an_adapt_controller_policy():
    # it is fed step timings, not the controller's ControllerState: the adapt controller (which
    # builds its policy with no arguments) refuses the name instead of failing to construct it
    from stragglers.adapt.controller import ControlConfig

    assert "advise" not in CONTROLLER_POLICIES
    with pytest.raises(InputError, match="policy"):
        ControlConfig(world_size=4, global_batch=64, policy="advise")


def test_window_trace_refuses_a_missing_rank():
    steps = [step_timings(0, 0.0, [0.01, 0.01, 0.01])[:2]]
    with pytest.raises(InputError, match="rank"):
        window_trace(steps + [step_timings(1, 1.0, [0.01, 0.01, 0.01])])


def test_window_with_uncoordinated_gc_pauses_is_advised_planned_gc():
    from stragglers.advice import advise

    steps, t = [], 0.0
    for step in range(12):
        row = []
        for r in range(4):
            pause = 0.08 if (step + r) % 3 == 0 else 0.0   # a different rank pauses each step
            fe = t + 0.02 + pause
            row.append(StepTiming(r, step, t, t, fe, fe + 0.04, 0.0, 0.0, 16, 4 << 20, pause, 0.0))
        done = max(x.backward_end for x in row) + 0.005
        steps.append([StepTiming(*[*x.as_row()[:6], done, done + 0.004, *x.as_row()[8:]])
                      for x in row])
        t = done + 0.01
    steps = [[StepTiming.from_row(x.as_row()) for x in s] for s in steps]
    trace = window_trace(steps)
    assert (trace.optype_names() == "gc").sum() == sum(x.gc_forward_s > 0 for s in steps for x in s)
    plan = advise(trace, remedies=["planned-gc", "antdt-dd", "stragglar"])
    assert plan.remedies[0].name == "planned-gc", [(r.name, r.predicted_speedup) for r in plan.remedies]


def test_warmup_steps_are_left_out_of_the_first_window():
    policy = AdvisePolicy(4, 64, window=4, settle=1, warmup=3)
    decisions = run(policy, slow_rank_3, 12)
    assert decisions[0].kind == APPLY and decisions[0].step == 3 + 4   # window = steps 3..6
    with pytest.raises(InputError, match="warmup"):
        AdvisePolicy(4, 64, warmup=-1)
