"""What a reader of the command line sees: help without type noise, -v/-vv that log, one-line
errors without stray blank lines."""

from __future__ import annotations

from pathlib import Path

import subprocess
import sys

import pytest

from stragglers.trace.runformat import write_run
from stragglers.trace.synth import generate


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "stragglers.cli", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "COLUMNS": "100",
                                                       **(env or {})})


@pytest.mark.slow
@pytest.mark.parametrize("path", [(), ("analyze",), ("advise",), ("monitor", "serve"),
                                  ("synth",)], ids=lambda p: " ".join(p) or "root")
def test_help_shows_what_an_option_takes_not_its_python_type(path):
    out = cli(*path, "--help")
    assert out.returncode == 0, out.stderr
    assert "<bool>" not in out.stdout          # a flag takes no value
    assert "<list[" not in out.stdout          # a repeatable option names its element
    for line in out.stdout.splitlines():
        if "--verbose" in line:
            assert "<int>" not in line and "[default: 0]" not in line, line  # a count: -v, -vv


@pytest.mark.slow
def test_advise_help_cites_current_commands_only():
    out = cli("advise", "--help")
    words = " ".join(out.stdout.replace("│", " ").split())
    assert "calibrate-collectives" not in words and "collectives calibrate" in words


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("cli") / "run",
                     generate(dp=2, pp=1, microbatches=2, steps=4, sync="ddp", seed=0))


@pytest.mark.slow
@pytest.mark.parametrize("command", ["analyze", "synth"])
def test_verbose_logs_what_the_command_does(command, run_dir, tmp_path):
    def args(i: int) -> list[str]:
        if command == "analyze":
            return [str(run_dir), "-q"]
        return [str(tmp_path / f"new{i}"), "--dp", "2", "--pp", "1", "--steps", "2"]

    plain = cli(command, *args(0))
    assert plain.returncode == 0 and "INFO" not in plain.stderr, plain.stderr
    info = cli("-v", command, *args(1))
    assert info.returncode == 0, info.stderr
    assert "INFO" in info.stderr and command in info.stderr and "done in" in info.stderr
    assert "DEBUG" not in info.stderr
    debug = cli("-vv", command, *args(2))
    assert debug.returncode == 0, debug.stderr
    assert "DEBUG" in debug.stderr and "Python" in debug.stderr


@pytest.mark.slow
def test_an_error_is_one_line_without_blank_lines(run_dir):
    out = cli("synth", str(run_dir), "--dp", "2")  # the run exists: refused
    assert out.returncode == 2
    assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1, repr(out.stderr)


@pytest.mark.slow
def test_the_stragglar_schedule_comes_with_a_legend_of_its_notation():
    out = cli("collectives", "schedule", "--n", "4")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    first_round = next(i for i, line in enumerate(lines) if line.startswith("R0:"))
    legend = "\n".join(lines[:first_round])
    for notation in ("a⇄S:k", "a→b:k", "a⇄b:k/l", "S = the straggler (rank 3)"):
        assert notation in legend, legend
    assert all(len(line) <= 80 for line in lines[:first_round])


@pytest.mark.slow
def test_coding_info_says_how_to_read_its_table_and_cites_current_commands():
    out = cli("coding", "info", "cyclic-mds", "--n", "4", "--s", "1")   # the README's command
    assert out.returncode == 0, out.stderr
    words = " ".join(out.stdout.split())
    assert "cyclic-mds-real" in words   # the code train_coded.py uses with 5 processes (README)
    assert "decodes the exact full gradient from any 3 of the 4 messages" in words
    decode_help = " ".join(cli("coding", "decode", "--help").stdout.replace("│", " ").split())
    assert "code-info" not in decode_help and "stragglers coding info" in decode_help


@pytest.mark.slow
def test_analyze_and_synth_log_their_stages_with_v_and_errors_end_clean(tmp_path):
    STRAGGLERS = str(Path(sys.executable).with_name("stragglers"))   # the installed command
    run = tmp_path / "run"
    cmd = [STRAGGLERS, "-v", "synth", str(run), "--dp", "2", "--pp", "2",
           "--steps", "3"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "generating the trace" in out.stderr
    out = subprocess.run([STRAGGLERS, "-v", "analyze", str(run), "-q"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0
    for stage in ("reading", "dependency model", "ideal replay", "diagnosis"):
        assert stage in out.stderr, out.stderr
    bad = subprocess.run([STRAGGLERS, "analyze", str(tmp_path / "no")],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "\n\n" not in bad.stderr
