"""The rich console report shows the key facts of an analysis result."""

from __future__ import annotations

import pytest
from report_results import clean_result, json_round_trip, straggling_result
from rich.console import Console

from stragglers.errors import InputError
from stragglers.report import as_result, print_report
from stragglers.report.console import slowdown_style


def render(result, **console_kwargs) -> str:
    console = Console(record=True, width=130, **console_kwargs)
    print_report(result, console)
    return console.export_text(styles=bool(console_kwargs))


@pytest.mark.parametrize("round_trip", [False, True], ids=["int-keys", "json-str-keys"])
def test_straggling_job_report_has_the_key_facts(round_trip):
    result = straggling_result()
    text = render(json_round_trip(result) if round_trip else result)
    # Headline: job, S, W, verdict, replay error, step times.
    for fact in ("gpt-13b-run7", "dp 4 × pp 4 × tp 2", "world size 32", "S = 1.452",
                 "W = 1 − 1/S = 31.1%", "STRAGGLING", "sim_error 0.80%", "1.848 s",
                 "M_W (top 3% workers) 0.610", "M_S (last stage) 0.440"):
        assert fact in text, fact
    assert "never launched" in text  # the result's warnings are shown
    # Attribution tables, with the biggest op type first.
    assert text.index("backward-compute") < text.index("forward-compute") < text.index("optimizer")
    assert "By PP stage" in text and "By DP rank" in text
    # Worker grid: stage 1 row holds the hot worker dp 2.
    row1 = next(line for line in text.splitlines() if line.strip().startswith("1   1.21"))
    assert row1.split() == ["1", "1.21", "1.20", "1.38", "1.22"]
    assert "hottest workers: dp 2/pp 1 1.380" in text
    # Top steps by slowdown: step 21 first.
    steps = text[text.index("Slowest steps"):]
    assert steps.index("21") < steps.index("1.470")
    # Diagnosis in words, most important first, with where/evidence/speedup.
    diag = text[text.index("Diagnosis"):]
    assert diag.index("Worker fault") < diag.index("Stage partitioning imbalance") \
        < diag.index("Garbage-collection pauses")
    assert "Worker fault — worker dp 2 / pp 1" in diag and "1.25× faster" in diag
    assert "in 8 of 8 steps" in diag and "DP ranks 0, 3; PP stage 2; step 21" in diag


def test_hot_cells_are_coloured():
    ansi = render(straggling_result(), force_terminal=True, color_system="standard")
    assert slowdown_style(1.38) == "bold red" and slowdown_style(1.0) == "green"
    assert "\x1b[1;31m1.38" in ansi  # the faulty worker's cell in bold red
    assert "\x1b[32m1.00" in ansi  # a clean cell in green


def test_clean_job_skips_the_attribution_gracefully():
    text = render(json_round_trip(clean_result()))
    assert "not straggling" in text and "S = 1.012" in text
    assert "Attribution skipped" in text
    assert "Worker score" not in text and "By op type" not in text
    assert "No straggler — whole job" in text


def test_wide_jobs_get_a_compact_grid():
    result = straggling_result()
    result["worker_scores"] = [{"dp": d, "pp": p, "score": 1.45 if (d, p) == (40, 1) else 1.0}
                               for d in range(64) for p in range(4)]
    text = render(result)
    grid_rows = [line for line in text.splitlines() if "█" in line]
    assert len(grid_rows) == 4 and max(len(r.rstrip()) for r in grid_rows) < 130
    assert grid_rows[1].rstrip().endswith("█" * 64)
    assert "hottest workers: dp 40/pp 1 1.450" in text


def test_minimal_result_renders():
    text = render({"slowdown": 1.2})
    assert "unnamed job" in text and "S = 1.200" in text and "16.7%" in text
    assert "No diagnosis" in text


@pytest.mark.parametrize("bad, field", [
    ({}, "slowdown"),
    ({"slowdown": "fast"}, "slowdown"),
    ({"slowdown": 1.2, "by_stage": {"x": 1.0}}, "by_stage"),
    ({"slowdown": 1.2, "worker_scores": [{"dp": 0}]}, "worker_scores[0].pp"),
    ({"slowdown": 1.2, "diagnosis": [{"where": {}}]}, "diagnosis[0].cause"),
])
def test_bad_results_raise_input_errors(bad, field):
    with pytest.raises(InputError) as err:
        as_result(bad)
    assert err.value.field == field
    with pytest.raises(InputError):
        print_report([1, 2])  # not an object at all


def test_a_poor_replay_fit_is_flagged():
    result = clean_result()
    result["sim_error"] = 0.072
    text = render(result)
    assert "sim_error 7.20%" in text and "above 5%" in text


def test_missing_attribution_above_the_threshold_is_not_called_skipped():
    text = render({"slowdown": 1.2, "job": {"name": "live", "dp": 2, "pp": 1, "dsp": 2}})
    assert "carries no attribution" in text and "Attribution skipped" not in text
    assert "dp 2 × pp 1 × dsp 2" in text
