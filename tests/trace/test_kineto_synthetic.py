"""Kineto reader on hand-built traces with known answers: clocks, steps, phases, collectives."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from stragglers.errors import InputError
from stragglers.trace.kineto import looks_like_kineto, read_kineto
from stragglers.whatif import analyze


def _messages(trace) -> list[str]:
    """The reader's notes as plain messages."""
    return [n.message for n in trace.notes]



class _Builder:
    """Writes one rank's trace the way Kineto does: CPU ops launch GPU kernels by correlation id."""

    def __init__(self, rank: int, clock_us: float, base_ns: int | None = None):
        self.rank, self.clock, self.base_ns = rank, clock_us, base_ns
        self.events: list[dict] = []
        self.corr = 1000 * (rank + 1)

    def _x(self, cat, name, ts, dur, pid, tid, args=None):
        ts = ts + self.clock - (self.base_ns / 1000 if self.base_ns else 0)
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid,
                            "ts": ts, "dur": dur, "args": args or {}})

    def cpu(self, name, ts, dur, tid=1, cat="cpu_op", args=None):
        self._x(cat, name, ts, dur, 100, tid, args)

    def kernel(self, name, launch_ts, gpu_ts, dur, stream=7, tid=1, args=None):
        self.corr += 1
        self._x("cuda_runtime", "cudaLaunchKernel", launch_ts, 3, 100, tid,
                {"correlation": self.corr})
        self._x("kernel", name, gpu_ts, dur, 0, stream, {"correlation": self.corr, **(args or {})})
        self.events.append({"ph": "s", "cat": "ac2g", "id": self.corr, "pid": 100, "tid": tid,
                            "ts": launch_ts, "name": "ac2g"})

    def write(self, path: Path, info: dict | None = "default", gz: bool = False,
              host: str | None = None) -> Path:
        doc: dict = {"schemaVersion": 1, "deviceProperties": []}
        if host:
            doc["host_name"] = host
        if info == "default":
            info = {"backend": "nccl", "rank": self.rank, "world_size": 2,
                    "pg_config": [{"pg_name": "0", "pg_desc": "default_pg", "pg_size": 2,
                                   "ranks": [0, 1]}]}
        if info is not None:
            doc["distributedInfo"] = info
        if self.base_ns:
            doc["baseTimeNanoseconds"] = self.base_ns
        doc["traceEvents"] = self.events + [{"ph": "M", "name": "process_name", "pid": 0,
                                             "args": {"name": "GPU 0"}}]
        text = json.dumps(doc).encode()
        path.write_bytes(gzip.compress(text) if gz else text)
        return path


def ddp_rank(rank: int, clock_us: float, *, fwd_us: float = 1000.0, steps=(10, 11),
             base_ns: int | None = None, prefix: str = "ncclDevKernel_", seq: bool = True,
             ar_end: dict | None = None) -> _Builder:
    """A DDP rank: forward kernels, backward on the autograd thread with one all-reduce in the
    middle, then an optimizer; the all-reduce ends at the same true time on every rank."""
    b = _Builder(rank, clock_us, base_ns)
    t = 1_000_000.0
    for i, step in enumerate(steps):
        t0 = t + i * 10_000
        b.cpu(f"ProfilerStep#{step}", t0, 9_000, cat="user_annotation")
        b.kernel("volta_sgemm_fwd", t0 + 10, t0 + 50, fwd_us / 2)
        b.kernel("elementwise_fwd", t0 + 20, t0 + 50 + fwd_us / 2, fwd_us / 2)
        tb = t0 + 3_000
        b.cpu("autograd::engine::evaluate_function: AddmmBackward0", tb, 500, tid=2)
        b.kernel("sgemm_bwd_a", tb + 10, tb + 100, 600, stream=8, tid=2)  # overlaps the next run
        # The all-reduce starts when this rank gets there and ends when the last rank arrives.
        end = tb + 2_000 + (ar_end or {}).get(step, 0.0)
        args = {"Collective name": "allreduce", "Process Group Name": "0", "Group size": 2}
        if seq:
            args["Seq"] = i
        b.cpu("record_param_comms", tb + 200, 50, tid=2, args=dict(args))
        b.kernel(f"{prefix}AllReduce_Sum_f32_RING_LL", tb + 210, tb + 600, end - (tb + 600),
                 stream=20, tid=2, args=args)
        b.kernel("sgemm_bwd_b", tb + 220, tb + 600, 700, tid=2)
        b.cpu("Optimizer.step#SGD.step", t0 + 6_000, 300, cat="user_annotation")
        b.kernel("multi_tensor_apply", t0 + 6_010, t0 + 6_100, 150)
    return b


def _rows(trace, rank, optype):
    sel = (trace.ops["rank"] == rank) & (trace.optype_names() == optype)
    return {k: v[sel] for k, v in trace.ops.items()}


def test_clock_offsets_are_recovered_and_collective_ends_line_up(tmp_path):
    offsets = {0: 0.0, 1: 437.0, 2: -1250.5}  # µs of clock skew per rank
    files = [ddp_rank(r, offsets[r]).write(tmp_path / f"t{r}.json",
                                           info={"rank": r, "world_size": 3}) for r in offsets]
    trace = read_kineto(files)
    got = trace.meta.extra["clock_offsets_s"]
    for r, off in offsets.items():
        assert got[str(r)] == pytest.approx(off / 1e6, abs=1e-9)
    ends = [(_rows(trace, r, "grads-all-reduce")["start_ts"]
             + _rows(trace, r, "grads-all-reduce")["duration"]) for r in offsets]
    assert np.allclose(ends[0], ends[1], atol=1e-9) and np.allclose(ends[0], ends[2], atol=1e-9)
    assert trace.meta.extra["clock_alignment"]["1"]["matched"] == 2


def test_ranks_on_one_host_share_its_clock(tmp_path):
    # Rank 1's all-reduce ends 300 µs late (jitter, not skew): same host, so no shift.
    a = ddp_rank(0, 0.0).write(tmp_path / "a.json", host="node7")
    b = ddp_rank(1, 0.0, ar_end={10: 300.0, 11: 300.0}).write(tmp_path / "b.json", host="node7")
    trace = read_kineto([a, b])
    assert trace.meta.extra["clock_offsets_s"]["1"] == 0.0
    assert trace.meta.extra["clock_alignment"]["1"] == {"same_host_as": 0, "host": "node7"}
    c = ddp_rank(1, 0.0, ar_end={10: 300.0, 11: 300.0}).write(tmp_path / "c.json", host="node8")
    other = read_kineto([a, c])
    assert other.meta.extra["clock_offsets_s"]["1"] == pytest.approx(300e-6, abs=1e-9)


def test_phases_runs_and_columns(tmp_path):
    files = [ddp_rank(r, 0.0).write(tmp_path / f"r{r}.json.gz", gz=True) for r in (0, 1)]
    trace = read_kineto(tmp_path)
    assert set(trace.ops["step"]) == {10, 11} and set(trace.ops["rank"]) == {0, 1}
    fwd = _rows(trace, 0, "forward-compute")
    # Both forward kernels form one run: start of the first to end of the second.
    assert np.allclose(fwd["duration"], 1000e-6)
    bwd = _rows(trace, 0, "backward-compute")
    # The bucket all-reduce launched in the middle cuts backward in two (the bucket's all-reduce
    # follows the work that produced it); the first piece, on another stream, overlaps the
    # second and is cut at its start (600 µs of kernel, 500 µs before the next piece starts).
    assert list(bwd["seq_id"]) == [0, 1, 0, 1] and list(bwd["mb_id"]) == [0, 0, 0, 0]
    assert list(bwd["duration"][:2]) == pytest.approx([500e-6, 700e-6])
    assert trace.meta.extra["compute_split_at_collectives"]
    opt = _rows(trace, 0, "optimizer")
    assert len(opt["step"]) == 2 and np.all(opt["mb_id"] == -1)
    ar = _rows(trace, 0, "grads-all-reduce")
    assert len(ar["step"]) == 2
    assert trace.meta.dp_size == 2 and trace.meta.pp_size == 1 and trace.meta.world_size == 2
    assert any("stage 0" in n for n in _messages(trace))
    assert looks_like_kineto(tmp_path) and looks_like_kineto(files[0])
    result = analyze(trace)
    # Two identical ranks: nothing straggles.
    assert result.slowdown == pytest.approx(1.0, abs=1e-6)
    assert result.sim_error < 1e-6


def test_base_time_is_added_back(tmp_path):
    base = 1_700_000_000_000_000_000  # ns; ts become relative to it
    f = ddp_rank(0, 0.0, base_ns=base).write(tmp_path / "a.json", info={"rank": 0, "world_size": 1})
    trace = read_kineto(f)
    origin = trace.meta.extra["time_origin_unix_s"]
    first = origin + float(trace.ops["start_ts"].min())
    assert first == pytest.approx(1_000_050 / 1e6, abs=1e-9)  # the clock of the builder, absolute
    # Without baseTimeNanoseconds, ts are absolute epoch µs already.
    g = ddp_rank(0, 1.7e15).write(tmp_path / "b.json", info={"rank": 0, "world_size": 1})
    t2 = read_kineto(g)
    assert t2.meta.extra["time_origin_unix_s"] + t2.ops["start_ts"].min() == pytest.approx(
        1.7e9 + 1.00005, abs=1e-6)


def test_both_nccl_kernel_prefixes_and_matching_without_seq(tmp_path):
    a = ddp_rank(0, 0.0, prefix="ncclKernel_", seq=False).write(tmp_path / "rank-0.json", info=None)
    b = ddp_rank(1, 800.0, prefix="ncclKernel_", seq=False).write(tmp_path / "rank_1.json",
                                                                  info=None)
    trace = read_kineto([a, b])
    assert len(_rows(trace, 1, "grads-all-reduce")["step"]) == 2
    assert trace.meta.extra["clock_offsets_s"]["1"] == pytest.approx(800e-6, abs=1e-9)
    assert trace.meta.world_size == 2  # from the number of files
    assert sum("file name" in n for n in _messages(trace)) == 2


def test_unknown_collectives_are_left_out_with_a_note(tmp_path):
    b = ddp_rank(0, 0.0)
    b.kernel("ncclDevKernel_AllToAll_RING", 1_000_100, 1_000_300, 100, stream=20,
             args={"Collective name": "all_to_all", "Process Group Name": "0"})
    b.kernel("ncclDevKernel_Generic_4", 1_000_400, 1_000_500, 50, stream=20)
    trace = read_kineto(b.write(tmp_path / "x.json"))
    notes = " ".join(_messages(trace))
    # The all-to-all is a row of its own (every collective is modelled); only the kernel that
    # names no collective is left out, and says why.
    assert len(_rows(trace, 0, "all-to-all")["step"]) == 1
    assert "alltoall" not in notes and "collective(s) of unknown kind" in notes
    # The unknown one does not split compute (here the all-to-all comes after the step's
    # forward work, so neither does it): one forward run per step.
    assert len(_rows(trace, 0, "forward-compute")["step"]) == 2


def test_pipeline_p2p_from_given_pp_size(tmp_path):
    files = []
    for rank in (0, 1):
        b = _Builder(rank, 0.0)
        t0 = 1_000_000.0
        b.cpu("ProfilerStep#3", t0, 9_000, cat="user_annotation")
        b.kernel("fwd", t0 + 10, t0 + 50 + rank * 1000, 800)
        kind, peer = ("send", "Dst Rank") if rank == 0 else ("recv", "Src Rank")
        args = {"Collective name": kind, "Process Group Name": "1", peer: 1 - rank}
        b.cpu("record_param_comms", t0 + 900, 20, args=args)
        b.kernel("ncclDevKernel_SendRecv", t0 + 905, t0 + 900, 1000, stream=30, args={})
        b.cpu("autograd::engine::evaluate_function: X", t0 + 3000, 10, tid=2)
        b.kernel("bwd", t0 + 3005, t0 + 3100, 500, tid=2)
        files.append(b.write(tmp_path / f"p{rank}.json"))
    trace = read_kineto(files, pp_size=2)
    assert trace.meta.pp_size == 2 and trace.meta.dp_size == 1
    assert list(trace.optype_names()[trace.ops["rank"] == 0]).count("forward-send") == 1
    assert list(trace.optype_names()[trace.ops["rank"] == 1]).count("forward-recv") == 1
    assert set(trace.ops["stage"][trace.ops["rank"] == 1]) == {1}
    # Without pipeline sizes the send/recv pattern gives the stages (rank 0 sends to 1 first).
    plain = read_kineto(files)
    assert plain.meta.pp_size == 2
    assert list(plain.optype_names()[plain.ops["rank"] == 1]).count("forward-recv") == 1
    assert any("send/recv pattern" in n for n in _messages(plain))
    # A pp_size the pattern contradicts is refused.
    with pytest.raises(InputError, match="send/recv pattern has 2 stage"):
        read_kineto(files, pp_size=1, dp_size=1)


def test_pipeline_stage_from_pg_config(tmp_path):
    info = {"rank": 3, "world_size": 4, "pg_config": [
        {"pg_name": "0", "pg_desc": "default_pg", "pg_size": 4, "ranks": [0, 1, 2, 3]},
        {"pg_name": "2", "pg_desc": "mesh_pp", "pg_size": 2, "ranks": [1, 3]},
        {"pg_name": "3", "pg_desc": "mesh_dp", "pg_size": 2, "ranks": [2, 3]}]}
    trace = read_kineto(ddp_rank(3, 0.0).write(tmp_path / "r3.json", info=info))
    assert set(trace.ops["stage"]) == {1} and set(trace.ops["dp_rank"]) == {1}
    assert trace.meta.pp_size == 2


def test_dp_size_with_tensor_parallel_and_run_format_round_trip(tmp_path):
    from stragglers.trace.runformat import read_run, write_run

    f = ddp_rank(3, 0.0).write(tmp_path / "r3.json", info={"rank": 3, "world_size": 4})
    trace = read_kineto(f, dp_size=2)
    # dp 2 × tp 2: tp fastest, so rank 3 is TP rank 1 of DP replica 1; each TP rank is a
    # worker (column) of its own, dp·tp + t, so the table holds 4 of them
    assert trace.meta.extra["tp_size_implied"] == 2 and trace.meta.dp_size == 4
    assert trace.meta.pp_size == 1 and trace.meta.world_size == 4
    assert set(trace.ops["dp_rank"]) == {3}
    assert any("tensor-parallel ranks" in m for m in _messages(trace))
    back = read_run(write_run(tmp_path / "run", trace))
    assert all(np.array_equal(trace.ops[k], back.ops[k]) for k in trace.ops)
    assert back.meta.extra["clock_offsets_s"] == trace.meta.extra["clock_offsets_s"]


@pytest.mark.parametrize("kwargs, field", [({"pp_size": 3}, "pp_size"), ({"dp_size": 0}, "dp_size"),
                                           ({"dp_size": 4}, "dp_size")])
def test_bad_sizes_are_input_errors(tmp_path, kwargs, field):
    f = ddp_rank(0, 0.0).write(tmp_path / "a.json")
    with pytest.raises(InputError) as err:
        read_kineto(f, **kwargs)
    assert err.value.field == field


def test_two_files_for_one_rank_and_mixed_world_sizes(tmp_path):
    a = ddp_rank(0, 0.0).write(tmp_path / "a.json")
    b = ddp_rank(0, 0.0).write(tmp_path / "b.json")
    with pytest.raises(InputError, match="rank 0 again"):
        read_kineto([a, b])
    c = ddp_rank(1, 0.0).write(tmp_path / "c.json", info={"rank": 1, "world_size": 8})
    with pytest.raises(InputError, match="world_size"):
        read_kineto([a, c])


def test_cpu_only_trace_uses_cpu_ops(tmp_path):
    b = _Builder(0, 0.0)
    t0 = 1_000_000.0
    b.cpu("ProfilerStep#1", t0, 5_000, cat="user_annotation")
    b.cpu("aten::linear", t0 + 10, 300)
    b.cpu("aten::addmm", t0 + 20, 200)             # nested: not a separate op
    b.cpu("aten::relu", t0 + 400, 100)
    b.cpu("autograd::engine::evaluate_function: AddmmBackward0", t0 + 1_000, 400)
    b.cpu("c10d::allreduce_", t0 + 1_500, 30)       # the enqueue: neither compute nor collective
    b.cpu("gloo:all_reduce", t0 + 1_520, 900, tid=9, cat="user_annotation")
    b.cpu("aten::add_", t0 + 1_600, 50)
    b.cpu("Optimizer.step#SGD.step", t0 + 3_000, 100, cat="user_annotation")
    b.cpu("aten::add_", t0 + 3_010, 80)
    trace = read_kineto(b.write(tmp_path / "g.json", info={"backend": "gloo", "rank": 0,
                                                           "world_size": 1}))
    names = list(trace.optype_names())
    assert names.count("forward-compute") == 1 and names.count("grads-all-reduce") == 1
    # The add_ after backward's last autograd op waits for the all-reduce: it is step tail
    # (optimizer), not backward.
    assert names.count("backward-compute") == 1 and names.count("optimizer") == 1
    opt = _rows(trace, 0, "optimizer")
    assert opt["start_ts"][0] == pytest.approx(_rows(trace, 0, "forward-compute")["start_ts"][0]
                                               + 1590e-6, abs=1e-9)
    # busy time: 50 + 80 µs; the 1.4 ms between them is idle, not the span
    assert opt["duration"][0] == pytest.approx(130e-6)
    fwd = _rows(trace, 0, "forward-compute")
    # Busy time; the 90 µs between the two ops is Python dispatching the next one (counted).
    assert fwd["duration"][0] == pytest.approx(490e-6)
    assert any("no GPU rows" in n for n in _messages(trace))


@pytest.mark.slow
def test_parallel_parsing_gives_the_same_trace(tmp_path):
    for r in (0, 1):
        ddp_rank(r, 300.0 * r, steps=tuple(range(10, 40))).write(tmp_path / f"r{r}.json")
    serial = read_kineto(tmp_path, workers=1)
    parallel = read_kineto(tmp_path, workers=2)
    assert all(np.array_equal(serial.ops[k], parallel.ops[k]) for k in serial.ops)
    assert serial.notes == parallel.notes
    bad = tmp_path / "r2.json"
    bad.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON") as err:
        read_kineto(tmp_path, workers=2)   # an error in a worker names the file, one line
    assert str(bad) in str(err.value)


def test_files_of_different_runs_are_refused(tmp_path):
    a = ddp_rank(0, 0.0).write(tmp_path / "a.json")
    # Same steps, same host clock, but a minute later: no collective is in flight on both.
    b = ddp_rank(1, 60e6).write(tmp_path / "b.json", host="same")
    a = ddp_rank(0, 0.0).write(tmp_path / "a.json", host="same")
    with pytest.raises(InputError, match="different runs"):
        read_kineto([a, b])
    # No step in common.
    c = ddp_rank(1, 0.0, steps=(50, 51)).write(tmp_path / "c.json")
    with pytest.raises(InputError, match="no step in common"):
        read_kineto([a, c])
    # Process groups that disagree.
    info = {"backend": "nccl", "rank": 1, "world_size": 2,
            "pg_config": [{"pg_name": "0", "pg_desc": "default_pg", "pg_size": 2,
                           "ranks": [0, 2]}]}
    d = ddp_rank(1, 0.0).write(tmp_path / "d.json", info=info)
    with pytest.raises(InputError, match="process group 0"):
        read_kineto([a, d])


def test_missing_ranks_are_noted(tmp_path):
    info = {"backend": "nccl", "rank": 0, "world_size": 128}
    trace = read_kineto(ddp_rank(0, 0.0).write(tmp_path / "a.json", info=info))
    assert trace.meta.extra["ranks_missing"] == list(range(1, 128))
    assert trace.notes[0].kind == "ranks"
    assert "read 1 of 128 ranks (0); missing: 1-127" in trace.notes[0].message


def test_a_pipeline_size_on_a_data_parallel_trace_is_refused(tmp_path):
    info = {"backend": "nccl", "rank": 0, "world_size": 4}
    files = [ddp_rank(r, 0.0).write(tmp_path / f"{r}.json", info={**info, "rank": r})
             for r in range(4)]
    with pytest.raises(InputError) as err:
        read_kineto(files, dp_size=2, pp_size=2)
    assert err.value.field == "pp_size" and "no rank sends or receives" in str(err.value)


def test_empty_and_broken_directories_say_what_was_expected(tmp_path):
    from stragglers.trace.load import load_trace

    with pytest.raises(InputError, match="empty directory; expected a run directory"):
        load_trace(tmp_path)
    (tmp_path / "x.json").write_text("{broken")
    with pytest.raises(InputError, match="not valid JSON") as err:
        load_trace(tmp_path)
    assert "meta.json" not in str(err.value)


def test_gloo_work_is_paired_with_its_issuing_op_when_the_window_cuts_one_off():
    # gloo runs a send on its own thread: the work (annotation) starts after the op that issued
    # it. The profiled window holds the late work of an op issued before it began, and misses
    # the work of its last op: the counts match, and first-with-first would give every work
    # its neighbour's issue time and peer
    from types import SimpleNamespace

    from stragglers.trace.kineto.items import _cpu_collectives
    from stragglers.trace.kineto.ops import ReadCounts
    issued = [(t, 0.01, 1, "send", "0", None, None, dst, False, None, None)
              for t, dst in ((1.0, 1), (2.0, 2), (3.0, 3))]
    work = [(t, 0.01, 9, "send", None, None, None, None, True, None, None)
            for t in (1.005, 1.02, 2.02)]
    counts = ReadCounts()
    out = _cpu_collectives(SimpleNamespace(collectives=issued + work), counts)
    by_start = {round(o[0], 3): o for o in out}
    assert by_start[1.02][2] == 1.0 and by_start[1.02][7] == 1     # op 1's work: its launch, peer
    assert by_start[2.02][2] == 2.0 and by_start[2.02][7] == 2
    assert by_start[1.005][7] is None and counts.unpaired_annotations == 1
    # nothing cut off: first with first
    counts = ReadCounts()
    out = _cpu_collectives(SimpleNamespace(collectives=issued + [
        (t, 0.01, 9, "send", None, None, None, None, True, None, None) for t in (1.02, 2.02, 3.02)]),
        counts)
    assert [o[7] for o in sorted(out)] == [1, 2, 3] and not counts.unpaired_annotations


def test_gloo_sends_in_flight_together_are_two_collectives():
    # train_gpt's 1F1B on gloo: the second isend of a step starts while the first is still in
    # flight on the same thread and ends after it. Taken for one collective seen twice, the
    # second send was dropped: that rank's step lacked a forward-send and the analysis left
    # the whole step out as incomplete (ranks: a real run's rank 0, step 4, times in ms)
    from types import SimpleNamespace

    from stragglers.trace.kineto.items import _cpu_collectives
    from stragglers.trace.kineto.ops import ReadCounts
    issued = [(t, 0.07, 1, "send", None, None, None, 1, False, None, None) for t in (11.57, 19.19)]
    work = [(11.63, 10.71, 1, "send", None, None, None, None, True, None, None),
            (19.25, 92.62, 1, "send", None, None, None, None, True, None, None),
            (30.0, 5.0, 1, "send", None, None, None, None, True, None, None)]   # wholly inside
    issued.append((29.9, 0.07, 1, "send", None, None, None, 1, False, None, None))
    counts = ReadCounts()
    out = _cpu_collectives(SimpleNamespace(collectives=issued + work), counts)
    assert sorted((o[0], o[2], o[7]) for o in out) == [(11.63, 11.57, 1), (19.25, 19.19, 1),
                                                       (30.0, 29.9, 1)]
    assert not counts.unpaired_annotations


def test_one_collective_issued_twice_is_one_with_the_inner_records_metadata():
    # c10d::broadcast_ around record_param_comms (which names the group, Seq and ranks), around
    # the backend's annotation, as torch 2.x writes NCCL's CPU side: one collective, whose group
    # is the inner record's
    from types import SimpleNamespace

    from stragglers.trace.kineto.items import _cpu_collectives
    from stragglers.trace.kineto.ops import ReadCounts
    colls = [(0.0, 0.39, 1, "broadcast", None, None, None, None, False, None, None),
             (0.05, 0.28, 1, "broadcast", "0", 7, None, None, False, None, None),
             (0.08, 0.15, 1, "broadcast", None, None, None, None, True, None, None)]
    for annotated in (True, False):
        out = _cpu_collectives(SimpleNamespace(collectives=colls if annotated else colls[:2]),
                               ReadCounts())
        assert [(o[0], o[4], o[5]) for o in out] == [(0.08 if annotated else 0.0, "0", 7)]


def test_tensor_parallel_group_from_pg_config(tmp_path):
    # world 8 = pp 2 × dp 2 × tp 2 (tp fastest): rank = 4·pp + 2·dp + tp
    def info(rank):
        pp, dp, tp = rank // 4, rank // 2 % 2, rank % 2
        groups = [("mesh_pp", [r for r in range(8) if r % 4 == rank % 4]),
                  ("mesh_dp", [4 * pp + 2 * d + tp for d in range(2)]),
                  ("mesh_tp", [4 * pp + 2 * dp + t for t in range(2)])]
        return {"backend": "nccl", "rank": rank, "world_size": 8,
                "pg_config": [{"pg_name": str(i + 1), "pg_desc": d, "pg_size": 2, "ranks": r}
                              for i, (d, r) in enumerate(groups)]}
    for rank, (stage, column) in {3: (0, 3), 6: (1, 2)}.items():
        trace = read_kineto(ddp_rank(rank, 0.0).write(tmp_path / f"r{rank}.json",
                                                      info=info(rank)))
        # each TP rank of a replica is a worker (column) of its own: dp·tp + t
        assert set(trace.ops["stage"]) == {stage} and set(trace.ops["dp_rank"]) == {column}
        (tmp_path / f"r{rank}.json").unlink()
