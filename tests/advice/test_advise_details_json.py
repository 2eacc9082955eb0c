"""The typed remedy details and act params write the JSON `advise --json` and train_advised
have always written: the same keys, in the same order, with the typed fields' values."""

from __future__ import annotations

import dataclasses
import json

import pytest

from stragglers.advice import advise
from stragglers.advice.act import (ActDecision, ActDecisionJson, AdvisePolicy, GCParams,
                                   SplitParams, StragglarParams)
from stragglers.advice.plan import Plan, PlanJson, RemedyAdvice, RemedyAdviceJson
from stragglers.advice.remedies.details import (BatchSplit, CodeDetails, Details,
                                                DiagnosedDetails, Restart, StragglarDetails)
from stragglers.trace.synth import generate
from test_act_policy import run, slow_rank_3  # a sibling: pytest puts tests/advice on sys.path

BIG_ALLREDUCE = {"kind": "collective", "optype": "grads-all-reduce", "stage": None, "factor": 20}
DIAGNOSED = ["where", "diagnosis_speedup", "diagnosis_speedup_alone"]
DIAGNOSIS_TAIL = ["diagnosis_interval", "diagnosis_upper_bound", "diagnosis_basis"]
BUCKET = ["straggler_dp_rank", "last_share", "median_lead_s", "library_transfer_s", "phase1_s",
          "phase2_s"]

# job, advise knobs, remedy -> (details type, its JSON keys in order), as written before the
# details were typed (captured from `Plan.to_json` of these jobs)
CASES = [
    (dict(slow_worker=(3, 0, 2.0)), dict(remaining_steps=100_000),
     {"antdt-dd": (BatchSplit, ["batch_sizes", "new_batch_sizes", "split_weights",
                                "compute_curves"]),
      "gradient-coding-s1": (CodeDetails, ["s", "scheme", "exchange_s"]),
      "planned-gc": (Details, []), "stragglar": (StragglarDetails, ["bucket 0"])}),
    (dict(seed=1, slow_worker=(2, 0, 2.0)), dict(remaining_steps=20, restart_cost_s=10.0),
     {"antdt-nd": (Restart, ["worker", "compute_ratio", "fixed_step_s", "restart_cost_s",
                             "remaining_steps", "gain_s", "spec_gain_s"])}),
    (dict(seed=1, slow_worker=(2, 0, 2.0)), {},
     {"antdt-nd": (Restart, ["worker", "compute_ratio", "fixed_step_s", "restart_cost_s",
                             "remaining_steps"])}),
    (dict(microbatches=4, gc=(0.5, 0.08)), {},
     {"planned-gc": (DiagnosedDetails, ["where", "diagnosis_speedup", "every", "full_pause_s",
                                        "full_per_rank_step", "planned_pause_s"])}),
    (dict(microbatches=4, gc_in_compute=(0.5, 0.08)), {},
     {"planned-gc": (DiagnosedDetails, DIAGNOSED + ["every", "full_pause_s",
                                                    "full_per_rank_step"] + DIAGNOSIS_TAIL)}),
    (dict(pp=2, microbatches=8, steps=8, heavy_last_stage=1.6), {},
     {"stage-split": (DiagnosedDetails, DIAGNOSED + DIAGNOSIS_TAIL)}),
]


@pytest.mark.parametrize("job, knobs, expected", CASES)
def test_each_remedys_details_write_the_keys_advise_always_wrote(job, knobs, expected):
    spec = dict(dp=4, pp=1, microbatches=2, steps=12, sync="ddp", seed=0) | job
    plan = advise(generate(**spec), **knobs)
    written = json.loads(plan.to_json())
    for name, (kind, keys) in expected.items():
        advice = plan.get(name)
        raw = next(r for r in written["remedies"] if r["name"] == name)["details"]
        assert type(advice.details) is kind and list(raw) == keys, (name, list(raw))
        if isinstance(advice.details, StragglarDetails):
            assert list(raw["bucket 0"]) == BUCKET
            assert raw["bucket 0"]["phase2_s"] == advice.details.buckets[0].phase2_s
        elif isinstance(advice.details, BatchSplit):
            assert raw["new_batch_sizes"] == advice.details.new_batch_sizes
        elif isinstance(advice.details, DiagnosedDetails) and "every" in keys:
            assert raw["every"] == advice.details.every
    # the details sit where they always did among the advice's keys
    assert list(written["remedies"][0])[-2:] == ["details", "interval"]


def test_act_decisions_write_their_params_as_json_objects():
    dd = run(AdvisePolicy(4, 64, window=4, settle=1), slow_rank_3, 20)
    assert isinstance(dd[0].params, SplitParams)
    row = dd[0].to_dict()
    assert list(row) == ["kind", "remedy", "step", "params", "baseline_step_s",
                         "predicted_step_s", "predicted_speedup", "measured_step_s",
                         "measured_speedup", "reason", "source"]
    assert row["params"] == {"batch_sizes": dd[0].params.batch_sizes}
    gc = run(AdvisePolicy(4, 64, window=4, settle=1, force={"name": "planned-gc"}), slow_rank_3, 8)
    assert gc[0].params == GCParams(every=5) and gc[0].to_dict()["params"] == {"every": 5}
    hook = run(AdvisePolicy(4, 64, window=4, settle=1, force={"name": "stragglar"}), slow_rank_3, 8)
    assert isinstance(hook[0].params, StragglarParams)
    assert json.loads(json.dumps(hook[0].to_dict()))["params"] == \
        {"straggler": hook[0].params.straggler}


@pytest.mark.parametrize("kind, form", [(RemedyAdvice, RemedyAdviceJson), (Plan, PlanJson),
                                        (ActDecision, ActDecisionJson)])
def test_each_json_form_declares_every_field_in_order(kind, form):
    # to_dict writes its TypedDict key by key (the checker holds it to the form): a field added
    # to the dataclass alone would be left out of the JSON
    assert list(form.__annotations__) == [f.name for f in dataclasses.fields(kind)]

