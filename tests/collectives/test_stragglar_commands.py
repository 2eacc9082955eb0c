"""The collectives CLI commands: schedule, model and calibration (real torchrun)."""

import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from stragglers.collectives.commands import calibrate_collectives, register
from stragglers.errors import EnvironmentFailure, InputError

app = typer.Typer()
register(app)
runner = CliRunner()


def test_schedule_command_prints_and_verifies():
    result = runner.invoke(app, ["collectives", "schedule", "--n", "8"])
    assert result.exit_code == 0, result.output
    assert "R8:" in result.output and "9 rounds (lower bound 9)" in result.output
    assert "verifier: OK" in result.output


def test_old_name_is_a_hidden_deprecated_alias_with_options():
    result = runner.invoke(app, ["stragglar-schedule", "--n", "8", "--no-show"])
    assert result.exit_code == 0 and "9 rounds" in result.output
    assert "stragglar-schedule" not in runner.invoke(app, ["--help"]).output


@pytest.mark.slow
def test_schedule_command_odd_n_explains_itself():
    result = runner.invoke(app, ["collectives", "schedule", "--n", "7", "--no-show"])
    assert result.exit_code == 0 and "odd n" in result.output


@pytest.mark.slow
def test_bad_n_is_an_input_error_and_exit_code_2():
    result = runner.invoke(app, ["collectives", "schedule", "--n", "1"])
    assert isinstance(result.exception, InputError)
    proc = subprocess.run([sys.executable, "-c", "from stragglers.cli import main; main()",
                           "collectives", "schedule", "--n", "1"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--n" in proc.stderr and "Traceback" not in proc.stderr


def test_a_schedule_past_the_largest_is_refused_before_it_is_built():
    # ~n²/2 transfers: 100,000 ranks would be 5e9 of them (it ran past a minute, printing nothing)
    result = runner.invoke(app, ["collectives", "schedule", "--n", "100000", "--no-show"])
    assert isinstance(result.exception, InputError) and "at most 512" in str(result.exception)
    # another n than a power of two is searched greedily, ~n³: 4,095 ranks was ~20 min of CPU,
    # and 4,096's schedule 8.4 M transfers (2.2 GB): both refused before anything is built
    for n in ("4095", "513", "2048"):
        result = runner.invoke(app, ["collectives", "schedule", "--n", n, "--no-show"])
        assert isinstance(result.exception, InputError), (n, result.output)


def test_model_command_table():
    result = runner.invoke(app, ["collectives", "model", "--n", "8", "--delay-ms", "5"])
    assert result.exit_code == 0, result.output
    assert "stragglar" in result.output and "1.133x" in result.output


@pytest.mark.parametrize("args,field", [
    (["--n", "100000000"], "--n"),      # its StragglAR time needs a schedule that big: it hung
    (["--n", "1"], "--n"), (["--size-mb", "inf"], "--size-mb"), (["--size-mb", "nan"], "--size-mb"),
    (["--delay-ms", "inf"], "--delay-ms"), (["--alpha-us", "-1"], "--alpha-us"),
    (["--bandwidth-gibs", "0"], "--bandwidth-gibs")])
def test_model_bad_values_are_input_errors(args, field):
    result = runner.invoke(app, ["collectives", "model", *(["--n", "8"] if args[0] != "--n" else []),
                                 *args])
    assert isinstance(result.exception, InputError), result.output
    assert result.exception.field == field


def test_model_infinite_bandwidth_is_a_model():
    # what calibrate suggests when it measures no per-byte cost
    result = runner.invoke(app, ["collectives", "model", "--n", "8", "--bandwidth-gibs", "inf"])
    assert result.exit_code == 0, result.output


def test_calibrate_worker_failure_is_an_environment_failure(monkeypatch):
    # a good input whose workers die is not the user's input error (exit 3, not 2)
    import stragglers.collectives.commands as commands

    monkeypatch.setattr(commands.sys, "executable", "/bin/false")
    with pytest.raises(EnvironmentFailure, match="torchrun"):
        calibrate_collectives(nproc=2, max_size_mb=0.25)


@pytest.mark.distributed
def test_calibrate_collectives_measures_alpha_beta():
    result = runner.invoke(app, ["collectives", "calibrate", "--nproc", "2", "--max-size-mb", "0.25"])
    assert result.exit_code == 0, result.output
    assert "alpha =" in result.output and "--alpha-us" in result.output
