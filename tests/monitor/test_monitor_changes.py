"""The fast detector (changes.py): a rank that turns ×1.5 slower alerts within a few steps and
names itself; clean jobs with noise and GC-like spikes never alert; a transient does not; the
alert resolves when the rank recovers; a dead rank holds no step up."""

from __future__ import annotations

import numpy as np
import pytest

from monitor_jobs import rank_of, slow_job
from stragglers.monitor.changes import SETTLE_LAG, ChangeSettings, RankChangeDetector, \
    busy_per_step, is_compute, read_busy


def busy_table(seed: int, ranks: int, steps: int, sigma: float, spikes: float = 0.02,
               slow: dict | None = None) -> np.ndarray:
    """steps × ranks busy seconds: per-stage levels, a job-wide factor per step, per-rank
    lognormal noise and GC-like pauses; `slow` = {rank: (from_step, to_step, factor)}."""
    rng = np.random.default_rng(seed)
    level = 0.1 * (1 + 0.1 * (np.arange(ranks) % 4))
    common = np.exp(rng.normal(0, 0.1, (steps, 1)))
    busy = level * common * np.exp(rng.normal(0, sigma, (steps, ranks)))
    busy += (rng.random((steps, ranks)) < spikes) * rng.exponential(0.05, (steps, ranks))
    for rank, (first, last, factor) in (slow or {}).items():
        busy[first:last, rank] *= factor
    return busy


def detect(busy: np.ndarray, per_part: int = 1, order_seed: int = 0, skip_rank: int | None = None):
    """Feed the table as parts of `per_part` steps per rank, ranks in a shuffled order."""
    steps, ranks = busy.shape
    d = RankChangeDetector(list(range(ranks)), {r: r % 4 for r in range(ranks)}, ChangeSettings())
    rng, out = np.random.default_rng(order_seed), []
    for first in range(0, steps, per_part):
        idx = np.arange(first, min(first + per_part, steps))
        for r in rng.permutation(ranks):
            if r != skip_rank:
                d.add(int(r), idx, busy[idx, r])
        out.extend(d.settle())
    return d, out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("sigma", [0.02, 0.05, 0.1])
def test_clean_jobs_with_noise_and_spikes_never_alert(seed, sigma):
    _, changes = detect(busy_table(seed, 48, 500, sigma), per_part=4, order_seed=seed)
    assert changes == []


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("sigma", [0.02, 0.05, 0.1])
def test_a_rank_turning_1_5x_slower_alerts_within_a_few_steps(seed, sigma):
    busy = busy_table(seed, 64, 140, sigma, slow={9: (100, 140, 1.5)})
    _, changes = detect(busy, order_seed=seed)
    fired = [c for c in changes if c.status == "firing"]
    assert [c.rank for c in fired] == [9], changes
    assert fired[0].at_step - 100 <= 8           # the 9th slow step at the latest
    assert 1.3 <= fired[0].ratio <= 1.75 and abs(fired[0].since_step - 100) <= 3


def test_a_transient_does_not_alert_and_a_recovery_resolves():
    busy = busy_table(1, 32, 260, 0.05, slow={3: (100, 103, 1.6), 5: (150, 190, 1.5)})
    d, changes = detect(busy)
    assert [(c.rank, c.status) for c in changes] == [(5, "firing"), (5, "resolved")]
    assert 190 < changes[1].at_step <= 190 + 20 and not d.firing


def test_a_dead_rank_holds_no_step_up():
    busy = busy_table(2, 16, 160, 0.03, slow={4: (100, 160, 1.5)})
    d, changes = detect(busy, skip_rank=11)
    assert [c.rank for c in changes] == [4]
    assert d.settled >= 159 - SETTLE_LAG


def test_busy_time_from_a_synthetic_job_names_the_slowed_rank():
    # a real synthetic job (compute, sends, all-reduces), clean before step 40 and with worker
    # (dp 2, stage 1) 1.5× slower from step 40 (the same seed: the same noise before and after)
    clean = slow_job(steps=70, dp=4, pp=2, slow=None, seed=3)
    slowed = slow_job(steps=70, dp=4, pp=2, slow=(2, 1, 1.5), seed=3)
    target = rank_of(clean, 2, 1)
    d = RankChangeDetector(sorted({e["rank"] for e in clean.meta.extra["layout"]}),
                           {e["rank"]: e["stage"] for e in clean.meta.extra["layout"]},
                           ChangeSettings(warmup_steps=10, baseline_steps=30))
    changes = []
    for step in range(70):
        o = (clean if step < 40 else slowed).ops
        for rank in d.ranks:
            sel = (o["rank"] == rank) & (o["step"] == step)
            d.add(rank, *busy_per_step(o["step"][sel], is_compute(o["optype"][sel]),
                                       o["start_ts"][sel], o["duration"][sel]))
        changes.extend(d.settle())
    assert [(c.rank, c.status) for c in changes] == [(target, "firing")]
    assert changes[0].at_step - 40 <= 6


def test_the_built_in_alert_names_are_reserved_in_a_rules_file():
    from stragglers.errors import InputError
    from stragglers.monitor.alerts import parse_rules

    for name in ("rank_slowdown", "rank_silent"):
        with pytest.raises(InputError, match=r"rules\[0\]\.name.*built-in"):
            parse_rules([{"name": name, "when": "new_cause"}])


def test_busy_time_read_from_a_part_file_is_its_compute_per_step(tmp_path):
    from stragglers.trace.model import COMPUTE_OPTYPES, OPTYPES
    from stragglers.trace.runformat import write_rank

    o = slow_job(steps=3, dp=2, pp=2, slow=None).ops
    sel = o["rank"] == 1
    path = write_rank(tmp_path, 1, {k: v[sel] for k, v in o.items()}, part=0)
    steps, busy = read_busy(path)
    compute = np.isin(np.asarray(OPTYPES)[o["optype"][sel]], COMPUTE_OPTYPES)
    want = [o["duration"][sel][compute & (o["step"][sel] == s)].sum() for s in range(3)]
    assert steps.tolist() == [0, 1, 2] and np.allclose(busy, want)
    assert read_busy(tmp_path / "gone.parquet") is None


def test_busy_time_of_a_one_step_part_read_without_its_step_column(tmp_path):
    from stragglers.trace.model import COMPUTE_OPTYPES, OPTYPES
    from stragglers.trace.runformat import write_rank

    o = slow_job(steps=3, dp=2, pp=2, slow=None).ops
    sel = (o["rank"] == 1) & (o["step"] == 2)
    path = write_rank(tmp_path, 1, {k: v[sel] for k, v in o.items()}, part=0)
    compute = np.isin(np.asarray(OPTYPES)[o["optype"][sel]], COMPUTE_OPTYPES)
    steps, busy = read_busy(path, 2)   # the footer's one step
    assert steps.tolist() == [2] and np.allclose(busy, [o["duration"][sel][compute].sum()])
    assert [a.tolist() for a in read_busy(path)] == [steps.tolist(), busy.tolist()]
    # a part of communication alone has no busy time (no step to judge)
    comm = sel & ~np.isin(np.asarray(OPTYPES)[o["optype"]], COMPUTE_OPTYPES)
    path = write_rank(tmp_path, 1, {k: v[comm] for k, v in o.items()}, part=1)
    assert [len(a) for a in read_busy(path, 2)] == [0, 0]


def test_steps_held_for_silent_ranks_are_bounded():
    d = RankChangeDetector(list(range(8)), {}, ChangeSettings())
    for step in range(600):              # five of eight ranks never report
        for rank in range(3):
            d.add(rank, np.array([step]), np.array([0.1]))
        d.settle()
    assert len(d.pending) <= 257 and d.settled >= 600 - 258
