"""Checkpoints load with weights_only=True; the example refuses to continue a run silently."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from stragglers.adapt.checkpoint import JobCheckpoint, fsync_directory, read_checkpoint
from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.replies import Snapshot
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
    snap = Snapshot(DatasetConfig("d", 3, 3), 1, [(0, 0, "DONE", 3, 0, 1, None)])
    state = JobCheckpoint(7, model.state_dict(), opt.state_dict(), snap, {"note": "x"})
    plain = state.to_plain()
    # the file holds the snapshot as the JSON document the service sent (lists, no objects)
    assert plain["shards"] == {"dataset": {"name": "d", "num_samples": 3, "shard_size": 3,
                                           "seed": 0, "num_epochs": 1, "lease_s": 30.0,
                                           "max_retries": 3},
                               "epochs_created": 1, "shards": [[0, 0, "DONE", 3, 0, 1, None]],
                               "folded_epochs": 0}
    torch.save(plain, tmp_path / "c.pt")
    fsync_directory(tmp_path)
    back = read_checkpoint(tmp_path / "c.pt")
    assert back.step == 7 and back.shards == snap and back.extra == {"note": "x"}
    assert torch.equal(back.model["weight"], model.state_dict()["weight"])
    assert read_checkpoint(tmp_path / "absent.pt") is None
    torch.save({"step": 1}, tmp_path / "partial.pt")
    with pytest.raises(InputError, match="model"):
        read_checkpoint(tmp_path / "partial.pt")
    torch.save({**plain, "shards": {**plain["shards"], "shards": [[0, 0, "DONE"]]}},
               tmp_path / "bad.pt")
    with pytest.raises(InputError, match=r"not a checkpoint this code wrote.*\$\.shards\.shards"):
        read_checkpoint(tmp_path / "bad.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(InputError, match="not a checkpoint"):
        read_checkpoint(tmp_path / "list.pt")


@pytest.mark.slow
def test_the_example_refuses_to_resume_silently(tmp_path):
    (tmp_path / "checkpoint.pt").write_bytes(b"earlier run")
    run = subprocess.run([sys.executable, str(EXAMPLE), "--workdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 2
    assert "--resume" in run.stderr and "--overwrite" in run.stderr and "Traceback" not in run.stderr
    assert (tmp_path / "checkpoint.pt").read_bytes() == b"earlier run"
