"""Checkpoints load with weights_only=True; the example refuses to continue a run silently."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from stragglers.adapt.checkpoint import fsync_directory, read_checkpoint
from stragglers.errors import InputError

EXAMPLE = REPO / "examples" / "train_adaptive.py"


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_tampered_checkpoint_runs_no_code(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "checkpoint.pt"
    with open(path, "wb") as f:
        pickle.dump({"step": 1, "model": _Payload(marker)}, f)
    with pytest.raises(InputError, match="checkpoint"):
        read_checkpoint(path)
    assert not marker.exists(), "loading the checkpoint executed code"


@pytest.mark.slow
def test_a_checkpoint_of_plain_state_round_trips(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = {"step": 7, "model": model.state_dict(), "optimizer": opt.state_dict(),
             "shards": {"dataset": {"name": "d"}, "epochs_created": 1, "shards": [[0, 0, "DONE", 3, 0, 1, None]]},
             "extra": {}}
    torch.save(state, tmp_path / "c.pt")
    fsync_directory(tmp_path)
    back = read_checkpoint(tmp_path / "c.pt")
    assert back["step"] == 7 and back["shards"] == state["shards"]
    assert torch.equal(back["model"]["weight"], model.state_dict()["weight"])
    assert read_checkpoint(tmp_path / "absent.pt") is None
    torch.save({"step": 1}, tmp_path / "partial.pt")
    with pytest.raises(InputError, match="model"):
        read_checkpoint(tmp_path / "partial.pt")


@pytest.mark.slow
def test_the_example_refuses_to_resume_silently(tmp_path):
    (tmp_path / "checkpoint.pt").write_bytes(b"earlier run")
    run = subprocess.run([sys.executable, str(EXAMPLE), "--workdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 2
    assert "--resume" in run.stderr and "--overwrite" in run.stderr and "Traceback" not in run.stderr
    assert (tmp_path / "checkpoint.pt").read_bytes() == b"earlier run"
