"""Trace.notes are typed Notes; meta.json and the result JSON keep writing {kind, message}."""

from __future__ import annotations

import json

import pytest

from stragglers.trace.model import Note
from stragglers.trace.runformat import read_run, write_run
from stragglers.trace.synth import generate
from stragglers.whatif import analyze


def test_notes_are_typed_and_a_dict_note_given_is_converted():
    trace = generate(dp=2, pp=1, microbatches=2, steps=4, sync="ddp", seed=0)
    trace.note("clock", 3.5)
    assert trace.notes[-1] == Note("clock", "3.5")
    with pytest.raises(ValueError, match="gossip"):
        trace.note("gossip", "x")
    again = type(trace)(trace.ops, trace.meta, trace.source, [{"kind": "ranks", "message": "2 of 2"}])
    assert again.notes == [Note("ranks", "2 of 2")]
    assert again.select(again.ops["step"] > 0).notes == again.notes
    # a note is a record, not a mapping (the last readers of dict notes are gone)
    with pytest.raises(TypeError):
        dict(again.notes[0])  # type: ignore[call-overload]


def test_notes_travel_through_meta_json_and_the_result_unchanged(tmp_path):
    trace = generate(dp=2, pp=1, microbatches=2, steps=4, sync="ddp", seed=0)
    trace.note("dropped", "3 sends left out: no peer")
    write_run(tmp_path / "run", trace)
    raw = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert raw["notes"] == [{"kind": "dropped", "message": "3 sends left out: no peer"}]
    back = read_run(tmp_path / "run")
    assert back.notes == trace.notes and isinstance(back.notes[0], Note)
    notes = analyze(back).to_dict()["notes"]
    assert notes == [{"kind": "dropped", "message": "3 sends left out: no peer"}]
