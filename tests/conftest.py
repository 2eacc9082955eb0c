"""Shared test fixtures: paths to ../shared/data and a real torchrun launcher."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
NDTIMELINE = SHARED_DATA / "ndtimeline-samples"
KINETO = SHARED_DATA / "kineto-samples"


def free_port() -> int:
    """A free TCP port on loopback for a rendezvous endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str | Path, nproc: int, *args: str, timeout: float = 300,
             env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Launch `script` under real torchrun (standalone rendezvous on loopback) and wait."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           str(script), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
                "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env,
                          cwd=str(REPO))
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun {script} failed ({proc.returncode}):\n"
                             f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture(scope="session")
def ndtimeline_dir() -> Path:
    """The NDTimeline sample traces (skips only if ../shared is absent)."""
    if not NDTIMELINE.exists():
        pytest.skip(f"{NDTIMELINE} not present")
    return NDTIMELINE
