"""attach() on tensor-, expert- and pipeline-parallel (3-D) jobs: real torchrun/gloo runs of the
examples, the rows the dependency model keys on (and the run delay of compute between two
all-to-alls), parameters untouched, the slow rank of a 3-D job named, bad layouts refused in one
line."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, free_port, kill_tree, torchrun

from stragglers.errors import InputError
from stragglers.record.modelparallel import FALLBACK_BASE, GroupIds
from stragglers.record.writer import cut_compute_at_collectives
from stragglers.trace.model import OPTYPE_CODES
from stragglers.trace.runformat import read_run

TP_EXAMPLE = REPO / "examples" / "train_tp.py"
MOE_EXAMPLE = REPO / "examples" / "train_moe.py"
FWD, BWD, AR, AG, A2A = (OPTYPE_CODES[n] for n in ("forward-compute", "backward-compute",
                                                   "all-reduce", "all-gather", "all-to-all"))
BLOCKING = (AR, AG, OPTYPE_CODES["reduce-scatter"], A2A)
GC_CODE = OPTYPE_CODES["gc"]
COMPUTE = (FWD, BWD)
TOKENS_PER_RANK = 4 * 16  # --batch 4 --seq 16 below


def rows_of(ops, rank: int, step: int, code: int) -> dict[str, np.ndarray]:
    m = (ops["rank"] == rank) & (ops["step"] == step) & (ops["optype"] == code)
    order = np.argsort(ops["seq_id"][m])
    return {k: v[m][order] for k, v in ops.items()}


def assert_compute_is_cut(ops) -> None:
    """On every rank no compute row overlaps a blocking collective row (program order)."""
    for r in np.unique(ops["rank"]):
        for s in np.unique(ops["step"]):
            m = (ops["rank"] == r) & (ops["step"] == s)
            start, end = ops["start_ts"][m], ops["start_ts"][m] + ops["duration"][m]
            comp = np.isin(ops["optype"][m], (FWD, BWD))
            coll = np.isin(ops["optype"][m], BLOCKING)
            for cs, ce in zip(start[coll], end[coll]):
                inside = comp & (start < ce - 1e-9) & (end > cs + 1e-9)
                assert not inside.any(), (r, s, cs, ce)


TP_ARGS = ("--tp", "2", "--seq", "16")
MOE_ARGS = ("--layers", "1", "--batch", "4", "--seq", "16", "--hot-expert", "1",
            "--routing-skew", "0.5")


def run_with_params(example, nproc: int, args, where, record: bool = True) -> None:
    """A 3-step run of `example` into where/run, its final parameters into where/params*."""
    torchrun(example, nproc, *args, "--steps", "3", "--out", str(where / "run"),
             "--params-out", str(where / ("params" if example == MOE_EXAMPLE else "params.pt")),
             *(() if record else ("--no-record",)), timeout=400)


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """One recorded dp 2 x tp 2 run: its trace for the TP keys, its parameters for the run
    without attach (the parameters are saved after attach has closed: the trace is the same
    as without --params-out)."""
    where = tmp_path_factory.mktemp("tp") / "with"
    run_with_params(TP_EXAMPLE, 4, TP_ARGS, where)
    return where


@pytest.mark.distributed
def test_tensor_parallel_collectives_share_their_keys_across_each_tp_group(tp_run):
    trace = read_run(tp_run / "run")
    ops, meta = trace.ops, trace.meta
    # every rank is a worker (column) of its own; the degrees are in extra
    assert (meta.dp_size, meta.world_size) == (4, 4)
    assert meta.extra["parallel"] == {"dp": 2, "tp": 2, "cp": 1, "ep": 1, "pp": 1}
    assert meta.extra["group_sizes"] == {"tp": 2}  # as the Kineto reader names them
    assert meta.extra["compute_split_at_collectives"] is True
    assert sorted(set(ops["dp_rank"].tolist())) == [0, 1, 2, 3]
    groups = [tuple(g) for g in meta.extra["process_groups"]]
    steps = sorted(set(ops["step"].tolist()))
    assert len(steps) == 3
    for code in (AR, AG):
        for step in steps:
            by_rank = {r: rows_of(ops, r, step, code) for r in range(4)}
            assert len(by_rank[0]["seq_id"]) >= 1
            for a, b in ((0, 1), (2, 3)):  # the TP pairs of a (dp, tp) = (2, 2) mesh
                # the same collective on both ranks: the same (step, optype, seq_id) key
                assert by_rank[a]["seq_id"].tolist() == by_rank[b]["seq_id"].tolist()
                assert by_rank[a]["bytes"].tolist() == by_rank[b]["bytes"].tolist()
                pg = set(by_rank[a]["pg"].tolist()) | set(by_rank[b]["pg"].tolist())
                assert len(pg) == 1 and groups[pg.pop()] == (a, b)
            assert set(by_rank[0]["pg"].tolist()) != set(by_rank[2]["pg"].tolist())
    # forward holds all-reduces (row-wise outputs) and backward too (column-wise inputs)
    ar = ops["optype"] == AR
    mbs = ops["mb_id"][ar]
    assert (mbs == 0).all()
    # FSDP2's collectives run over the dp groups {0, 2} and {1, 3}
    ag = ops["optype"] == OPTYPE_CODES["params-all-gather"]
    assert {groups[p] for p in set(ops["pg"][ag].tolist())} == {(0, 2), (1, 3)}
    assert_compute_is_cut(ops)


SKEW, HOT = 0.5, 2


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory) -> Path:
    """One recorded 4-rank MoE run (EP over every rank, expert 2 hot), 3 steps: read by the
    all-to-all rows test and the compute-between-all-to-alls test."""
    out = tmp_path_factory.mktemp("moe") / "run"
    torchrun(MOE_EXAMPLE, 4, "--steps", "3", "--batch", "4", "--seq", "16", "--hot-expert",
             str(HOT), "--routing-skew", str(SKEW), "--out", str(out), timeout=400)
    return out


@pytest.mark.distributed
def test_all_to_all_rows_carry_the_rows_each_expert_rank_received_and_sent(moe_run):
    skew, hot = SKEW, HOT
    trace = read_run(moe_run)
    ops, meta = trace.ops, trace.meta
    assert meta.ep_size == 4 and meta.extra["parallel"]["ep"] == 4
    assert meta.extra["group_sizes"] == {"ep": 4}
    world_pg = [tuple(g) for g in meta.extra["process_groups"]].index((0, 1, 2, 3))
    forced = int(np.sum((np.arange(TOKENS_PER_RANK) * 7919) % 1000 < skew * 1000))
    for step in sorted(set(ops["step"].tolist())):
        a2a = {r: rows_of(ops, r, step, A2A) for r in range(4)}
        for r in range(4):
            assert (a2a[r]["pg"] == world_pg).all()
            # per layer in forward: counts, dispatch, combine; in backward combine, dispatch
            assert len(a2a[r]["tokens"]) == 2 * 3 + 2 * 2
        for layer in range(2):
            counts, dispatch, combine = (np.array([a2a[r]["tokens"][3 * layer + i]
                                                   for r in range(4)]) for i in range(3))
            assert (counts == 4).all()              # one count per source rank
            assert (combine == TOKENS_PER_RANK).all()  # each rank gets its own tokens back
            assert dispatch.sum() == 4 * TOKENS_PER_RANK
            # the hot expert's rank receives every rank's forced share and more than any other
            assert dispatch[hot] >= 4 * forced
            assert dispatch[hot] > max(np.delete(dispatch, hot))
            # rows sent: each rank dispatches its own tokens, and combines what it received
            sent_counts, sent_dispatch, sent_combine = (np.array(
                [a2a[r]["sent"][3 * layer + i] for r in range(4)]) for i in range(3))
            assert (sent_counts == 4).all() and (sent_dispatch == TOKENS_PER_RANK).all()
            assert (sent_combine == dispatch).all()
        # backward sends the gradients back the way the rows came: per layer (last first)
        # the combine's gradient (received: the dispatch's rows), then the dispatch's
        back = {r: (a2a[r]["tokens"][6:], a2a[r]["sent"][6:]) for r in range(4)}
        for r in range(4):
            received, sent = back[r]
            assert (sent[1::2] == received[0::2]).all() and (sent[0::2] == TOKENS_PER_RANK).all()
        assert (a2a[0]["bytes"] > 0).all()
    assert_compute_is_cut(ops)
    # each rank's CPUs are in the layout; four ranks on fewer CPUs are said to share them
    import socket
    mine = len(os.sched_getaffinity(0))
    crowded = [n.message for n in trace.notes if "ranks share" in n.message]
    assert crowded == ([f"host {socket.gethostname()}: 4 ranks share {mine} CPU"
                        f"{'s' if mine > 1 else ''}: they compute in turns, so evening out "
                        "their work (balanced routing or sequences) gains less than predicted, "
                        "which gives each rank a core or device of its own"]
                       if mine < 4 else [])


@pytest.mark.distributed
def test_compute_between_two_all_to_alls_carries_its_run_delay(moe_run):
    # attach() on CPU: a compute piece between two model-parallel collectives (an expert's
    # compute between its dispatch and its combine) carries its run delay in `cpu_wait`, from
    # the schedstat counters the two collectives read anyway, and its time on a CPU in
    # `cpu_time` (read at the second collective's end); every other row keeps NaN in both.
    # Every row carries its step's process CPU (`step_cpu`).
    ops = read_run(moe_run).ops
    assert "cpu_time" in ops
    between = 0
    for r in np.unique(ops["rank"]):
        for s in np.unique(ops["step"]):
            idx = np.flatnonzero((ops["rank"] == r) & (ops["step"] == s)
                                 & (ops["optype"] != GC_CODE))
            idx = idx[np.argsort(ops["start_ts"][idx], kind="stable")]
            code = ops["optype"][idx]
            for j, i in enumerate(idx):
                if code[j] not in COMPUTE:
                    continue
                wait, on_cpu = ops["cpu_wait"][i], ops["cpu_time"][i]
                inside = 0 < j < len(idx) - 1 and code[j - 1] == A2A and code[j + 1] == A2A
                if not inside:
                    assert np.isnan(wait) and np.isnan(on_cpu), (r, s, j)
                    continue
                between += 1
                # read after the first all-to-all ended and before the next one began
                prev, nxt = idx[j - 1], idx[j + 1]
                window = ops["start_ts"][nxt] - (ops["start_ts"][prev] + ops["duration"][prev])
                assert 0 <= wait <= window + 1e-6, (r, s, j, wait, window)
                # on a CPU between the first all-to-all's end and the second's (the kernel's
                # count of a running thread may lag by a tick: 10 ms covers HZ ≥ 100)
                through = window + ops["duration"][nxt]
                assert 0 <= on_cpu <= through + 0.01, (r, s, j, on_cpu, through)
    # per rank and step: two layers' expert forward, and backward's pieces between them
    assert between >= 4 * 3 * 2
    # the collectives keep theirs
    assert np.isfinite(ops["cpu_wait"][ops["optype"] == A2A]).all()
    assert np.isnan(ops["cpu_time"][ops["optype"] == A2A]).all()
    # every row carries its step's process CPU: one value per rank and step, at least the
    # training thread's CPU in the pieces above (a tick of slack per piece: the count lags)
    assert np.isfinite(ops["step_cpu"]).all()
    for r in np.unique(ops["rank"]):
        for s in np.unique(ops["step"]):
            sel = (ops["rank"] == r) & (ops["step"] == s)
            assert len(np.unique(ops["step_cpu"][sel])) == 1, (r, s)
            pieces = ops["cpu_time"][sel]
            pieces = pieces[np.isfinite(pieces)]
            assert ops["step_cpu"][sel][0] >= pieces.sum() - 0.01 * len(pieces), (r, s)


@pytest.mark.distributed
def test_balanced_routing_gives_every_expert_rank_the_same_tokens(tmp_path):
    torchrun(MOE_EXAMPLE, 2, "--steps", "2", "--layers", "1", "--batch", "4", "--seq", "16",
             "--balanced", "--out", str(tmp_path / "run"), timeout=400)
    ops = read_run(tmp_path / "run").ops
    dispatch = ops["tokens"][(ops["optype"] == A2A) & (ops["seq_id"] == 1)]
    assert len(dispatch) == 2 * 2 and (dispatch == TOKENS_PER_RANK).all()


@pytest.mark.distributed
@pytest.mark.parametrize("example,nproc,args", [
    (TP_EXAMPLE, 4, TP_ARGS), (MOE_EXAMPLE, 2, MOE_ARGS)], ids=["tp", "moe"])
def test_attach_changes_no_parameter(tmp_path, request, example, nproc, args):
    saved = {}
    for record in (True, False):
        if record and example == TP_EXAMPLE:   # the TP keys' run
            where = request.getfixturevalue("tp_run")
        else:
            where = tmp_path / ("with" if record else "without")
            run_with_params(example, nproc, args, where, record)
        files = sorted(where.glob("params/rank-*.pt")) or [where / "params.pt"]
        saved[record] = [torch.load(f) for f in files]
    assert len(saved[True]) == len(saved[False]) >= 1
    for a, b in zip(saved[True], saved[False]):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name


# ---- layouts attach cannot model: one line each ----------------------------------------------

class FakeMesh:
    """What read_layout reads of a DeviceMesh (torch refuses to build these over a world)."""

    def __init__(self, names, shape, local):
        self.mesh_dim_names, self.shape, self.ndim, self._local = names, shape, len(shape), local

    def size(self, i):
        return self.shape[i]

    def get_local_rank(self, i):
        return self._local[i]


@pytest.mark.parametrize("names,shape,world,expected", [
    (("dp", "expert_shard"), (2, 2), 4, "dimension 'expert_shard' the recorder does not model"),
    (("dp", "tp"), (1, 3), 4, "tensor-parallel degree 3 (DeviceMesh {'dp': 1, 'tp': 3}) does "
                              "not divide the world size 4"),
    (("dp", "tp"), (1, 2), 4, "the DeviceMesh {'dp': 1, 'tp': 2} spans 2 of the 4 ranks"),
    (("pp", "dp", "tp"), (2, 1, 2), 4, "pipeline dimension 'pp' of size 2: a module is one "
                                       "stage; pass the pipelining schedule instead"),
    (("dp", "cp"), (2, 2), 4, "context-parallel dimension of size 2: not recorded, because "
                              "torch"),
])
def test_a_layout_attach_cannot_model_is_one_line(names, shape, world, expected):
    from stragglers.record.layout import _fill, _mesh_layout

    with pytest.raises(InputError) as err:
        _fill(_mesh_layout("fsdp2", torch.nn.Linear(2, 2), FakeMesh(names, shape, (0,) * len(shape)),
                           world, 0))
    message = str(err.value)
    assert expected in message and "\n" not in message


def test_a_tp_layout_places_each_rank_as_its_own_worker():
    from stragglers.record.layout import _fill, _mesh_layout

    layout = _fill(_mesh_layout("fsdp2", torch.nn.Linear(2, 2),
                                FakeMesh(("dp", "tp"), (2, 2), (1, 1)), 4, 3))
    assert (layout.dp_size, layout.tp_size, layout.workers, layout.worker) == (2, 2, 4, 3)


def test_a_3d_layout_places_each_rank_of_a_stage_as_its_own_worker():
    from stragglers.record.layout import _fill, _mesh_layout

    # rank 7 of dp 2 × tp 2 × pp 2 (torchtitan's order: pp outermost): stage 1, replica 1, tp 1
    layout = _fill(_mesh_layout("fsdp2", torch.nn.Linear(2, 2),
                                FakeMesh(("pp", "dp", "tp"), (2, 2, 2), (1, 1, 1)), 8, 7,
                                pipelined=True))
    assert (layout.pp_size, layout.pp_rank, layout.dp_size, layout.tp_size) == (2, 1, 2, 2)
    assert (layout.workers, layout.worker) == (4, 3)
    with pytest.raises(InputError, match="spans 4 of the 8 ranks"):
        _fill(_mesh_layout("fsdp2", torch.nn.Linear(2, 2),
                           FakeMesh(("pp", "dp", "tp"), (2, 1, 2), (0, 0, 0)), 8, 0,
                           pipelined=True))


# ---- the pieces the rows are made of ----------------------------------------------------------

def test_group_ids_are_the_same_on_every_rank_and_distinct_per_group():
    gathered = [(0, 1), (2, 3), (0, 2), (1, 3), (0, 1, 2, 3)]
    ids_a, ids_b = GroupIds(gathered), GroupIds(list(reversed(gathered)))
    assert [ids_a.of_ranks(g) for g in gathered] == [ids_b.of_ranks(g) for g in gathered]
    assert len({ids_a.of_ranks(g) for g in gathered}) == len(gathered)
    assert ids_a.of_ranks((3, 1)) == ids_a.of_ranks((1, 3))
    late = ids_a.of_ranks((0, 3))  # a group made after attach: its ranks' hash, the same anywhere
    assert late >= FALLBACK_BASE and late == GroupIds([]).of_ranks((0, 3))


def test_natively_timed_compute_is_cut_at_the_collectives_inside_it():
    nan = math.nan
    fwd = (FWD, 0, 100, 0, 0, 0, nan, -1, -1, (5,))
    a2a_1 = (A2A, 20, 30, -1, 0, 0, nan, 8, 64, ())
    a2a_2 = (A2A, 50, 70, -1, 0, 0, nan, 8, 64, ())
    bwd = (BWD, 110, 150, 1, 0, 0, nan, -1, -1, ())
    a2a_3 = (A2A, 105, 108, -1, 0, 0, nan, 8, 64, ())  # between forward and backward
    rows = cut_compute_at_collectives([fwd, a2a_1, a2a_2, a2a_3, bwd])
    spans = sorted((r[0], r[1], r[2]) for r in rows)
    assert spans == sorted([(FWD, 0, 20), (FWD, 30, 50), (FWD, 70, 100), (A2A, 20, 30),
                            (A2A, 50, 70), (A2A, 105, 108), (BWD, 110, 150)])
    assert sorted(r[3] for r in rows if r[0] == A2A) == [-1, 0, 0]  # the piece's microbatch
    pauses = [r[9] for r in rows if r[0] == FWD]
    assert sorted(pauses, key=len) == [(), (), (5,)]  # the span's GC pause stays once


@pytest.mark.distributed
def test_natively_timed_compute_of_a_real_moe_job_is_cut_at_its_all_to_alls(tmp_path):
    from stragglers.record import native

    if native.load() is None:
        pytest.skip(f"native hooks not built ({native.last_error()})")
    torchrun(REPO / "tests" / "record" / "workers" / "moe_plain_worker.py", 2,
             str(tmp_path / "run"), timeout=300)
    trace = read_run(tmp_path / "run")
    ops = trace.ops
    assert trace.meta.extra["native"] is True
    a2a = ops["optype"] == A2A
    # per step: counts, dispatch, combine in forward; combine, dispatch in backward
    assert np.bincount(ops["step"][a2a] * 2 + ops["rank"][a2a]).max() == 5
    assert (ops["mb_id"][a2a] == 0).all()  # the microbatch of the compute they cut
    fwd = ops["optype"] == FWD
    assert set(np.bincount(ops["step"][fwd] * 2 + ops["rank"][fwd]).tolist()) - {0} == {4}
    assert_compute_is_cut(ops)


# ---- FSDP2 + TP + pipelining (3-D) ----------------------------------------------------------

@pytest.mark.distributed
def test_a_3d_job_is_recorded_unchanged_and_its_slow_tp_rank_named(tmp_path):
    # torchtitan's 3-D shape at its smallest: pp 2 × tp 2 on 4 ranks (mesh (pp, dp, tp) =
    # (2, 1, 2), FSDP2 over the dp dimension); rank 3 (stage 1, tp rank 1) computes longer
    from stragglers.whatif import analyze

    args = ("--tp", "2", "--pp", "2", "--microbatches", "2", "--seq", "16", "--steps", "6",
            "--slow-rank", "3", "--slow-ms", "50")
    params = {}
    for record in (True, False):
        where = tmp_path / ("with" if record else "without")
        torchrun(TP_EXAMPLE, 4, *args, "--out", str(where / "run"), "--params-out",
                 str(where / "params.pt"), *(() if record else ("--no-record",)), timeout=400)
        params[record] = [torch.load(where / f"params.pt.stage{s}") for s in (0, 1)]
    for a, b in zip(params[True], params[False]):  # parameters identical with and without
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    trace = read_run(tmp_path / "with" / "run")
    ops, meta = trace.ops, trace.meta
    assert (meta.dp_size, meta.pp_size, meta.world_size) == (2, 2, 4)  # 2 workers per stage
    assert meta.extra["parallel"] == {"dp": 1, "tp": 2, "cp": 1, "ep": 1, "pp": 2}
    assert meta.extra["wrapper"] == "pipelining" and meta.extra["stage_wrapper"] == "fsdp2"
    assert [(e["rank"], e["stage"], e["dp_rank"], e["tp_rank"]) for e in meta.extra["layout"]] \
        == [(0, 0, 0, 0), (1, 0, 1, 1), (2, 1, 0, 0), (3, 1, 1, 1)]
    groups = [tuple(g) for g in meta.extra["process_groups"]]
    for step in sorted(set(ops["step"].tolist())):
        for a, b in ((0, 1), (2, 3)):  # each stage's TP pair runs the same all-reduces
            ra, rb = rows_of(ops, a, step, AR), rows_of(ops, b, step, AR)
            assert len(ra["seq_id"]) >= 4 and ra["seq_id"].tolist() == rb["seq_id"].tolist()
            assert {groups[p] for p in set(ra["pg"].tolist())} == {(a, b)}
            # inside the schedule's actions: each carries its microbatch and stage
            assert set(ra["mb_id"].tolist()) == {0, 1}
            assert set(ra["gmc"].tolist()) == {a // 2}
        sends = rows_of(ops, 0, step, OPTYPE_CODES["forward-send"])
        assert len(sends["seq_id"]) == 2 and set(sends["gmc"].tolist()) == {1}  # the peer stage
    assert_compute_is_cut(ops)

    result = analyze(trace)
    fault = next(f for f in result.diagnosis if f.cause == "worker_fault")
    assert 3 in ranks_of(fault)
    # rank 2 (its TP peer) waits at every all-reduce: no slow worker (other ranks are not
    # asserted on: four ranks on a loaded 2-core machine, one can really be slower for a run)
    named = {r for f in result.diagnosis if f.cause in ("worker_fault", "host_stall",
                                                        "slow_group") for r in ranks_of(f)}
    assert 2 not in named


@pytest.mark.distributed
def test_a_pipeline_with_data_parallel_stages_is_analysed_step_by_step(tmp_path):
    # dp 2 × pp 2 on 4 ranks (mesh (pp, dp, tp) = (2, 2, 1), FSDP2 over dp): FSDP2 gathers in a
    # step's first microbatch only, so that forward is cut into more pieces than the second;
    # and the schedule's shape inference in the first step gathers outside any action. Every
    # step keeps the same rows (the first opens at its first action), and the analysis replays
    # (each transfer wired to its own microbatch's compute: no dependency cycle).
    from stragglers.whatif import analyze
    from stragglers.whatif.grid import build_grid

    torchrun(TP_EXAMPLE, 4, "--tp", "1", "--pp", "2", "--microbatches", "2", "--seq", "16",
             "--steps", "5", "--out", str(tmp_path / "run"), timeout=400)
    trace = read_run(tmp_path / "run")
    ops = trace.ops
    assert trace.meta.extra["parallel"] == {"dp": 2, "tp": 1, "cp": 1, "ep": 1, "pp": 2}
    gathers = ops["optype"] == OPTYPE_CODES["params-all-gather"]
    per_step = [int((gathers & (ops["step"] == s) & (ops["rank"] == 0)).sum())
                for s in sorted(set(ops["step"].tolist()))]
    assert per_step[0] == per_step[-1] > 0, per_step  # no extra gathers in the first step
    fwd0 = rows_of(ops, 2, 1, FWD)
    assert len(fwd0["mb_id"]) > 2 and set(fwd0["mb_id"].tolist()) == {0, 1}  # cut unevenly
    grid = build_grid(trace)
    assert not grid.warnings and len(grid.steps) == 5
    result = analyze(trace, steps="all")
    assert result.steps_analysed == [0, 1, 2, 3, 4]
    assert result.sim_error < 0.05


def ranks_of(finding) -> list[int]:
    """The ranks a finding names."""
    return list(finding.where.ranks)


# ---- meshes the examples do not build (real gloo jobs) ----------------------------------------

MESH_WORKER = REPO / "tests" / "record" / "workers" / "mesh_worker.py"


def ranks_without_agent(script, nproc: int, *args: str, out: Path,
                        timeout: float = 300) -> list[tuple[int, str]]:
    """(exit status, stderr) of each rank of a real gloo job started without torchrun's agent
    (env:// rendezvous on loopback), every rank waited for to its end: an agent stops the
    other ranks once it sees one fail, which can be before they print."""
    port = str(free_port())
    procs = []
    for rank in range(nproc):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
               "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
               "LOCAL_WORLD_SIZE": str(nproc)}
        with open(out / f"stderr-{rank}", "w") as err:
            procs.append(subprocess.Popen([sys.executable, str(script), *args], env=env,
                                          cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                                          start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        codes = [p.wait(timeout=max(deadline - time.monotonic(), 0.1)) for p in procs]
    finally:
        for p in procs:
            kill_tree(p)
    return [(code, (out / f"stderr-{rank}").read_text()) for rank, code in enumerate(codes)]


@pytest.mark.distributed
def test_a_mesh_over_part_of_the_world_is_one_line_on_every_rank(tmp_path):
    # ranks 0-2 hold a tp-3 mesh, rank 3 a plain model: rank 3 had nothing to refuse, waited
    # in attach's first collective for its refusing peers and died with gloo's traceback.
    # Started without torchrun's agent, which stops the other ranks once one has failed
    # (possibly before they print): every rank runs to its own end (an agent looking only
    # every 15 s held the test for up to 15 s more)
    ranks = ranks_without_agent(MESH_WORKER, 4, "part_mesh", str(tmp_path / "run"),
                                out=tmp_path)
    stderr = "".join(err for _, err in ranks)
    assert all(code != 0 for code, _ in ranks), ranks
    lines = [line for line in stderr.splitlines() if line.startswith("error: rank ")]
    assert sorted(line.split(":")[1] for line in lines) == [f" rank {r}" for r in range(4)], \
        stderr[-3000:]
    assert all("tensor-parallel degree 3" in line for line in lines), lines
    assert "rank 0 refused the job" in next(line for line in lines if "rank 3:" in line)
    assert "Connection closed" not in stderr
    assert 'mesh_worker.py", line' not in stderr  # no worker's traceback


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory) -> Path:
    """The meshes attach records, one after another in one job: DIR/CASE each."""
    out = tmp_path_factory.mktemp("meshes")
    torchrun(MESH_WORKER, 4, "ep,titan_ep,unflatten", str(out), timeout=400)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("case,parallel,ep_groups,ep_ranks", [
    ("ep", {"dp": 4, "tp": 1, "cp": 1, "ep": 2, "pp": 1}, {(0, 1), (2, 3)}, [0, 1, 0, 1]),
    ("titan_ep", {"dp": 2, "tp": 2, "cp": 1, "ep": 2, "pp": 1}, {(0, 2), (1, 3)}, [0, 0, 1, 1]),
])
def test_expert_parallel_mesh_dims_are_recorded_as_ep(mesh_runs, case, parallel, ep_groups,
                                                      ep_ranks):
    # an "ep" dim (or torchtitan's dp_shard_mod_ep / dp_shard_in_ep) was refused as a dim the
    # recorder does not model
    trace = read_run(mesh_runs / case)
    meta, ops = trace.meta, trace.ops
    assert meta.extra["parallel"] == parallel
    assert (meta.ep_size, meta.dp_size, meta.world_size) == (2, 4, 4)
    groups = [tuple(g) for g in meta.extra["process_groups"]]
    a2a = ops["optype"] == A2A
    assert {groups[p] for p in set(ops["pg"][a2a].tolist())} == ep_groups
    layout = sorted(meta.extra["layout"], key=lambda e: e["rank"])
    assert [e["ep_rank"] for e in layout] == ep_ranks


def test_expert_parallel_dims_are_data_parallel_for_the_workers():
    from stragglers.record.layout import _fill, _mesh_layout

    # rank 6 of torchtitan's (dp_shard_mod_ep 2, dp_shard_in_ep 2, tp 2): replica 3, tp rank 0
    layout = _fill(_mesh_layout("fsdp2", torch.nn.Linear(2, 2),
                                FakeMesh(("dp_shard_mod_ep", "dp_shard_in_ep", "tp"), (2, 2, 2),
                                         (1, 1, 0)), 8, 6))
    assert (layout.dp_size, layout.ep_size, layout.tp_size, layout.worker) == (4, 2, 2, 6)
    assert layout.places() == {"replica": 3, "tp_rank": 0, "cp_rank": 0, "ep_rank": 1}


@pytest.mark.distributed
def test_tensor_parallel_stages_of_multi_stage_schedules_are_recorded_and_analysed(tmp_path):
    # torchtitan's 3-D shape with two stages per rank (interleaved and V-shaped zero bubble)
    from stragglers.whatif import analyze

    names = ("ScheduleInterleaved1F1B", "ScheduleZBVZeroBubble")
    torchrun(REPO / "tests" / "record" / "workers" / "tp_pipe_worker.py", 4, str(tmp_path),
             *names, timeout=500)
    for name in names:
        trace = read_run(tmp_path / name)
        meta, ops = trace.meta, trace.ops
        assert (meta.pp_size, meta.vpp_size, meta.dp_size) == (2, 2, 2)
        assert meta.extra["parallel"] == {"dp": 1, "tp": 2, "cp": 1, "ep": 1, "pp": 2}
        groups = [tuple(g) for g in meta.extra["process_groups"]]
        ar = ops["optype"] == AR
        # the tp pairs of a (pp, dp, tp) = (2, 1, 2) mesh: {0, 1} on stage 0, {2, 3} on stage 1
        assert {groups[p] for p in set(ops["pg"][ar].tolist())} == {(0, 1), (2, 3)}
        for r in range(4):
            mine = ar & (ops["rank"] == r)
            assert set(ops["mc"][mine].tolist()) == {0, 1}  # both of its stages' actions
        result = analyze(trace)
        assert math.isfinite(result.sim_error)


@pytest.mark.distributed
def test_a_mesh_unflattened_from_the_world_is_read_from_the_parameters(mesh_runs):
    # torch's _unflatten (torchtitan's dense and expert meshes) makes the 1-D world mesh the
    # root: its dim 'world' was refused as a dim the recorder does not model
    trace = read_run(mesh_runs / "unflatten")
    assert trace.meta.extra["parallel"] == {"dp": 2, "tp": 2, "cp": 1, "ep": 1, "pp": 1}
    assert trace.meta.extra["mesh"] == {"fsdp": 2, "tp": 2}
    groups = [tuple(g) for g in trace.meta.extra["process_groups"]]
    ar = trace.ops["optype"] == AR
    assert {groups[p] for p in set(trace.ops["pg"][ar].tolist())} == {(0, 1), (2, 3)}
