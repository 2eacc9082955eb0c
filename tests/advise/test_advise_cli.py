"""`stragglers advise RUN` on a written run directory (the command registered on a typer app)."""

from __future__ import annotations

import json

import typer
from typer.testing import CliRunner

from stragglers.advise.commands import register
from stragglers.trace.runformat import write_run
from stragglers.trace.synth import generate


def make_app() -> typer.Typer:
    app = typer.Typer()
    register(app)

    @app.callback()
    def _root() -> None:
        """Test root (keeps `advise` a sub-command)."""

    return app


def test_advise_command_writes_the_ranked_plan(tmp_path):
    run = write_run(tmp_path / "run", generate(dp=4, pp=1, microbatches=2, steps=6, sync="ddp",
                                               seed=0, slow_worker=(3, 0, 2.0)))
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"alpha": 1e-5, "bytes_per_second": 1e9}))
    out = tmp_path / "plan.json"
    res = CliRunner().invoke(make_app(), ["advise", str(run), "--json", str(out), "--calibration",
                                          str(cal), "--remaining-steps", "50"])
    assert res.exit_code == 0, res.output
    assert "Best: antdt-dd" in res.output and "Switch it on" in res.output
    plan = json.loads(out.read_text())
    assert plan["remedies"][0]["name"] == "antdt-dd"


def test_advise_command_names_a_bad_calibration_file(tmp_path):
    run = write_run(tmp_path / "run", generate(dp=2, pp=1, microbatches=2, steps=4, sync="ddp", seed=0))
    cal = tmp_path / "cal.json"
    cal.write_text("{not json")
    res = CliRunner().invoke(make_app(), ["advise", str(run), "--calibration", str(cal)])
    assert res.exit_code != 0
    assert "cal.json" in str(res.exception)


def test_advise_command_refuses_a_restart_cost_no_job_has(tmp_path):
    run = write_run(tmp_path / "run", generate(dp=2, pp=1, microbatches=2, steps=4, sync="ddp", seed=0))
    for value in ("inf", "nan", "-1", "1e8"):
        res = CliRunner().invoke(make_app(), ["advise", str(run), "--restart-cost", value, "-q"])
        assert res.exit_code == 2 and "--restart-cost" in res.output, (value, res.output)
    assert CliRunner().invoke(make_app(), ["advise", str(run), "--restart-cost", "1e7",
                                           "-q"]).exit_code == 0
