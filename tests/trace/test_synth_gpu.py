"""Synthetic GPU jobs as Kineto JSON: the reader and the diagnosis find what was injected.

The full grading (500 drawn jobs) is benchmarks/diagnosis_gpu_traces.py; here one job of each
kind, and the files themselves look like what Kineto writes.
"""

from __future__ import annotations

import gzip
import json

import pytest
from typer.testing import CliRunner

from stragglers.cli import app
from stragglers.trace.load import load_trace
from stragglers.trace.synth.kineto import GpuJob, write_gpu_job
from stragglers.whatif import analyze

CASES = {
    "none": {},
    "host_stall": {"late_rank": (3, 2500.0)},
    "worker_fault": {"slow_rank": (5, 1.5)},
    "slow_group": {"slow_group": ((0, 2, 6), 2.0)},
}


def _named(result) -> set[tuple[str, int]]:
    out = set()
    for f in result.diagnosis:
        workers = f.where.workers or []
        out |= {(f.cause, int(w.rank)) for w in workers} or {(f.cause, -1)}
    return out


@pytest.mark.parametrize("kind", sorted(CASES))
def test_the_injected_cause_is_named_at_its_ranks(tmp_path, kind):
    job = GpuJob(ranks=8, steps=5, seed=11, **CASES[kind])
    truth = write_gpu_job(job, tmp_path)
    result = analyze(load_trace(tmp_path))
    want = {(c["cause"], r) for c in truth["causes"] for r in (c["ranks"] or [-1])}
    assert _named(result) == want
    assert result.sim_error < 0.01


def test_the_files_are_what_kineto_writes(tmp_path):
    write_gpu_job(GpuJob(ranks=4, steps=2, seed=1, all_to_alls=1), tmp_path)
    doc = json.loads(gzip.decompress((tmp_path / "rank-2.json.gz").read_bytes()))
    assert doc["distributedInfo"]["rank"] == 2 and doc["distributedInfo"]["world_size"] == 4
    events = doc["traceEvents"]
    launches = {e["args"]["correlation"] for e in events if e["cat"] == "cuda_runtime"}
    kernels = [e for e in events if e["cat"] == "kernel"]
    # every kernel but those still running from before the window has its launch
    unlaunched = [k for k in kernels if k["args"]["correlation"] not in launches]
    assert len(unlaunched) == 3 and all(k["args"]["correlation"] < min(launches)
                                        for k in unlaunched)
    nccl = [k for k in kernels if k["name"].startswith("ncclDevKernel_")]
    assert {k["args"]["Collective name"] for k in nccl} == {"all_to_all", "all_reduce"}
    assert all(isinstance(k["args"]["Seq"], int) for k in nccl)
    trace = load_trace(tmp_path)
    # the hosts' clocks differ; the reader aligns them on the collectives' ends
    assert any(abs(v) > 0 for v in trace.meta.extra["clock_offsets_s"].values())


def test_cli_writes_a_job_and_refuses_a_bad_rank(tmp_path):
    runner = CliRunner()
    out = runner.invoke(app, ["synth-gpu", str(tmp_path / "job"), "--ranks", "4",
                              "--late-rank", "1,3000", "--steps", "3"])
    assert out.exit_code == 0, out.output
    assert "host_stall [1]" in out.output
    assert len(list((tmp_path / "job").glob("rank-*.json.gz"))) == 4
    bad = runner.invoke(app, ["synth-gpu", str(tmp_path / "bad"), "--ranks", "4",
                              "--slow-rank", "7,2"])
    assert bad.exit_code != 0 and "rank 7 is not one of the 4 ranks" in str(bad.exception)


def test_all_to_alls_in_expert_groups_synchronise_their_group_only(tmp_path):
    from stragglers.whatif import analyze_with_model

    job = GpuJob(ranks=8, steps=5, seed=2, all_to_alls=3, expert_groups=2,
                 late_rank=(2, 2500.0))
    write_gpu_job(job, tmp_path)
    trace = load_trace(tmp_path)
    assert set(trace.ops["pg"]) >= {0, 1, 2}            # the default group and two EP groups
    result, w = analyze_with_model(trace)
    a2a = [p for members, p in zip(w.model.groups, w.model.group_parts)
           if trace.optype_names()[w.grid.row[members[0], 0, 0]] == "all-to-all"]
    # ranks 0-3 and 4-7 wait for their own group's late member only
    assert a2a and all(len(set(p[:4])) == 1 and len(set(p[4:])) == 1 and p[0] != p[4]
                       for p in a2a)
    assert result.sim_error < 1e-6
    assert _named(result) == {("host_stall", 2)}
    # without the groups every all-to-all would wait for rank 2: the replay runs late
    trace.ops.pop("pg")
    assert analyze(trace).sim_error > 1e-3


def _strip_group_descriptions(folder) -> None:
    """Rewrite the files as a profiler without pg_config descriptions would have them."""
    for path in folder.glob("rank-*.json.gz"):
        doc = json.loads(gzip.decompress(path.read_bytes()))
        doc["distributedInfo"].pop("pg_config")
        for e in doc["traceEvents"]:
            e.get("args", {}).pop("Process Group Description", None)
        path.write_bytes(gzip.compress(json.dumps(doc).encode()))


@pytest.mark.parametrize("described", [True, False])
def test_tensor_parallel_all_reduces_block_and_the_slow_tp_rank_is_named(tmp_path, described):
    """A TP pair's all-reduces are blocking `all-reduce` ops (found from the group's description,
    or from --tp-size and the groups' ranks); the slow rank is named, not its waiting peer."""
    truth = write_gpu_job(GpuJob(ranks=8, steps=5, seed=4, tp_size=2, slow_rank=(3, 1.5)),
                          tmp_path)
    if not described:
        _strip_group_descriptions(tmp_path)
    trace = load_trace(tmp_path, **({} if described else {"tp_size": 2}))
    from stragglers.trace.model import OPTYPES
    kinds = [OPTYPES[o] for o in trace.ops["optype"]]
    # one TP all-reduce per forward piece (3: two all-to-alls cut it) on every rank and step;
    # DDP's buckets stay gradient all-reduces
    assert kinds.count("all-reduce") == 8 * 5 * 3
    assert kinds.count("grads-all-reduce") == 8 * 5 * 4
    result = analyze(trace)
    assert _named(result) == {(c["cause"], r) for c in truth["causes"] for r in c["ranks"]}
    assert result.sim_error < 0.01


def test_a_clean_tensor_parallel_job_says_none(tmp_path):
    write_gpu_job(GpuJob(ranks=8, steps=5, seed=9, tp_size=4, all_to_alls=1), tmp_path)
    assert _named(analyze(load_trace(tmp_path))) == {("none", -1)}


def test_a_tp_size_that_does_not_divide_the_ranks_is_refused():
    with pytest.raises(ValueError, match="does not divide"):
        GpuJob(ranks=6, tp_size=4)


def test_layout_sizes_come_from_the_process_groups(tmp_path):
    """tp and ep from pg_config's descriptions; ep from the all-to-alls' groups without them."""
    write_gpu_job(GpuJob(ranks=8, steps=3, seed=2, tp_size=2, all_to_alls=1, expert_groups=2),
                  tmp_path / "described")
    trace = load_trace(tmp_path / "described")
    assert trace.meta.extra["group_sizes"] == {"tp": 2, "ep": 4} and trace.meta.ep_size == 4
    assert any("tp = 2" in n.message for n in trace.notes)
    write_gpu_job(GpuJob(ranks=8, steps=3, seed=2, all_to_alls=1, expert_groups=4),
                  tmp_path / "bare")
    _strip_group_descriptions(tmp_path / "bare")
    trace = load_trace(tmp_path / "bare")
    assert trace.meta.extra["group_sizes"] == {"ep": 2} and trace.meta.ep_size == 2


def test_context_parallel_all_gathers_block_within_their_group(tmp_path):
    """tp 2 × cp 2 × dp 2: the CP groups' all-gathers are blocking `all-gather` ops; a slow
    rank is named alone; the layout note shows both dimensions."""
    truth = write_gpu_job(GpuJob(ranks=8, steps=5, seed=6, tp_size=2, cp_size=2, all_to_alls=0,
                                 slow_rank=(6, 1.5)), tmp_path)
    trace = load_trace(tmp_path)
    from stragglers.trace.model import OPTYPES
    kinds = [OPTYPES[o] for o in trace.ops["optype"]]
    assert kinds.count("all-gather") == 8 * 5 and kinds.count("all-reduce") == 8 * 5
    assert trace.meta.extra["group_sizes"] == {"tp": 2, "cp": 2}
    result = analyze(trace)
    assert _named(result) == {(c["cause"], r) for c in truth["causes"] for r in c["ranks"]}


def test_a_coalesced_collective_takes_its_kind_from_the_kernel(tmp_path):
    """NCCL names collectives issued under one coalescing call "coalesced": the kernel's own
    name (ncclDevKernel_AllReduce…) says what it is, and nothing is left out."""
    write_gpu_job(GpuJob(ranks=4, steps=3, seed=2, all_to_alls=0), tmp_path)
    for path in tmp_path.glob("rank-*.json.gz"):
        doc = json.loads(gzip.decompress(path.read_bytes()))
        for e in doc["traceEvents"]:
            if e.get("args", {}).get("Collective name") == "all_reduce":
                e["args"]["Collective name"] = "coalesced"
        path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    trace = load_trace(tmp_path)
    from stragglers.trace.model import OPTYPES
    kinds = [OPTYPES[o] for o in trace.ops["optype"]]
    assert kinds.count("grads-all-reduce") == 4 * 3 * 4
    assert not any("coalesced" in n.message for n in trace.notes)


def test_a_slow_link_in_one_expert_group_is_communication_at_its_ranks(tmp_path):
    truth = write_gpu_job(GpuJob(ranks=6, steps=5, seed=3, all_to_alls=2, expert_groups=3,
                                 slow_link=(4, 8.0)), tmp_path)
    assert truth["causes"] == [{"cause": "communication", "ranks": [4, 5]}]
    assert _named(analyze(load_trace(tmp_path))) == {("communication", 4), ("communication", 5)}


def test_cli_writes_model_parallel_jobs_and_refuses_bad_layouts(tmp_path):
    runner = CliRunner()
    out = runner.invoke(app, ["synth-gpu", str(tmp_path / "moe"), "--ranks", "8", "--steps", "3",
                              "--tp-size", "2", "--expert-groups", "2", "--hot-expert", "5,3"])
    assert out.exit_code == 0, out.output
    assert "expert_imbalance [5]" in out.output
    for args, words in ((["--tp-size", "3"], "does not divide the 8 ranks"),
                        (["--all-to-alls", "0", "--slow-link", "1,5"], "needs all-to-alls"),
                        (["--hot-expert", "9,2"], "rank 9 is not one of the 8 ranks")):
        bad = runner.invoke(app, ["synth-gpu", str(tmp_path / "bad"), "--ranks", "8", *args])
        assert bad.exit_code != 0 and words in str(bad.exception), (args, bad.output)


def _p2p(path) -> list[tuple[str, int]]:
    """(kind, peer) of a rank's send/recv records, in the order it posted them."""
    doc = json.loads(gzip.decompress(path.read_bytes()))
    return [(e["args"]["Collective name"], e["args"].get("Dst Rank", e["args"].get("Src Rank")))
            for e in doc["traceEvents"] if e["name"] == "record_param_comms"
            and e["args"]["Collective name"] in ("send", "recv")]


def test_ring_attention_passes_kv_around_each_cp_group(tmp_path):
    """tp 2 × cp 4: each CP rank (ranks tp apart) sends to the next and receives from the one
    before, cp - 1 rounds in the forward piece and at the backward's start; an even CP rank
    posts its send first, an odd one its receive (as Transformer Engine does)."""
    write_gpu_job(GpuJob(ranks=8, steps=2, seed=3, tp_size=2, cp_size=4, cp_comm="ring",
                         all_to_alls=0), tmp_path)
    rounds = 3 * 2 * 2    # cp - 1 rounds, forward and backward, two steps
    assert _p2p(tmp_path / "rank-0.json.gz") == [("send", 2), ("recv", 6)] * rounds
    assert _p2p(tmp_path / "rank-2.json.gz") == [("recv", 0), ("send", 4)] * rounds
    assert _p2p(tmp_path / "rank-7.json.gz") == [("recv", 5), ("send", 1)] * rounds


def test_an_all_to_all_rotation_of_context_parallel_is_no_expert_imbalance(tmp_path):
    """torch's all-to-all rotation of K/V in the CP groups (equal splits): a slow rank is a
    worker fault named alone, not an expert imbalance or its waiting CP peers."""
    truth = write_gpu_job(GpuJob(ranks=8, steps=5, seed=5, cp_size=4, cp_comm="all_to_all",
                                 all_to_alls=0, slow_rank=(6, 1.5)), tmp_path)
    trace = load_trace(tmp_path)
    assert trace.meta.extra["group_sizes"]["cp"] == 4
    assert _named(analyze(trace)) == {(c["cause"], r) for c in truth["causes"]
                                      for r in c["ranks"]}


def test_an_unknown_cp_exchange_is_refused():
    with pytest.raises(ValueError, match="cp_comm 'p2p'"):
        GpuJob(ranks=8, cp_size=2, cp_comm="p2p")


@pytest.mark.parametrize("ranks, cp, slow", [(8, 4, 5), (4, 2, 1)])
def test_a_slow_rank_in_a_ring_attention_job_is_named_alone(tmp_path, ranks, cp, slow):
    truth = write_gpu_job(GpuJob(ranks=ranks, steps=6, seed=6, cp_size=cp, cp_comm="ring",
                                 slow_rank=(slow, 1.6)), tmp_path)
    assert _named(analyze(load_trace(tmp_path))) == {(c["cause"], r) for c in truth["causes"]
                                                     for r in c["ranks"]}


def test_a_pipeline_job_passes_each_microbatch_between_neighbouring_stages(tmp_path):
    """pp 2 × tp 2 (Megatron order, pp slowest): in each step every microbatch's activations go
    forward and its gradients back between a rank and its place in the other stage; the
    groups are in pg_config, and the reader places the ranks in two stages."""
    write_gpu_job(GpuJob(ranks=8, steps=1, seed=1, pp_size=2, tp_size=2, microbatches=3,
                         all_to_alls=0), tmp_path)
    assert _p2p(tmp_path / "rank-1.json.gz") == [("send", 5)] * 3 + [("recv", 5)] * 3
    assert _p2p(tmp_path / "rank-5.json.gz") == [("recv", 1)] * 3 + [("send", 1)] * 3
    doc = json.loads(gzip.decompress((tmp_path / "rank-0.json.gz").read_bytes()))
    groups = {g["pg_desc"]: [] for g in doc["distributedInfo"]["pg_config"]}
    for g in doc["distributedInfo"]["pg_config"]:
        groups[g["pg_desc"]].append(g["ranks"])
    assert groups["pipeline_model_parallel"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["data_parallel"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    trace = load_trace(tmp_path)
    assert trace.meta.pp_size == 2
    assert {int(r): int(s) for r, s in zip(trace.ops["rank"], trace.ops["stage"])} == \
        {r: r // 4 for r in range(8)}


def test_a_pipeline_that_does_not_divide_the_ranks_is_refused():
    with pytest.raises(ValueError, match="pp_size 3 does not divide the 8 ranks"):
        GpuJob(ranks=8, pp_size=3)


def test_every_microbatch_backward_of_a_ring_pipeline_passes_dkdv_on(tmp_path):
    """pp 2 × cp 2, three microbatches: each microbatch's forward and its backward run the
    ring's cp - 1 rounds (the backward's inside its attention function's autograd op), not
    the last microbatch's backward only."""
    write_gpu_job(GpuJob(ranks=8, steps=1, seed=1, pp_size=2, cp_size=2, cp_comm="ring",
                         microbatches=3, all_to_alls=0), tmp_path)
    ring = [(k, p) for k, p in _p2p(tmp_path / "rank-0.json.gz") if p == 1]   # its CP peer
    assert len(ring) == 2 * (3 + 3)          # a send and a receive per round
    doc = json.loads(gzip.decompress((tmp_path / "rank-0.json.gz").read_bytes()))
    ops = [e for e in doc["traceEvents"] if e["name"].startswith("autograd::engine")]
    launches = {e["args"]["correlation"]: e["ts"] for e in doc["traceEvents"]
                if e["name"] == "cudaLaunchKernel"}
    flash = [launches[e["args"]["correlation"]] for e in doc["traceEvents"]
             if e["name"] == "flash_bwd_kernel"]
    assert len(flash) == 3
    assert all(any(o["ts"] <= t <= o["ts"] + o["dur"] for o in ops) for t in flash)


@pytest.mark.slow
@pytest.mark.parametrize("ranks, cp, tp, mb, slow", [(8, 2, 1, 3, (4, 1.8)), (8, 2, 1, 4, (7, 1.8)),
                                                      (16, 4, 2, 2, (9, 1.6)), (8, 2, 1, 3, None)])
def test_a_slow_rank_of_a_ring_attention_pipeline_is_named_alone(tmp_path, ranks, cp, tp, mb,
                                                                  slow):
    """Ring attention in each stage of a pipeline: a slow rank is named alone, never its CP
    peers or the ranks it passes microbatches to (their waits at the ring's backward rounds
    once were read as host stalls); a clean job says none."""
    truth = write_gpu_job(GpuJob(ranks=ranks, steps=5, seed=mb - 2, cp_size=cp, tp_size=tp,
                                 cp_comm="ring", pp_size=2, microbatches=mb,
                                 ranks_per_host=ranks, all_to_alls=mb % 2, slow_rank=slow),
                          tmp_path)
    want = {(c["cause"], r) for c in truth["causes"] for r in c["ranks"]} or {("none", -1)}
    assert _named(analyze(load_trace(tmp_path))) == want


def test_a_job_without_all_to_alls_describes_no_expert_groups(tmp_path):
    # a pipeline's per-stage "expert groups" held its data-parallel groups' ranks: read as one
    # group under two names, the gradient all-reduces became model-parallel all-reduces and a
    # slow group's healthy peers were named host_stall
    job = GpuJob(ranks=8, pp_size=2, microbatches=3, steps=6, seed=7, ranks_per_host=8,
                 host_jitter_us=200.0, all_to_alls=0, slow_group=((2, 4, 6, 7), 2.0))
    write_gpu_job(job, tmp_path)
    trace = load_trace(tmp_path)
    assert "ep" not in trace.meta.extra.get("group_sizes", {})
    assert _named(analyze(trace)) == {("slow_group", r) for r in (2, 4, 6, 7)}
