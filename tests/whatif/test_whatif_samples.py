"""The what-if engine on the real NDTimeline samples: the reference numbers of docs/whatif.md §8."""

import json
import subprocess
import sys

import pytest

from stragglers.trace.ndtimeline import read_ndtimeline
from stragglers.whatif import analyze


@pytest.fixture(scope="module")
def results(ndtimeline_dir):
    return {name: analyze(read_ndtimeline(ndtimeline_dir / f"trace-{name}.parquet"))
            for name in ("ST", "AR", "SE")}


def close(value, expected, rel=0.01):
    return abs(value - expected) <= rel * abs(expected)


def test_st_matches_reference_numbers(results):
    r = results["ST"]
    assert close(r.slowdown, 1.1787)
    assert close(r.launch_slowdown, 1.0192)
    for stage, expected in {0: 0.998, 1: 0.983, 2: 0.983, 3: 1.232}.items():
        assert close(r.by_stage[stage], expected), (stage, r.by_stage[stage])
    assert close(r.by_optype["forward-compute"], 1.0875)
    assert close(r.by_optype["backward-compute"], 1.0742)
    assert close(r.m_s, 1.219)
    assert abs(r.m_w - 0.031) <= 0.01 * 0.031 + 1e-4


def test_replay_with_launch_delays_reproduces_measured(results):
    for name, r in results.items():
        assert r.sim_error < 1e-3, name


@pytest.mark.parametrize("name,cause,where", [
    ("ST", "stage_imbalance", {"pp": [3]}),
    ("AR", "worker_fault", {"dp": [0], "pp": [0]}),
    ("SE", "sequence_imbalance", None),
])
def test_samples_are_diagnosed(results, name, cause, where):
    first = results[name].diagnosis[0]
    assert first.cause == cause, results[name].diagnosis
    if where is not None:
        assert {k: getattr(first.where, k) for k in where} == where
    assert first.speedup_if_fixed > 1.05


@pytest.mark.slow
def test_json_keys_and_cli(ndtimeline_dir, tmp_path):
    out = tmp_path / "ar.json"
    proc = subprocess.run([sys.executable, "-m", "stragglers.cli", "analyze",
                           str(ndtimeline_dir / "trace-AR.parquet"), "--json", str(out), "-q"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    for key in ("job", "slowdown", "waste", "sim_error", "launch_slowdown", "step_slowdown",
                "by_optype", "by_stage", "by_dp_rank", "worker_scores", "M_W", "M_S", "diagnosis"):
        assert key in r
    assert set(r["job"]) >= {"name", "dp", "pp", "tp", "world_size", "steps", "ops"}
    assert r["job"]["world_size"] == 64 and r["job"]["ops"] == 117216
    assert {"dp", "pp", "score"} <= set(r["worker_scores"][0])
    assert abs(r["waste"] - (1 - 1 / r["slowdown"])) < 1e-12


def test_steps_filter(ndtimeline_dir):
    trace = read_ndtimeline(ndtimeline_dir / "trace-ST.parquet")
    r = analyze(trace, steps=[23, 25, 33])
    assert r.job.steps == 3
    assert set(r.step_slowdown) == {23, 25, 33}


def test_analysis_runs_without_torch(ndtimeline_dir):
    code = ("import sys; sys.modules['torch'] = None\n"
            "from stragglers.trace.ndtimeline import read_ndtimeline\n"
            "from stragglers.whatif import analyze\n"
            "from stragglers.report import print_report, write_html\n"
            f"r = analyze(read_ndtimeline({str(ndtimeline_dir / 'trace-ST.parquet')!r}))\n"
            "print_report(r)\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
