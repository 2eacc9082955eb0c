"""A pipeline job's all-reduce whose process group spans stages (clipping's gradient norm over
every rank, a tied embedding's over the first and last stage) is the model's cross-stage op,
not a stage's data-parallel all-reduce: read as one, a stage's wait for another was taken for
transfer time (trace/kineto/ops.py cross_stage_optype)."""

from __future__ import annotations

import numpy as np
import pytest

from stragglers.trace.kineto.ops import Coll, Placement, RankParts, cross_stage_optype
from stragglers.trace.load import load_trace
from stragglers.trace.synth.kineto import GpuJob, write_gpu_job
from stragglers.whatif import analyze


def _named(result) -> set[tuple[str, int]]:
    return {(f.cause, int(w.rank)) for f in result.diagnosis for w in f.where.workers or []} \
        or {(f.cause, -1) for f in result.diagnosis}


def _job(tmp_path, tp: int, **injection):
    return write_gpu_job(GpuJob(ranks=8, steps=6, seed=7, pp_size=2, tp_size=tp,
                                microbatches=3, all_to_alls=0, grad_norm=True, ranks_per_host=8,
                                **injection), tmp_path)


@pytest.mark.parametrize("tp", [1, 2])
def test_the_gradient_norm_over_every_stage_reads_as_the_clipping_all_reduce(tmp_path, tp):
    _job(tmp_path, tp)
    trace = load_trace(tmp_path)
    names = np.array(trace.optype_names())
    clip = names == "optimizer-clip-main-grad"
    # one per rank and step, every rank of both stages
    assert clip.sum() == 8 * 6 and set(trace.ops["stage"][clip].tolist()) == {0, 1}
    result = analyze(trace)
    assert _named(result) == {("none", -1)} and result.slowdown >= 1.0, result.slowdown


@pytest.mark.parametrize("tp, slow", [(1, 1), (2, 1), (1, 5)])
def test_a_slow_rank_of_a_clipped_pipeline_is_named_alone(tmp_path, tp, slow):
    truth = _job(tmp_path, tp, slow_rank=(slow, 1.6))
    assert _named(analyze(load_trace(tmp_path))) == {(c["cause"], r) for c in truth["causes"]
                                                     for r in c["ranks"]}


def _parts(groups: dict[str, tuple[int, ...]]) -> RankParts:
    empty = np.zeros(0)
    return RankParts("f", 0, None, 0, None, {}, True, groups, "gpu", [1], [(0.0, 1.0)],
                     empty, empty, empty, empty, empty, [])


def _allreduce(pg: str | None) -> Coll:
    return Coll(0.0, 1.0, 0.0, 0, "allreduce", pg, None, None, None)


def test_which_stages_a_group_spans_names_the_cross_stage_op():
    # pp 3, 4 ranks a stage (rank // 4)
    here = Placement(0, 0, 0, lambda r: r // 4, 3)
    parts = _parts({"world": tuple(range(12)), "emb": (0, 8), "dp": (0, 1, 2, 3)})
    assert cross_stage_optype("allreduce", _allreduce("world"), parts, here) == \
        "optimizer-clip-main-grad"
    assert cross_stage_optype("allreduce", _allreduce("emb"), parts, here) == \
        "embedding-grads-all-reduce"
    for pg in ("dp", None, "unknown"):   # the stage's own group, or no group to judge by
        assert cross_stage_optype("allreduce", _allreduce(pg), parts, here) is None
    alone = Placement(0, 0, 0, None, 1)
    assert cross_stage_optype("allreduce", _allreduce("world"), parts, alone) is None


def test_the_cli_writes_pipelined_ring_attention_jobs_that_clip(tmp_path):
    from typer.testing import CliRunner

    from stragglers.cli import app

    runner = CliRunner()
    out = runner.invoke(app, ["synth-gpu", str(tmp_path / "job"), "--ranks", "8", "--steps", "2",
                              "--pp-size", "2", "--microbatches", "2", "--cp-size", "2",
                              "--cp-comm", "ring", "--grad-norm", "--all-to-alls", "0"])
    assert out.exit_code == 0, out.output
    trace = load_trace(tmp_path / "job")
    names = set(trace.optype_names())
    assert trace.meta.pp_size == 2
    assert {"send-recv", "forward-send", "optimizer-clip-main-grad"} <= names, names
    for args, words in ((["--pp-size", "3"], "does not divide the 8 ranks"),
                        (["--cp-comm", "p2p"], "expected all_gather, ring or all_to_all")):
        bad = runner.invoke(app, ["synth-gpu", str(tmp_path / "bad"), "--ranks", "8", *args])
        assert bad.exit_code != 0 and words in str(bad.exception), (args, bad.output)
