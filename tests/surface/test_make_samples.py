"""`make samples`, the README's first real-trace step: both of its sources put the same files
where the README reads them (a local git repository stands in for GitHub, which CI cannot reach)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO

SAMPLES = REPO.parent / "shared" / "data" / "ndtimeline-samples"
EXPECTED = sorted(f"{kind}-{name}.{ext}" for kind, ext in (("trace", "parquet"), ("meta", "yaml"))
                  for name in ("AR", "SE", "ST"))


def make_samples(workdir: Path, *variables: str) -> list[str]:
    """Run the repository's `make samples` with workdir as the tree; the files it wrote."""
    shutil.copy(REPO / "Makefile", workdir / "Makefile")
    subprocess.run(["make", "-s", "samples", *variables], cwd=workdir, check=True,
                   capture_output=True, text=True, timeout=120)
    return sorted(p.name for p in (workdir / "runs" / "samples").iterdir())


@pytest.fixture
def mirror():
    if not SAMPLES.exists():
        pytest.skip(f"the public samples are read from {SAMPLES}: absent")
    return SAMPLES


def test_samples_are_cloned_from_a_repository_holding_them_under_data(tmp_path, mirror):
    # the layout of github.com/ByteDance-Seed/StragglerAnalysis: the samples under data/
    upstream = tmp_path / "upstream"
    shutil.copytree(mirror, upstream / "data")
    for args in (["init", "-q"], ["add", "data"],
                 ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "samples"]):
        subprocess.run(["git", *args], cwd=upstream, check=True, timeout=60)
    tree = tmp_path / "tree"
    tree.mkdir()
    assert make_samples(tree, f"SAMPLES_REPO={upstream}") == EXPECTED
    assert not (tree / "runs" / "samples" / ".clone").exists()  # the clone is not left behind


def test_samples_are_copied_from_a_local_mirror(tmp_path, mirror):
    assert make_samples(tmp_path, f"SAMPLES_FROM={mirror}") == EXPECTED
    assert (tmp_path / "runs" / "samples" / "trace-ST.parquet").read_bytes() == \
        (mirror / "trace-ST.parquet").read_bytes()
