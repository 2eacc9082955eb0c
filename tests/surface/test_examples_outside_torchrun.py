"""A distributed example started without torchrun says in one line how to launch it (exit 2)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "examples"))
from launch import TORCHRUN_VARIABLES, require_torchrun  # noqa: E402  (examples/launch.py)

INIT = re.compile(r"\b(init_process_group|init_distributed)\(")


def test_outside_torchrun_the_check_names_the_launch_command(monkeypatch, capsys):
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", [str(REPO / "examples" / "train_x.py"), "--steps", "2"])
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as exit_:
        require_torchrun(3)
    assert exit_.value.code == 2
    line = capsys.readouterr().err.strip()
    assert line == ("error: examples/train_x.py runs under torchrun (the environment lacks "
                    f"{', '.join(TORCHRUN_VARIABLES)}); e.g. python -m torch.distributed.run "
                    "--nproc-per-node 3 examples/train_x.py --steps 2")


def test_under_torchrun_the_check_passes(monkeypatch):
    for name in TORCHRUN_VARIABLES:
        monkeypatch.setenv(name, "0")
    require_torchrun()


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "examples").glob("*.py")
                                          if INIT.search(p.read_text())))
def test_every_distributed_example_checks_before_it_joins_a_group(script):
    text = (REPO / "examples" / script).read_text()
    check = text.find("    require_torchrun(")
    assert 0 <= check < INIT.search(text).start(), f"{script} joins a process group unchecked"


@pytest.mark.slow
def test_an_example_run_without_torchrun_exits_2_in_one_line():
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    script = REPO / "examples" / "train_pipeline.py"
    helped = subprocess.run([sys.executable, str(script), "--help"], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert helped.returncode == 0 and "--schedule" in helped.stdout, helped.stderr[-2000:]
    proc = subprocess.run([sys.executable, str(script), "--steps", "2"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: examples/train_pipeline.py runs under torchrun")
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
