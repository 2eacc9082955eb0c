"""ClockEstimate's JSON TypedDict names its fields, in order, and to_dict fills every one."""

from __future__ import annotations

import dataclasses

from stragglers.record.clock import ClockEstimate, ClockEstimateJson, ClockRecord, clock_record


def test_the_estimates_json_is_its_fields_in_order():
    names = [f.name for f in dataclasses.fields(ClockEstimate)]
    assert list(ClockEstimateJson.__annotations__) == names
    assert ClockEstimate(1, 2, 3, 4).to_dict() == dict(zip(names, [1, 2, 3, 4]))


def test_the_record_declares_every_key_clock_record_writes():
    start = [ClockEstimate(0, 10, 20, 8)]
    closed = clock_record(start, [ClockEstimate(5, 30, 60, 8)])
    assert list(closed) == list(ClockRecord.__annotations__)
    # before the end is measured: the keys before `end` (NotRequired from there on)
    assert list(clock_record(start, [])) == list(ClockRecord.__annotations__)[:2]
