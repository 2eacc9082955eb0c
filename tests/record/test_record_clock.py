"""meta.extra["clock"] from every rank's clock estimates (record/clock.py: clock_record)."""

from __future__ import annotations

import json

import pytest

from stragglers.record.clock import ClockEstimate, clock_record


def test_clock_record_names_the_worst_error_and_the_drift():
    start = [ClockEstimate(0, 0, 0, 8), ClockEstimate(1_000, 400, 800, 8),
             ClockEstimate(-2_000, 900, 1_800, 8)]
    opened = clock_record(start, [])
    assert list(opened) == ["start", "max_error_start_s"]   # no end yet: no drift either
    assert opened["start"][2] == {"offset_ns": -2_000, "error_ns": 900, "rtt_ns": 1_800,
                                  "rounds": 8}
    assert opened["max_error_start_s"] == pytest.approx(900e-9)
    end = [ClockEstimate(0, 0, 0, 8), ClockEstimate(4_000, 300, 600, 8),
           ClockEstimate(-2_500, 100, 200, 8)]
    closed = clock_record(start, end)
    assert list(closed) == ["start", "max_error_start_s", "end", "max_error_end_s",
                            "max_drift_s"]
    assert closed["max_error_end_s"] == pytest.approx(300e-9)
    assert closed["max_drift_s"] == pytest.approx(3_000e-9)   # rank 1 moved by 3 µs
    json.dumps(closed, allow_nan=False)   # meta.json holds it as it is
