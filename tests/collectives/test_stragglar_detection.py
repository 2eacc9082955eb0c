"""Online straggler detection: last arrival from time-in-collective, persistence over a window."""

import pytest

from stragglers.collectives.detection import StragglerDetector, last_arrival
from stragglers.errors import InputError


def times_with_last(n, last, lead=0.05):
    """Per-rank time inside the collective when `last` arrives `lead` s after the others."""
    return [0.01 if r == last else 0.01 + lead + 0.001 * r for r in range(n)]


def test_last_arrival_is_the_shortest_time_inside():
    a = last_arrival([0.3, 0.1, 0.25, 0.2])
    assert a.last == 1 and a.lead == pytest.approx(0.1)
    assert last_arrival([0.1, 0.1, 0.3]).last == 0  # ties: lowest rank, the same everywhere


def test_persistent_straggler_needs_a_full_window_and_a_majority():
    det = StragglerDetector(4, window=5, threshold=0.6)
    for _ in range(4):
        det.observe(times_with_last(4, 2))
        assert det.persistent_straggler() is None  # window not full yet
    det.observe(times_with_last(4, 2))
    assert det.persistent_straggler() == 2


def test_moving_straggler_hands_over_and_noise_gives_none():
    det = StragglerDetector(4, window=5, threshold=0.6)
    seen = []
    for step in range(20):
        det.observe(times_with_last(4, 1 if step < 10 else 3))
        seen.append(det.persistent_straggler())
    assert seen[4:10] == [1] * 6 and seen[-1] == 3
    assert None in seen[10:14] or 3 in seen[10:14]
    det = StragglerDetector(4, window=8, threshold=0.6)
    for step in range(16):
        det.observe(times_with_last(4, step % 4))  # a different rank every time
    assert det.persistent_straggler() is None


def test_small_leads_do_not_switch_to_stragglar():
    det = StragglerDetector(2, window=3, threshold=0.5, min_lead_s=0.02)
    for _ in range(3):
        det.observe(times_with_last(2, 1, lead=0.005))
    assert det.persistent_straggler() is None
    for _ in range(3):
        det.observe(times_with_last(2, 1, lead=0.05))
    assert det.persistent_straggler() == 1


def test_bad_parameters_are_user_errors():
    with pytest.raises(InputError, match="threshold"):
        StragglerDetector(4, threshold=0)
    with pytest.raises(InputError, match="world_size"):
        StragglerDetector(1)
    det = StragglerDetector(4)
    with pytest.raises(InputError, match="expected 4"):
        det.observe([0.1, 0.2])


def test_ranks_within_half_a_millisecond_are_not_flagged_by_the_hook_default():
    # the same rank last every time, but by 0.4 ms: noise, and far too little for StragglAR
    from stragglers.collectives.ddp_hook import DEFAULT_MIN_LEAD_S

    det = StragglerDetector(4, window=8, threshold=0.6, min_lead_s=DEFAULT_MIN_LEAD_S)
    for _ in range(20):
        det.observe([0.0104, 0.0103, 0.0100, 0.0096])  # rank 3 spent the least time inside
    assert det.history[-1].last == 3 and det.persistent_straggler() is None
    for _ in range(8):
        det.observe([0.0304, 0.0303, 0.0300, 0.0096])  # now 20 ms late: a straggler
    assert det.persistent_straggler() == 3
