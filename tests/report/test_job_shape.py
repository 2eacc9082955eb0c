"""The job's shape in the result and the headline: the mesh's degrees where the trace gives
them (a tensor-parallel trace has a worker per TP rank, so its table's dp counts dp·tp)."""

from __future__ import annotations

from pathlib import Path

from stragglers.report.summary import shape_words
from stragglers.trace.load import load_trace
from stragglers.trace.synth import generate
from stragglers.whatif import analyze
from stragglers.whatif.result import AnalysisResult, parallel_degrees

RECORDED_MOE = Path(__file__).parents[1] / "data" / "recorded" / "moe-alternating-routing-quiet-0"


def _with_extra(**extra):
    trace = generate(dp=4, pp=2, microbatches=2, steps=4, seed=3)
    trace.meta.extra.update(extra)
    return trace


def test_a_recorded_mesh_is_the_job_shape_not_the_worker_table():
    trace = _with_extra(parallel={"dp": 2, "tp": 2, "cp": 1, "ep": 1, "pp": 2})
    result = analyze(trace)
    assert result.job.dp == 4 and result.job.parallel == {"dp": 2, "tp": 2, "cp": 1, "ep": 1,
                                                          "pp": 2}
    assert shape_words(result) == "dp 2 × tp 2 × pp 2 (4 workers per stage)"
    # and it survives the JSON round trip
    again = AnalysisResult.from_json(result.to_json())
    assert shape_words(again) == shape_words(result)


def test_a_readers_model_parallel_groups_give_the_data_parallel_degree():
    # a Kineto trace whose process groups show tp 2: the table's 4 workers are dp 2 × tp 2
    assert parallel_degrees(_with_extra(group_sizes={"tp": 2}).meta) == {
        "dp": 2, "tp": 2, "cp": 1, "ep": 1, "pp": 2}
    # groups that do not tile the table say only what they show
    assert parallel_degrees(_with_extra(group_sizes={"tp": 3}).meta) == {"tp": 3}


def test_nothing_beyond_the_table_keeps_the_old_words_and_bad_values_are_left_out():
    plain = analyze(generate(dp=2, pp=2, microbatches=2, steps=4, seed=1))
    assert plain.job.parallel == {} and shape_words(plain) == "dp 2 × pp 2 × tp 1"
    odd = _with_extra(parallel={"dp": "2", "tp": True, "cp": 0, "ep": 4, "pp": 2, "zz": 9})
    assert parallel_degrees(odd.meta) == {"ep": 4, "pp": 2}


def test_a_recorded_moe_run_reads_expert_parallel_4():
    result = analyze(load_trace(RECORDED_MOE))
    assert result.job.parallel["ep"] == 4
    assert shape_words(result).startswith("dp 4 × ep 4 × pp 1")
