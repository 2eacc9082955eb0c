"""CLI command of stragglers.advise: `stragglers advise RUN`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text


def register(app: typer.Typer) -> None:
    """Add `advise` (an Understand verb, so top level) to the `stragglers` app."""
    app.command("advise", help="Which remedy would buy most on this job: each remedy's predicted "
                "step time and speedup, by replay, ranked.")(advise_command)


def advise_command(
    path: Path = typer.Argument(..., help="A run directory, NDTimeline trace or PyTorch-profiler "
                                "trace (as for `stragglers analyze`)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the plan as JSON."),
    calibration: Optional[Path] = typer.Option(
        None, "--calibration", help="JSON {\"alpha\": s, \"beta\": s/byte} of the DP collective's "
        "backend (from `stragglers calibrate-collectives`)."),
    remaining_steps: Optional[int] = typer.Option(None, "--remaining-steps", min=0,
                                                  help="Steps the job still runs (prices ND)."),
    restart_cost: Optional[float] = typer.Option(None, "--restart-cost", min=0.0, max=1e7,
                                                 help="Seconds one restart costs (ND; at most "
                                                 "1e7, the adapt service's bound)."),
    # (1e7 is advise.context.MAX_KNOB_SECONDS, written out: this module is imported when the
    # CLI starts and the context module pulls in the what-if engine)
    global_batch: Optional[int] = typer.Option(None, "--global-batch", min=1,
                                               help="Samples per global step (DD's split)."),
    max_s: int = typer.Option(2, "--s", min=1, max=16, help="Price gradient codes s = 1 .. this."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No console table."),
) -> None:
    """Which remedy would buy most on this job: each remedy's predicted step time and speedup."""
    from stragglers.advise.advisor import advise
    from stragglers.advise.context import load_calibration

    link = load_calibration(calibration) if calibration else None
    with Console(stderr=True).status(escape(f"analysing {path} and replaying each remedy …")):
        plan = advise(path, link=link, remaining_steps=remaining_steps,
                      restart_cost_s=restart_cost, global_batch=global_batch, max_s=max_s)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(plan.to_json())
    console = Console()
    if not quiet:
        print_plan(plan, console)
    if json_out:
        console.print(f"JSON: {json_out.resolve()}", markup=False, highlight=False)


def print_plan(plan, console: Console) -> None:
    """The plan as a table, best first, then how to switch on the best one."""
    table = Table(title=Text(f"{plan.job}: measured step {1e3 * plan.measured_step_s:.1f} ms "
                  f"(replay {1e3 * plan.baseline_step_s:.1f} ms)"))
    for col in ("#", "remedy", "applies", "step (ms)", "speedup", "90% interval", "why not / cost"):
        table.add_column(col, justify="left" if col in ("remedy", "applies", "why not / cost")
                         else "right")
    for i, r in enumerate(plan.remedies, 1):
        step = f"{1e3 * r.predicted_step_s:.1f}" if r.predicted_step_s else "–"
        speed = f"×{r.predicted_speedup:.3f}" if r.predicted_speedup else "–"
        band = f"×{r.interval[0]:.3f}–{r.interval[1]:.3f}" if r.interval else "–"
        table.add_row(str(i), Text(r.name), "yes" if r.applies else "no", step, speed, band,
                      Text(r.cost if r.applies else (r.why_not or "")))
    console.print(table)
    best = plan.best()
    if best is None:
        console.print("No remedy applies.", markup=False, highlight=False)
    else:
        console.print(f"Best: {best.name} (×{best.predicted_speedup:.3f}). How: {best.method}.",
                      markup=False, highlight=False)
        console.print(f"Switch it on: {best.switch_on}", markup=False, highlight=False)
    for note in plan.notes:
        console.print(f"note: {note}", markup=False, highlight=False)
