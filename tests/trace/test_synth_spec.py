"""SynthSpec: the generator's job and its typed injections, the keyword form converted in one
place, checked whole with one line naming the field, and the command's options built from it."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import typer
import typer.main

from stragglers.errors import InputError
from stragglers.trace.synth import (GC, GCInCompute, HeavyLastStage, HostStall, SequenceImbalance,
                                    SlowCollective, SlowLink, SlowWorker, SynthSpec, generate)
from stragglers.trace.synth.spec import SynthKeywords
from stragglers.trace.synth.validate import KEYWORDS, GeneratorRecord

EVERY_KIND = SynthSpec(
    dp=2, pp=4, vpp=2, microbatches=8, steps=4, seed=3, stage_scale=(1.0, 1.0, 1.0, 1.2),
    injections=(SlowWorker(1, 2, 2.0), HeavyLastStage(1.3), SequenceImbalance("uniform", 4096),
                GC(0.5, 0.02), SlowLink(0, 1, 2, 3.0, steps=(1, 2)), HostStall(1, 0, 0.1),
                GCInCompute(1.0, 0.01)))


def test_round_trips_through_a_mapping_and_json():
    assert SynthSpec.from_mapping(EVERY_KIND.to_dict()) == EVERY_KIND
    text = json.dumps(EVERY_KIND.to_dict())
    again = SynthSpec.from_mapping(json.loads(text))
    assert json.dumps(again.to_dict()) == text
    assert again.parameters() == EVERY_KIND.parameters()   # what the generator runs
    collective = SynthSpec(pp=2, injections=(SlowCollective("grads-reduce-scatter", 4.0, 0),))
    assert SynthSpec.from_mapping(collective.to_dict()) == collective


def test_the_typed_and_the_keyword_form_make_the_same_trace():
    typed = generate(SynthSpec(dp=2, pp=2, microbatches=4, steps=3, seed=5,
                               injections=(SlowWorker(1, 0, 2.0), GC(0.5, 0.01),
                                           SlowCollective("grads-reduce-scatter", 3.0))))
    keywords = generate(dp=2, pp=2, microbatches=4, steps=3, seed=5, slow_worker=(1, 0, 2.0),
                        gc=(0.5, 0.01), slow_link={"kind": "collective", "stage": None,
                                                   "optype": "grads-reduce-scatter", "factor": 3})
    assert typed.meta == keywords.meta
    for column in typed.ops:
        np.testing.assert_array_equal(typed.ops[column], keywords.ops[column])
    # keywords next to a spec change its fields
    assert generate(SynthSpec(dp=2, pp=1, microbatches=2, steps=2), seed=4).meta.run_id == "4"


def test_a_specs_keyword_form_makes_the_same_trace():
    keywords = EVERY_KIND.keywords()
    assert keywords["slow_link"] == {"kind": "p2p", "dp": 0, "stage_from": 1, "stage_to": 2,
                                     "factor": 3.0, "steps": (1, 2)}
    again, typed = generate(**keywords), generate(EVERY_KIND)
    assert again.meta == typed.meta
    for column in typed.ops:
        np.testing.assert_array_equal(typed.ops[column], again.ops[column])
    # both forms name every setting of a spec but its name, and every injection keyword
    settings = [f.name for f in dataclasses.fields(SynthSpec) if f.name not in ("name",
                                                                                "injections")]
    assert set(SynthKeywords.__annotations__) == set(settings) | set(KEYWORDS)
    recorded = list(typed.meta.extra["generator"])
    assert recorded[2:2 + len(GeneratorRecord.__annotations__)] == \
        list(GeneratorRecord.__annotations__)
    assert GeneratorRecord.__annotations__.keys() == SynthKeywords.__annotations__.keys()


@pytest.mark.parametrize("make, field", [
    (lambda: SynthSpec(dp=0), "dp"),
    (lambda: SynthSpec(sync="fsdp"), "sync"),
    (lambda: SynthSpec(name=3), "name"),
    (lambda: SynthSpec(dp=2, injections=(SlowWorker(2, 0, 2.0),)), "slow_worker"),
    (lambda: SynthSpec(injections=(HostStall(0, 0, -1.0),)), "host_stall seconds"),
    (lambda: SynthSpec(injections=(SlowLink(0, 0, 2, 2.0),)), "slow_link"),
    (lambda: SynthSpec(injections=(GC(1, 0.1), GC(2, 0.1))), "injections"),
    (lambda: SynthSpec(injections=({"dp": 0},)), "injections"),
    (lambda: SynthSpec.from_mapping({"injections": [{"type": "SlowWorker", "rank": 1}]}),
     "injections.SlowWorker"),
    (lambda: SynthSpec.from_mapping({"injections": [{"type": "Slowness"}]}), "injections"),
    (lambda: SynthSpec.from_keywords(slow_workr=(0, 0, 2.0)), "slow_workr"),
    (lambda: SynthSpec.from_keywords(host_stall={"dp": 0, "stage": 0}), "host_stall seconds"),
])
def test_a_bad_field_is_one_line_naming_it(make, field):
    with pytest.raises(InputError) as err:
        make()
    assert err.value.field == field
    assert "\n" not in str(err.value)


def _synth_command():
    from stragglers.trace.commands import register

    app = typer.Typer()
    register(app)
    return typer.main.get_command(app).commands["synth"]


def test_every_shape_setting_is_an_option_and_parses():
    command = _synth_command()
    flags = {opt for p in command.params for opt in p.opts}
    assert {"--dp", "--pp", "--vpp", "--microbatches", "--steps", "--sync", "--seed", "--noise",
            "--launch-delay", "--step-gap", "--name"} <= flags
    ctx = command.make_context("synth", ["out", "--dp", "3", "--step-gap", "0.002",
                                         "--sync", "ddp", "--slow-worker", "2,1,1.5"])
    assert (ctx.params["dp"], ctx.params["step_gap"], ctx.params["sync"], ctx.params["pp"]) == \
        (3, 0.002, "ddp", 4)
    with pytest.raises(typer.BadParameter) as err:   # a check across settings names one
        command.main(["out", "--pp", "1", "--vpp", "2"], prog_name="synth", standalone_mode=False)
    assert "'--vpp'" in err.value.format_message() and "needs pp >= 2" in str(err.value)
