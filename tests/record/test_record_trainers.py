"""Trainer integrations and the launcher form on real torchrun jobs (gloo, 2 processes)."""

from __future__ import annotations

import socket
import sys

import numpy as np
import pytest
from conftest import REPO, free_port, torchrun

from stragglers.errors import InputError
from stragglers.trace.model import OPTYPE_CODES
from stragglers.trace.runformat import read_run

WORKERS = REPO / "tests" / "record" / "workers"
pytestmark = pytest.mark.distributed
FWD, AR = OPTYPE_CODES["forward-compute"], OPTYPE_CODES["grads-all-reduce"]


def diagnose(trace) -> dict:
    from stragglers.whatif import analyze

    return analyze(trace)


def assert_slow_rank_found(trace, rank: int) -> None:
    result = diagnose(trace)
    top = result.diagnosis[0]
    assert top.cause == "worker_fault", result.diagnosis
    assert top.where.ranks == [rank] and top.where.hosts == [socket.gethostname()]
    assert result.sim_error <= 0.05, result.sim_error


def test_lightning_callback_records_a_ddp_fit(tmp_path):
    pytest.importorskip("lightning")
    torchrun(WORKERS / "lightning_worker.py", 2, str(tmp_path), "10", "1", timeout=600)
    trace = read_run(tmp_path / "stragglers-trace")
    ops = trace.ops
    assert trace.meta.extra["wrapper"] == "ddp" and trace.meta.name == "Regressor"
    assert sorted(set(ops["step"].tolist())) == list(range(1, 10))  # DDP's first step skipped
    for r in (0, 1):  # one microbatch per step, every bucket all-reduced, no validation forwards
        mine = ops["rank"] == r
        assert np.all(np.bincount(ops["step"][mine & (ops["optype"] == FWD)])[1:] == 1)
        assert np.sum(mine & (ops["optype"] == AR)) >= 9
    assert_slow_rank_found(trace, 1)


def test_hf_trainer_callback_records_a_ddp_run_with_sequence_lengths(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    torchrun(WORKERS / "hf_worker.py", 2, str(tmp_path), "10", "1", timeout=600)
    trace = read_run(tmp_path / "trace")
    ops = trace.ops
    assert trace.meta.extra["wrapper"] == "ddp" and trace.meta.name == "GPT2LMHeadModel"
    fwd = ops["optype"] == FWD
    # 4 sequences of 64 tokens per microbatch, from the batch's attention_mask
    assert np.all(ops["tokens"][fwd] == 256) and np.all(ops["attn_cost"][fwd] == 4 * 64 ** 2)
    assert_slow_rank_found(trace, 1)


def test_the_launcher_switches_recording_on_for_an_unchanged_job(tmp_path):
    import typer
    from typer.testing import CliRunner

    from stragglers.record.commands import register

    app = typer.Typer()
    register(app)
    app.command("unused", hidden=True)(lambda: None)  # a group, as in the stragglers app
    out = tmp_path / "recorded"
    job = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(REPO / "examples" / "train_fsdp.py"),
           "--wrap", "ddp", "--steps", "4", "--out", str(tmp_path / "its-own-dir")]
    result = CliRunner().invoke(app, ["record", "--out", str(out), "--sample-every", "2", "--",
                                      *job], env={"OMP_NUM_THREADS": "1",
                                                  "GLOO_SOCKET_IFNAME": "lo"})
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "its-own-dir").exists()
    trace = read_run(out)
    assert sorted(set(trace.ops["step"].tolist())) == [2]  # DDP skips step 0; one in two after
    assert trace.meta.extra["recorder"]["sample_every"] == 2
    again = CliRunner().invoke(app, ["record", "--out", str(out), "--", *job])
    # refused before the job starts; the stragglers CLI turns an InputError into exit status 2
    assert isinstance(again.exception, InputError) and "is not empty" in str(again.exception)


def test_the_launcher_passes_on_the_jobs_exit_status_and_signal(tmp_path):
    # The job's status is the launcher's; a job killed by a signal exits 128 + its number (the
    # shell's convention: 137 for SIGKILL), not Python's -9 turned into 247, and says so.
    import subprocess

    cli = [sys.executable, "-m", "stragglers.cli", "record"]
    for code, job in ((3, "import sys; sys.exit(3)"),
                      (137, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")):
        r = subprocess.run([*cli, "--out", str(tmp_path / f"r{code}"), "--", sys.executable,
                            "-c", job], capture_output=True, text=True, timeout=120)
        assert r.returncode == code, r.stderr
        said = "killed by signal 9" if code == 137 else "exited with status 3"
        assert said in r.stderr, r.stderr
