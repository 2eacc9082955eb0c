"""Real torchrun jobs (gloo on loopback): the recorder's output, fidelity, a dying rank, DDP."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, torchrun
from replaycheck import check_replay

from stragglers.trace.model import OPTYPE_CODES
from stragglers.trace.runformat import read_run

TRAIN = REPO / "examples" / "train_gpt.py"
WORKERS = Path(__file__).parent / "workers"
pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def slow_run(tmp_path_factory) -> Path:
    """dp 2 × pp 2, 4 microbatches, 8 steps; rank 2 (dp 1, stage 0) computes 3× as long. Every
    rank on one CPU: unpinned, the OS gave ranks of this job unequal shares of 2 loaded cores
    for whole runs (another rank ×2 slower: a real straggler the diagnosis then names)."""
    out = tmp_path_factory.mktemp("slow") / "trace"
    torchrun(TRAIN, 4, "--pp", "2", "--steps", "8", "--slow-rank", "2", "--slow-factor", "3",
             "--trace-dir", str(out), timeout=300, one_cpu=True)
    return out


def count(ops, rank, step, name) -> int:
    return int(np.sum((ops["rank"] == rank) & (ops["step"] == step)
                      & (ops["optype"] == OPTYPE_CODES[name])))


def test_every_rank_records_the_1f1b_schedule(slow_run):
    trace = read_run(slow_run)
    ops, meta = trace.ops, trace.meta
    assert (meta.dp_size, meta.pp_size, meta.world_size) == (2, 2, 4)
    layout = {e["rank"]: (e["dp_rank"], e["stage"]) for e in meta.extra["layout"]}
    assert layout == {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}
    assert meta.extra["injections"] == [{"cause": "worker_fault", "factor": 3.0, "rank": 2,
                                         "dp_rank": 1, "stage": 0}]
    for rank, (dp, stage) in layout.items():
        mine = ops["rank"] == rank
        assert set(ops["dp_rank"][mine]) == {dp} and set(ops["stage"][mine]) == {stage}
        assert sorted(set(ops["step"][mine].tolist())) == list(range(8))
        for step in range(8):
            expect = {"forward-compute": 4, "backward-compute": 4, "grads-all-reduce": 1,
                      "optimizer-clip-main-grad": 1, "optimizer": 1,
                      "forward-send": 4 * (stage == 0), "backward-recv": 4 * (stage == 0),
                      "forward-recv": 4 * (stage == 1), "backward-send": 4 * (stage == 1)}
            got = {name: count(ops, rank, step, name) for name in expect}
            assert got == expect, f"rank {rank} step {step}"
    # sequence metadata kept with each compute op (fixed 256-token sequences)
    fwd = ops["optype"] == OPTYPE_CODES["forward-compute"]
    assert np.all(ops["tokens"][fwd] == 256) and np.all(ops["attn_cost"][fwd] == 256.0 ** 2)
    p2p = np.isin(ops["optype"], [OPTYPE_CODES[n] for n in ("forward-send", "forward-recv")])
    assert np.all(ops["bytes"][p2p] == 256 * 64 * 4)
    # communication rows (sends stamped by the waiter, blocking recvs and all-reduces) carry the
    # CPU wait of their threads; compute rows carry none
    comm = np.isin(ops["optype"], [OPTYPE_CODES[n] for n in (
        "forward-send", "forward-recv", "backward-send", "backward-recv", "grads-all-reduce")])
    if os.path.exists("/proc/thread-self/schedstat"):
        assert np.all(np.isfinite(ops["cpu_wait"][comm])) and np.all(ops["cpu_wait"][comm] >= 0)
    assert np.all(np.isnan(ops["cpu_wait"][fwd]))


def test_clock_offsets_are_measured_at_start_and_end(slow_run):
    clock = read_run(slow_run).meta.extra["clock"]
    assert len(clock["start"]) == len(clock["end"]) == 4
    assert clock["start"][0]["error_ns"] == 0  # rank 0 is the reference
    for est in clock["start"][1:] + clock["end"][1:]:
        assert 0 < est["rtt_ns"] and est["error_ns"] == est["rtt_ns"] // 2
        # one host, one monotonic clock: the true offset is 0, within the error bound
        assert abs(est["offset_ns"]) <= est["error_ns"] + 1000
    assert 0 <= clock["max_error_start_s"] < 0.1 and "max_drift_s" in clock


def test_replay_reproduces_the_measured_step_times(slow_run):
    # Exact but for what gloo's torn transfers move later (replaycheck.py), not a bound on the
    # replay's error, which grows with the machine's load through them.
    # every step: whether step 0 counts as warm-up depends on the machine's load that moment,
    # and the replay must reproduce warm-up steps too
    replayed = check_replay(read_run(slow_run), steps="all")
    assert replayed["steps"] == 8, replayed


def test_the_slow_worker_is_diagnosed_at_its_place(slow_run):
    from stragglers.whatif import analyze

    result = analyze(read_run(slow_run))
    top = result.diagnosis[0]
    assert top.cause == "worker_fault", result.diagnosis
    # worst first (a 3x burn on 2 shared cores can also slow a rank sharing its core)
    worst = top.where.workers[0]
    assert (worst.dp, worst.pp) == (1, 0), top.where
    assert top.speedup_if_fixed > 1.2


def test_a_dying_rank_leaves_readable_steps(tmp_path):
    out = tmp_path / "trace"
    proc = torchrun(TRAIN, 2, "--pp", "1", "--steps", "12", "--trace-dir", str(out),
                    "--crash-rank", "1", "--crash-at-step", "6", "--flush-interval", "0.02",
                    timeout=240, check=False)
    assert proc.returncode != 0
    trace = read_run(out)
    ops = trace.ops
    steps_of = {r: set(ops["step"][ops["rank"] == r].tolist()) for r in (0, 1)}
    assert steps_of[1] <= set(range(6)) and set(range(5)) <= steps_of[1]
    assert set(range(5)) <= steps_of[0]
    assert trace.meta.extra["injections"][0]["cause"] == "crash"

    from stragglers.whatif import analyze

    result = analyze(trace)
    # every complete step is analysed or named as warm-up: the analyser leaves out slow
    # leading steps by default (and says so), so 5 or 6 complete steps can leave 4 analysed
    # (seen beside a CPU hog)
    assert result.job.steps + len(result.warmup_steps) >= 5, result.warmup_steps
    assert result.job.steps >= 2
    text = " ".join(result.warnings)
    if steps_of[0] != steps_of[1]:
        assert "step" in text, "the analyser must say which steps it dropped"


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> Path:
    """A 4-step DDP job's run directory (read by the comm-hook test, then refused as the
    directory of a second job)."""
    out = tmp_path_factory.mktemp("ddp") / "trace"
    torchrun(WORKERS / "ddp_worker.py", 2, str(out), "4", timeout=180)
    return out


def test_ddp_comm_hook_records_every_bucket(ddp_run):
    out = ddp_run
    assert (out / "ok-0").exists() and (out / "ok-1").exists()
    ops = read_run(out).ops
    ar = (ops["optype"] == OPTYPE_CODES["grads-all-reduce"]) & (ops["rank"] == 0)
    per_step = np.bincount(ops["step"][ar], minlength=4)
    # DDP rebuilds its buckets after the first step; from then on every bucket is one op
    assert np.all(per_step[1:] == per_step[1]) and per_step[1] >= 2, per_step
    grad_bytes = (256 * 512 + 512 + 512 * 512 + 512 + 512 * 256 + 256) * 4
    for step in range(4):
        assert ops["bytes"][ar & (ops["step"] == step)].sum() == grad_bytes  # every grad, once
    assert np.all(ops["duration"][ar] >= 0)


def test_every_rank_refuses_a_directory_holding_another_run(ddp_run):
    out = ddp_run
    before = sorted(p.name for p in out.iterdir())
    assert "meta.json" in before
    proc = torchrun(WORKERS / "ddp_worker.py", 2, str(out), "2", timeout=180, check=False)
    assert proc.returncode != 0
    # all ranks decide together (no rank left hanging in a collective), one line each
    assert proc.stderr.count("is not empty (it holds an earlier run's files)") >= 2, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == before  # nothing of the first run was lost
