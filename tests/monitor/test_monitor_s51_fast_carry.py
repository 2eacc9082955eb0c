"""The fast detector cuts a part's last compute at the rank's next part's first (computes run on
one stream), and judges that step once the next part came, or once its window closed."""

from __future__ import annotations

import math

import numpy as np

from stragglers.monitor.changes import ChangeSettings, RankChangeDetector, is_compute, \
    part_busy
from stragglers.trace.model import OPTYPE_CODES

FWD, BWD, SEND = (OPTYPE_CODES[n] for n in ("forward-compute", "backward-compute",
                                           "forward-send"))


def _part(rank: int, step: int, last_stated: float):
    """One step of a rank, its own part: forward [10s, 10s+1], backward from 10s+1 stated
    `last_stated` long (1 s really: the next step's forward starts at 10s+10), a send."""
    t = 10.0 * step
    return part_busy(np.array([step] * 3), is_compute(np.array([FWD, BWD, SEND])),
                     np.array([t, t + 1, t + 2]), np.array([1.0, last_stated, 0.5]))


def _feed(d: RankChangeDetector, step: int, stated: dict[int, float]) -> None:
    for rank in d.ranks:
        p = _part(rank, step, stated.get(rank, 1.0))
        d.add(rank, p.steps, p.busy, p.first_start, p.last)


def _last_value(d: RankChangeDetector, rank: int) -> float:
    return float(d._last(d.index[rank], 1)[0])


def test_a_parts_last_compute_is_cut_by_the_ranks_next_part():
    d = RankChangeDetector([0, 1, 2, 3], {}, ChangeSettings())
    # rank 3 states its backward 25 s long: past the next step's forward (9 s after its start)
    _feed(d, 0, {3: 25.0})
    d.settle()
    assert d.settled == -1   # step 0 waits for the parts that cut its last computes
    _feed(d, 1, {3: 25.0})
    d.settle()
    assert d.settled == 0
    # step 0 of rank 3: forward 1 s + backward cut at step 1's forward, 9 s = 10 s against
    # its peers' 2 s (whole, the part's last compute counted its 25 s: 26 s, 13x)
    assert math.isclose(_last_value(d, 3), math.log(10.0 / 2.0))
    assert math.isclose(_last_value(d, 0), 0.0, abs_tol=1e-12)


def test_a_carried_compute_counts_at_its_own_time_once_its_window_closed():
    d = RankChangeDetector([0, 1, 2, 3], {}, ChangeSettings())
    _feed(d, 0, {3: 3.0})
    _feed(d, 1, {3: 3.0})
    d.settle()
    assert d.settled == 0 and d.carried_from() == 1
    d.close_through(1)   # the job's last window took step 1: no later part comes
    d.settle()
    assert d.settled == 1 and d.carried_from() is None
    assert math.isclose(_last_value(d, 3), math.log((1.0 + 3.0) / 2.0))


def test_a_part_that_comes_late_does_not_take_the_carried_compute():
    d = RankChangeDetector([0, 1, 2, 3], {}, ChangeSettings())
    for rank in (0, 1, 2):
        for step in (0, 1):
            p = _part(rank, step, 1.0)
            d.add(rank, p.steps, p.busy, p.first_start, p.last)
    late, first = _part(3, 0, 1.0), _part(3, 1, 1.0)
    d.add(3, first.steps, first.busy, first.first_start, first.last)   # step 1 first
    d.add(3, late.steps, late.busy, late.first_start, late.last)       # then step 0
    assert d.carry[3][0] == 1   # (step 1's backward still waits for step 2's forward)
    d.settle()
    assert d.settled == 0 and math.isclose(_last_value(d, 3), 0.0, abs_tol=1e-12)
