"""AnalysisResult: typed, strict JSON with plain values, read back the same, shown by every report."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from report_results import straggling_result
from rich.console import Console

from stragglers.errors import InputError
from stragglers.report import print_report, render_html
from stragglers.report.summary import describe_where, fix_fraction_words
from stragglers.trace.synth import generate
from stragglers.whatif import analyze
from stragglers.whatif.result import (SCHEMA_VERSION, AnalysisResult, Where, WorkerRef,
                                      json_schema)

# The field names `stragglers analyze --json` wrote before the typed result: all still there.
OLD_FIELDS = {"job", "slowdown", "waste", "straggling", "sim_error", "launch_slowdown", "T_base",
              "T_nodelay", "T_ideal", "step_slowdown", "step_times", "ideal_durations",
              "by_optype", "by_stage", "by_dp_rank", "worker_scores", "M_W", "M_S", "diagnosis",
              "warnings"}
PLAIN = (dict, list, str, int, float, bool, type(None))


@pytest.fixture(scope="module")
def slow_job():
    return generate(dp=2, pp=2, microbatches=4, steps=5, seed=1, slow_worker=(1, 1, 1.6))


@pytest.fixture(scope="module")
def slow_result(slow_job):
    return analyze(slow_job)


def walk(value, path="$"):
    """Every (path, value) in a nested structure, keys included."""
    yield path, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield f"{path}.key({k!r})", k
            yield from walk(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from walk(v, f"{path}[{i}]")


def render(result) -> str:
    console = Console(record=True, width=140)
    print_report(result, console)
    return console.export_text()


def test_json_keeps_the_field_names_and_is_strict(slow_result):
    d = slow_result.to_dict()
    assert OLD_FIELDS <= set(d) and d["schema_version"] == SCHEMA_VERSION
    for path, v in walk(d):
        assert type(v) in PLAIN, f"{path} is {type(v).__name__}"  # no np.str_ / np.float64
    text = slow_result.to_json()

    def refuse(token):
        raise AssertionError(f"{token} written into JSON")

    back = json.loads(text, parse_constant=refuse)
    assert back["diagnosis"][0]["cause"] == "worker_fault"
    assert AnalysisResult.from_dict(back).to_dict() == d  # read back, the same result


def test_nan_and_inf_never_reach_json():
    r = AnalysisResult(slowdown=1.2, sim_error=float("nan"), m_s=np.float64("inf"),
                       by_stage={np.int64(0): np.float64("nan")})
    back = json.loads(r.to_json(), parse_constant=lambda t: pytest.fail(t))
    assert back["sim_error"] is None and back["M_S"] is None and back["by_stage"] == {"0": None}


def test_the_result_is_typed_from_the_detector_on(slow_result):
    f = slow_result.diagnosis[0]
    assert isinstance(f.where, Where) and isinstance(f.where.workers[0], WorkerRef)
    assert f.where.workers[0].rank == 3 and f.interval.low <= f.speedup_if_fixed <= f.interval.high
    assert f.basis == "alone" and f.speedup_alone == f.speedup_if_fixed
    assert slow_result.worker_scores[0].rank is not None
    with pytest.raises(TypeError):
        slow_result["slowdown"]  # no dict layer: attributes only


def test_the_checked_in_json_schema_is_generated_from_the_types():
    schema = json_schema()
    body = schema["$defs"]["AnalysisResult"]
    assert body["properties"]["schema_version"] == {"const": SCHEMA_VERSION}
    assert {"T_base", "M_W", "diagnosis", "notes"} <= set(body["properties"])
    assert schema["$defs"]["Interval"]["minItems"] == 2
    checked_in = Path(__file__).parents[2] / "docs" / "result.schema.json"
    assert json.loads(checked_in.read_text()) == schema, \
        "docs/result.schema.json is stale: run `stragglers schema > docs/result.schema.json`"


@pytest.mark.parametrize("bad, field", [
    ({}, "slowdown"),
    ({"slowdown": "fast"}, "slowdown"),
    ({"slowdown": 1.2, "schema_version": SCHEMA_VERSION + 1}, "schema_version"),
    ({"slowdown": 1.2, "straggling": "yes"}, "straggling"),
    ({"slowdown": 1.2, "notes": [3]}, "notes[0]"),
    ({"slowdown": 1.2, "diagnosis": [{"cause": "gc", "speedup_if_fixed": "x"}]},
     "diagnosis[0].speedup_if_fixed"),
    ({"slowdown": 1.2, "diagnosis": [{"cause": "gc", "interval": [1.1]}]}, "diagnosis[0].interval"),
    ({"slowdown": 1.2, "diagnosis": [{"cause": "gc", "upper_bound": "no"}]},
     "diagnosis[0].upper_bound"),
    ({"slowdown": 1.2, "diagnosis_summary": {"all_fixed": "fast"}}, "diagnosis_summary.all_fixed"),
    ({"slowdown": 1.2, "warmup_steps": [0.5]}, "warmup_steps[0]"),
    ({"slowdown": 1.2, "job": {"dp": "four"}}, "job.dp"),
    ({"slowdown": 1.2, "job": {"missing_workers": [3]}}, "job.missing_workers[0]"),
    ({"slowdown": 1.2, "worker_scores": [{"dp": 0, "score": 1.1}]}, "worker_scores[0].pp"),
    ({"slowdown": 1.2, "diagnosis": [{"where": {}}]}, "diagnosis[0].cause"),
    ({"slowdown": 1.2, "diagnosis": [{"cause": "gc", "where": {"workers": [{"dp": "x"}]}}]},
     "diagnosis[0].where.workers[0].dp"),
    ({"slowdown": 1.2, "diagnosis": [{"cause": "gc", "basis": "somehow"}]}, "diagnosis[0].basis"),
    ({"slowdown": 1.2, "by_stage": {"first": 1.1}}, "by_stage"),
])
def test_bad_json_names_the_field(bad, field):
    with pytest.raises(InputError) as err:
        AnalysisResult.from_dict(bad)
    assert err.value.field == field


def test_fields_no_schema_declares_are_not_carried():
    raw = {**straggling_result(), "combined": {"speedup_if_fixed": 1.4}}
    raw["diagnosis"][0]["blame"] = "the switch"
    r = AnalysisResult.from_dict(json.loads(json.dumps(raw)))
    assert "combined" not in r.to_dict() and "blame" not in r.to_dict()["diagnosis"][0]


@pytest.mark.slow
def test_reports_read_the_result_or_its_json_alike(slow_result):
    assert render(slow_result) == render(json.loads(slow_result.to_json()))
    assert render_html(slow_result) == render_html(json.loads(slow_result.to_json()))


def test_reader_notes_reach_console_json_and_html(slow_job):
    trace = slow_job.select(np.ones(len(slow_job), bool))
    trace.note("ranks", "4 of 16 ranks read; missing ranks 4-15")
    trace.note("clock", "clock alignment residual 0.31 ms (rank 3)")
    trace.note("dropped", "12 point-to-point send(s) left out: no peer")
    with pytest.raises(ValueError):
        trace.note("gossip", "not a kind")
    r = analyze(trace)
    assert [n["kind"] for n in r.to_dict()["notes"]] == ["ranks", "clock", "dropped"]
    text = render(r)
    assert "What the trace does not show" in text
    for words in ("ranks: 4 of 16 ranks read", "clock alignment: clock alignment residual",
                  "dropped: 12 point-to-point"):
        assert words in text, words
    page = render_html(r)
    assert 'id="notes"' in page and "missing ranks 4-15" in page


def test_missing_workers_are_stated(slow_job):
    partial = slow_job.select(slow_job.ops["dp_rank"] == 0)  # dp 1 not traced, meta says dp 2
    r = analyze(partial)
    assert r.job.workers_read == 2 and r.job.missing_workers == [(1, 0), (1, 1)]
    assert "2 of 4 DP×PP workers traced; missing: pp 0: dp 1; pp 1: dp 1" in render(r)
    assert "missing: pp 0: dp 1" in render_html(r)


def test_op_counts_follow_steps(slow_job):
    steps = sorted(set(slow_job.ops["step"].tolist()))[:2]
    r = analyze(slow_job, steps=steps)
    assert r.job.steps == 2
    assert r.job.ops == int(np.isin(slow_job.ops["step"], steps).sum()) < len(slow_job)
    assert f"{r.job.ops:,} ops analysed" in render(r)


def test_fix_fractions_outside_0_1_are_explained():
    assert fix_fraction_words("M_S", 0.4, "the last stage") is None
    above = {**straggling_result(), "M_S": 1.22}
    assert "M_S > 1" in render(above) and "M_S &gt; 1" in render_html(above)
    below = {**straggling_result(), "M_S": -0.3}
    text = render(below)
    assert "M_S < 0" in text and "already runs faster" in text


def test_launch_delay_slowdown_is_defined(slow_result):
    assert "launch-delay slowdown = measured step time / step time replayed without launch" \
        in render(slow_result).replace("\n", " ").replace("  ", " ")
    assert "<b>Launch-delay slowdown</b>" in render_html(slow_result)


def test_where_words_are_plural_only_when_plural():
    two = Where(dp=[0, 3], pp=[2], workers=[WorkerRef(0, 2), WorkerRef(3, 2, 7, "node-1")])
    assert describe_where(two) == "workers dp 0 / pp 2, dp 3 / pp 2 (rank 7, node-1)"
    assert describe_where(Where(workers=[WorkerRef(1, 1)])) == "worker dp 1 / pp 1"
    assert describe_where(Where(dp=[1], pp=[1])) == "worker dp 1 / pp 1"
    assert describe_where(Where(steps=[5])) == "step 5"
    assert describe_where(Where()) == "whole job"
    assert "workerss" not in describe_where(Where(workers=[WorkerRef(0, 0)] * 3))


def cli(*args):
    return subprocess.run([sys.executable, "-m", "stragglers.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_fail_on_straggling_exit_codes(slow_job, tmp_path):
    from stragglers.trace.runformat import write_run

    run = write_run(tmp_path / "slow", slow_job)
    out = tmp_path / "r.json"
    proc = cli("analyze", run, "-q", "--json", out, "--fail-on-straggling")
    assert proc.returncode == 1, proc.stderr
    assert "straggling: S =" in proc.stderr and out.exists()  # reports written before failing
    s = json.loads(out.read_text())["slowdown"]
    proc = cli("analyze", run, "-q")
    assert proc.returncode == 0, proc.stderr  # without the flag: success
    proc = cli("analyze", run, "-q", "--fail-on-straggling",
               "--fail-threshold", f"{math.ceil(s * 100) / 100 + 0.01}")
    assert proc.returncode == 0, proc.stderr  # below the given threshold: success


@pytest.mark.slow
def test_steps_all_keeps_the_warm_up(slow_job, tmp_path):
    from stragglers.trace.runformat import write_run

    trace = slow_job.select(np.ones(len(slow_job), bool))
    first = trace.ops["step"] == trace.ops["step"].min()
    # A warm-up step: everything in the first step takes 5x as long, laid out end to end.
    for stage, dp in {(int(p), int(d)) for p, d in zip(trace.ops["stage"], trace.ops["dp_rank"])}:
        rows = np.flatnonzero(first & (trace.ops["stage"] == stage) & (trace.ops["dp_rank"] == dp))
        t0 = trace.ops["start_ts"][rows].min()
        trace.ops["start_ts"][rows] = t0 + (trace.ops["start_ts"][rows] - t0) * 5
        trace.ops["duration"][rows] *= 5
    later = trace.ops["step"] > trace.ops["step"].min()
    trace.ops["start_ts"][later] += 4 * (trace.end_ts[first].max() - trace.ops["start_ts"][first].min())
    run = write_run(tmp_path / "warm", trace)
    out = tmp_path / "r.json"
    assert cli("analyze", run, "-q", "--json", out).returncode == 0
    default = json.loads(out.read_text())
    assert default["warmup_steps"] == [0] and default["job"]["steps"] == 4
    proc = cli("analyze", run, "-q", "--steps", "all", "--json", out)
    assert proc.returncode == 0, proc.stderr
    kept = json.loads(out.read_text())
    assert kept["warmup_steps"] == [] and kept["job"]["steps"] == 5
    assert "0" in kept["step_slowdown"] and kept["job"]["ops"] > default["job"]["ops"]


# Findings as `analyze --json` wrote them in schema 1, before their documented fields were typed
# (one of each: expert_imbalance with capacity factors, after_others, below_threshold, `none`).
BEFORE_TYPING = Path(__file__).parent / "data" / "findings_before_typing.json"


def test_schema_1_json_is_read_and_written_back_with_every_field():
    raw = json.loads(BEFORE_TYPING.read_text())
    assert raw.get("schema_version", 1) == 1
    r = AnalysisResult.from_dict(raw)
    moe, stall, minor, none = r.diagnosis
    assert moe.capacity_factor["1.25"].dropped > 0 and moe.basis == "alone"
    assert stall.basis == "after_others" and stall.speedup_alone < stall.speedup_if_fixed
    assert minor.below_threshold and not stall.below_threshold
    assert none.basis is none.speedup_alone is none.capacity_factor is None
    written = r.to_dict()["diagnosis"]
    for old, new in zip(raw["diagnosis"], written):
        assert {k: new[k] for k in old} == old  # every value schema 1 wrote, the same
    assert written[3]["basis"] is None and written[3]["below_threshold"] is False


def test_findings_without_the_later_fields_still_load():
    raw = json.loads(BEFORE_TYPING.read_text())
    for f in raw["diagnosis"]:
        for key in ("basis", "speedup_alone", "capacity_factor", "below_threshold"):
            f.pop(key, None)
    r = AnalysisResult.from_dict(raw)
    assert [f.basis for f in r.diagnosis] == [None] * 4
    assert [f.below_threshold for f in r.diagnosis] == [False] * 4


@pytest.mark.parametrize("entry, field", [
    ({"capacity_factor": {"1": {"speedup": "x"}}}, "diagnosis[0].capacity_factor.speedup"),
    ({"capacity_factor": {"1": 1.2}}, "diagnosis[0].capacity_factor"),
    ({"capacity_factor": [1.2]}, "diagnosis[0].capacity_factor"),
    ({"speedup_alone": "fast"}, "diagnosis[0].speedup_alone"),
    ({"below_threshold": "yes"}, "diagnosis[0].below_threshold"),
])
def test_bad_finding_fields_name_the_field(entry, field):
    with pytest.raises(InputError) as err:
        AnalysisResult.from_dict({"slowdown": 1.2, "diagnosis": [{"cause": "gc", **entry}]})
    assert err.value.field == field
