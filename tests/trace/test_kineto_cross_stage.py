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


def _without_groups(directory, hosts: int = 1) -> None:
    """The job's files as gloo's profiler writes them: no collective names its process group
    (no 'Process Group Name', no pg_config); `hosts` hosts, ranks spread over them."""
    import gzip
    import json
    for path in sorted(directory.glob("*.json*")):
        raw = path.read_bytes()
        gz = raw[:2] == b"\x1f\x8b"
        doc = json.loads(gzip.decompress(raw) if gz else raw)
        for e in doc["traceEvents"]:
            for key in ("Process Group Name", "Process Group Ranks", "Process Group Description"):
                e.get("args", {}).pop(key, None)
        doc["distributedInfo"].pop("pg_config", None)
        doc["host_name"] = f"host{doc['distributedInfo']['rank'] % hosts}"
        text = json.dumps(doc).encode()
        path.write_bytes(gzip.compress(text) if gz else text)


def test_a_gradient_norm_that_names_no_group_is_told_from_its_times(tmp_path):
    # gloo names no group: the last all-reduce of each step, in flight on every rank of both
    # stages together, is the gradient norm over every stage; the DP buckets stay a stage's
    truth = _job(tmp_path, 1, slow_rank=(1, 1.6))
    _without_groups(tmp_path)
    trace = load_trace(tmp_path)
    names = np.array(trace.optype_names())
    clip = names == "optimizer-clip-main-grad"
    assert clip.sum() == 8 * 6 and set(trace.ops["stage"][clip].tolist()) == {0, 1}
    assert (names == "grads-all-reduce").sum() > 0
    assert any("read as one group across the stages" in n.message for n in trace.notes)
    assert _named(analyze(trace)) == {(c["cause"], r) for c in truth["causes"]
                                      for r in c["ranks"]}


def test_without_one_clock_the_reading_stays_and_says_so(tmp_path):
    # ranks on two hosts: their clocks cannot show the op in flight everywhere together
    _job(tmp_path, 1)
    _without_groups(tmp_path, hosts=2)
    trace = load_trace(tmp_path)
    assert "optimizer-clip-main-grad" not in trace.optype_names()
    assert any("share no clock" in n.message for n in trace.notes), trace.notes


def test_an_all_reduce_whose_shapes_differ_between_stages_is_a_stages_own():
    from stragglers.trace.kineto.unnamed import WORLD, name_cross_stage
    # two ranks, one per stage, one all-reduce each, in flight together: the shapes decide
    def parts(rank: int, shapes: str) -> RankParts:
        p = _parts({})
        p.rank, p.host = rank, "h"
        p.colls = [Coll(0.0, 1.0, 0.0, 0, "allreduce", None, None, None, None, None, shapes)]
        return p
    where = {r: Placement(r, 0, r, lambda peer: peer, 2) for r in (0, 1)}
    for shapes, grouped in ((("[[1]]", "[[1]]"), True), (("[[116352]]", "[[116736]]"), False)):
        ranks = {r: parts(r, shapes[r]) for r in (0, 1)}
        notes = name_cross_stage(ranks, where)
        assert [ranks[r].colls[0].pg == WORLD for r in (0, 1)] == [grouped] * 2, notes


def test_a_step_that_a_rank_lacks_a_transfer_of_is_named_in_the_notes(tmp_path):
    # a rank's trace that lost one send (a reader defect or a cut trace) leaves a step the
    # analysis drops as incomplete: the reading says which step and what is missing
    import gzip
    import json
    _job(tmp_path, 1)
    path = tmp_path / "rank-0.json.gz"
    raw = path.read_bytes()
    gz = raw[:2] == b"\x1f\x8b"
    doc = json.loads(gzip.decompress(raw) if gz else raw)
    events = doc["traceEvents"]
    steps = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                   if str(e.get("name", "")).startswith("ProfilerStep#"))
    lo, hi, name = steps[2]
    sends = [e for e in events if e.get("cat") == "kernel" and e["args"].get(
        "Collective name") == "send" and lo <= e["ts"] <= hi]
    events.remove(sends[0])
    text = json.dumps(doc).encode()
    path.write_bytes(gzip.compress(text) if gz else text)
    trace = load_trace(tmp_path)
    step = int(name.split("#")[1])
    uneven = [n.message for n in trace.notes if "uneven communication" in n.message]
    assert len(uneven) == 1 and f"({step})" in uneven[0] and "rank 0" in uneven[0], trace.notes
    result = analyze(trace)
    assert step not in result.step_times["base"]   # what the note announces


def test_a_step_only_some_ranks_traced_is_named_in_the_notes(tmp_path):
    import gzip
    import json
    _job(tmp_path, 1)
    path = tmp_path / "rank-3.json.gz"
    doc = json.loads(gzip.decompress(path.read_bytes()))
    last = max((e for e in doc["traceEvents"] if str(e.get("name", "")).startswith(
        "ProfilerStep#") and e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    doc["traceEvents"].remove(last)     # rank 3's window ended a step earlier
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    trace = load_trace(tmp_path)
    step = int(last["name"].split("#")[1])
    partial = [n.message for n in trace.notes if "only some ranks" in n.message]
    assert len(partial) == 1 and f"({step})" in partial[0] and "rank(s) 3)" in partial[0], \
        trace.notes
    assert step not in analyze(trace).step_times["base"]


def test_an_all_reduce_on_some_stages_only_keeps_its_reading_and_says_so():
    # pp 2, dp 1: only stage 0 all-reduces (its own group): nothing spans every stage
    from stragglers.trace.kineto.unnamed import name_cross_stage
    ranks = {r: _parts({}) for r in (0, 1)}
    for r, p in ranks.items():
        p.rank, p.host = r, "h"
    ranks[0].colls = [Coll(0.0, 1.0, 0.0, 0, "allreduce", None, None, None, None)]
    notes = name_cross_stage(ranks, {r: Placement(r, 0, r, lambda peer: peer, 2)
                                     for r in (0, 1)})
    assert ranks[0].colls[0].pg is None and len(notes) == 1 and "rank(s) 1 have none" in notes[0]
