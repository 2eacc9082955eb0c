"""The diagnosis does not depend on the trace format: the same job in every writable format
gives the same findings (host stall and worker fault included)."""

import pytest

from stragglers.trace.ndtimeline import read_ndtimeline, write_ndtimeline
from stragglers.trace.runformat import read_run, write_run
from stragglers.trace.synth import generate
from stragglers.whatif import analyze


def summary(result):
    return [(d.cause, sorted((w.dp, w.pp) for w in d.where.workers),
             round(d.speedup_if_fixed, 6)) for d in result.diagnosis]


@pytest.fixture(scope="module")
def job():
    return generate(dp=4, pp=2, microbatches=4, steps=6, seed=11, slow_worker=(0, 1, 1.8),
                    host_stall={"dp": 3, "stage": 0, "seconds": 0.2})


def test_both_workers_are_named_with_their_causes(job):
    got = {c: w for c, w, _ in summary(analyze(job))}
    assert got == {"worker_fault": [(0, 1)], "host_stall": [(3, 0)]}


@pytest.mark.parametrize("fmt", ["run", "ndtimeline"])
def test_same_diagnosis_after_a_round_trip(job, fmt, tmp_path):
    if fmt == "run":
        write_run(tmp_path / "run", job)
        back = read_run(tmp_path / "run")
    else:
        path, _ = write_ndtimeline(job, tmp_path / "trace-job.parquet")
        back = read_ndtimeline(path)
    assert summary(analyze(back)) == summary(analyze(job))
