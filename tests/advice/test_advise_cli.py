"""`stragglers advise RUN` on a written run directory (the command registered on a typer app)."""

from __future__ import annotations

import json

import typer
from typer.testing import CliRunner

from stragglers.advice.commands import register
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


def test_advise_reads_whole_at_80_columns(tmp_path):
    # a pipelined job: every remedy but one does not apply, each with a sentence saying why
    run = write_run(tmp_path / "run", generate(dp=4, pp=4, microbatches=8, steps=10, seed=0,
                                               slow_worker=(1, 2, 1.5)))
    out = tmp_path / "plan.json"
    res = CliRunner().invoke(make_app(), ["advise", str(run), "--json", str(out)],
                             env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    assert "…" not in res.output                       # no word cut short
    assert len(lines) < 45, res.output                 # was ~80 (reasons wrapped in a column)
    plan = json.loads(out.read_text())
    table = [line for line in lines if line.startswith("│")]
    for i, remedy in enumerate(plan["remedies"], 1):
        # every remedy's full name once in the table, and its reason or cost below it
        assert sum(f" {remedy['name']} " in row for row in table) == 1, remedy["name"]
        reason = remedy["cost"] if remedy["applies"] else remedy["why_not"]
        assert " ".join(reason.split()[:3]) in " ".join(res.output.split()), remedy["name"]
