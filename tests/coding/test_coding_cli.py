"""The `stragglers code-info` / `code-decode` commands."""

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from stragglers.cli import app


def invoke(*args):
    return CliRunner().invoke(app, list(args))


def test_code_info_shows_parts_and_guard_verdict():
    out = invoke("coding", "info", "cyclic-mds", "--n", "6", "--s", "3")
    assert out.exit_code == 0, out.output
    assert "0 1 2 3" in out.output and "1, 2, 2, 1" in out.output and "is stable" in out.output
    out = invoke("coding", "info", "cyclic-mds", "--n", "50", "--s", "11")
    assert out.exit_code == 0 and "UNSTABLE" in out.output
    assert "fractional repetition" in out.output


def test_code_decode_prints_spec_vector():
    for cmd in (["coding", "decode"], ["code-decode"]):  # the old name is a deprecated alias
        out = invoke(*cmd, "cyclic-mds", "--n", "6", "--s", "3", "--survivors", "0,2,4")
        assert out.exit_code == 0, out.output
        assert "a = [0.333333, 0, 0.333333, 0, 0.333333, 0]" in out.output


@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_code_2():
    bad = subprocess.run([sys.executable, "-m", "stragglers.cli", "coding", "decode", "cyclic-mds",
                          "--n", "6", "--s", "3", "--survivors", "0,2"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "survivors" in bad.stderr and "Traceback" not in bad.stderr


def test_d_for_a_non_expander_scheme_is_refused():
    bad = subprocess.run([sys.executable, "-m", "stragglers.cli", "coding", "info", "frc",
                          "--n", "6", "--s", "2", "--d", "3"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "'d'" in bad.stderr and "Traceback" not in bad.stderr


def test_old_names_are_hidden_from_help():
    out = invoke("--help")
    assert "coding" in out.output and "code-info" not in out.output


def test_coding_package_is_torch_free_and_registers_its_codes():
    code = ("import sys, stragglers.coding as c; c.make_code('cyclic-mds', 7, 2); "
            "from stragglers.protocols import GRADIENT_CODES; "
            "assert set(c.SCHEMES) <= set(GRADIENT_CODES.names()), GRADIENT_CODES.names(); "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'train_coded' in c.__all__; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
