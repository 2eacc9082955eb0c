"""An older source tree for side-by-side runs: a folder as given, or a git revision exported."""

from __future__ import annotations

import subprocess
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def source_tree(given: str) -> str:
    """The `src/` folder to import from: `given` itself where it is a folder, else the `src/` of
    git revision `given` of this repository, exported once under runs/trees/ (so a command
    naming a revision runs the same on any clone that has it)."""
    if Path(given).is_dir():
        return given
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{given}^{{commit}}"],
                         capture_output=True, text=True)
    if rev.returncode != 0:
        raise SystemExit(f"--before {given}: neither a folder nor a git revision of {REPO}")
    commit = rev.stdout.strip()
    out = REPO / "runs" / "trees" / commit[:12]
    if not (out / "src").is_dir():
        archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "src"],
                                 capture_output=True, check=True).stdout
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            with tarfile.open(fileobj=BytesIO(archive)) as tar:
                tar.extractall(tmp, filter="data")
            Path(tmp, "src").rename(out / "src")
    return str(out / "src")
