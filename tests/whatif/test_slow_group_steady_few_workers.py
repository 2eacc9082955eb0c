"""With fewer than five workers a stage, a slow group behind the fast workers in every step of
five or more is a `slow_group` by the test worker_fault has for one steady worker (×1.06),
not two worker faults.

slow_group asked a group of 2-4 workers for a persistent 15%, while worker_fault names a worker
behind its peers in every step at ×1.06: two ranks of four ×1.14 alike were named as two worker
faults (the wider-range GPU jobs, seed 32), and so were groups ×1.13-1.14 over two pipeline
stages of two workers each (diagnosis_slow_group_stages seed 11 at ×1.1-1.4: jobs 78, 102, 132).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stragglers.trace.load import load_trace
from stragglers.trace.synth.kineto import GpuJob, write_gpu_job
from stragglers.whatif import analyze


def _found(tmp_path: Path, **shape) -> list[tuple[str, list[int]]]:
    job = GpuJob(steps=8, seed=3, buckets=3, jitter=0.02, host_jitter_us=150, **shape)
    write_gpu_job(job, tmp_path / "job")
    return sorted((f.cause, sorted(w.rank for w in f.where.workers or []))
                  for f in analyze(load_trace(tmp_path / "job")).diagnosis)


@pytest.mark.parametrize("shape", [
    dict(ranks=4, slow_group=((1, 2), 1.12)),                              # DDP, 2 of 4
    pytest.param(dict(ranks=8, pp_size=2, microbatches=3, ranks_per_host=8, cp_size=2,
                      cp_comm="ring", slow_group=((1, 6), 1.12)),          # one of 2 a stage
                 marks=pytest.mark.slow),
], ids=["ddp4", "ring-cp2-pp2"])
def test_a_steady_group_of_few_workers_is_a_slow_group(tmp_path, shape):
    ranks = sorted(shape["slow_group"][0])
    assert _found(tmp_path, **shape) == [("slow_group", ranks)]


def test_one_steady_worker_of_four_stays_a_worker_fault(tmp_path):
    assert _found(tmp_path, ranks=4, slow_rank=(2, 1.12)) == [("worker_fault", [2])]
