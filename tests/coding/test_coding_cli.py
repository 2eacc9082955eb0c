"""The `stragglers code-info` / `code-decode` commands, run as a real subprocess."""

import subprocess
import sys


def run(*args):
    return subprocess.run([sys.executable, "-m", "stragglers.cli", *args], capture_output=True,
                          text=True, timeout=60)


def test_code_info_shows_parts_and_guard_verdict():
    out = run("code-info", "cyclic-mds", "--n", "6", "--s", "3")
    assert out.returncode == 0, out.stderr
    assert "0 1 2 3" in out.stdout and "1, 2, 2, 1" in out.stdout and "is stable" in out.stdout
    out = run("code-info", "cyclic-mds", "--n", "50", "--s", "11")
    assert out.returncode == 0 and "UNSTABLE" in out.stdout and "fractional repetition" in out.stdout


def test_code_decode_prints_spec_vector_and_rejects_bad_input():
    out = run("code-decode", "cyclic-mds", "--n", "6", "--s", "3", "--survivors", "0,2,4")
    assert out.returncode == 0, out.stderr
    assert "a = [0.333333, 0, 0.333333, 0, 0.333333, 0]" in out.stdout
    bad = run("code-decode", "cyclic-mds", "--n", "6", "--s", "3", "--survivors", "0,2")
    assert bad.returncode == 2 and "survivors" in bad.stderr and "Traceback" not in bad.stderr
    bad = run("code-info", "frc", "--n", "8", "--s", "2")
    assert bad.returncode == 2 and "(s+1) | n" in bad.stderr
