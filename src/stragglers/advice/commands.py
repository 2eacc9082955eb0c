"""CLI command of stragglers.advice: `stragglers advise RUN`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from stragglers.advice.config import AdviseConfig
from stragglers.config import with_options
from stragglers.smallfiles import write_report_file


def register(app: typer.Typer) -> None:
    """Add `advise` (an Understand verb, so top level) to the `stragglers` app."""
    app.command("advise", help="Which remedy would buy most on this job: each remedy's predicted "
                "step time and speedup, by replay, ranked.")(advise_command)


@with_options(AdviseConfig)
def advise_command(
    path: Path = typer.Argument(..., help="A run directory, NDTimeline trace or PyTorch-profiler "
                                "trace (as for `stragglers analyze`)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the plan as JSON."),
    calibration: Optional[Path] = typer.Option(
        None, "--calibration", help="JSON {\"alpha\": s, \"beta\": s/byte} of the DP collective's "
        "backend (from `stragglers collectives calibrate`)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No console table."),
    config: AdviseConfig = AdviseConfig(),
) -> None:
    """Which remedy would buy most on this job: each remedy's predicted step time and speedup."""
    # the job's settings (--remaining-steps, --restart-cost, --global-batch, --s, --threshold,
    # --gc-sync-pause-s) are AdviseConfig's, one option each (with_options)
    from stragglers.advice.advisor import advise
    from stragglers.advice.context import load_calibration

    if calibration:
        config = config.replace(link=load_calibration(calibration))
    with Console(stderr=True).status(escape(f"analysing {path} and replaying each remedy …")):
        plan = advise(path, config=config)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        write_report_file(json_out, plan.to_json())
    console = Console()
    if not quiet:
        print_plan(plan, console)
    if json_out:
        console.print(f"JSON: {json_out.resolve()}", markup=False, highlight=False)


def print_plan(plan, console: Console) -> None:
    """The plan as a table of numbers, best first; each remedy's cost or reason below it (whole
    words at any width: long prose in a table column is cut or wraps a word per line), then how
    to switch on the best one. Every text is shown with its control characters as escapes (a
    run's name from meta.json holding ESC[2J cleared the operator's screen)."""
    plan = _printable(plan)
    table = Table(title=Text(f"{plan.job}: measured step {1e3 * plan.measured_step_s:.1f} ms "
                  f"(replay {1e3 * plan.baseline_step_s:.1f} ms)"), title_justify="left")
    for col in ("#", "remedy", "applies", "step (ms)", "speedup", "90% interval"):
        table.add_column(col, no_wrap=True,
                         justify="left" if col in ("remedy", "applies") else "right")
    for i, r in enumerate(plan.remedies, 1):
        step = f"{1e3 * r.predicted_step_s:.1f}" if r.predicted_step_s else "–"
        speed = f"×{r.predicted_speedup:.3f}" if r.predicted_speedup else "–"
        band = f"×{r.interval[0]:.3f}–{r.interval[1]:.3f}" if r.interval else "–"
        table.add_row(str(i), Text(r.name), "yes" if r.applies else "no", step, speed, band)
    console.print(table)
    console.print(reasons_grid(plan))
    best = plan.best()
    if best is None:
        console.print("No remedy applies.", markup=False, highlight=False)
    else:
        console.print(f"Best: {best.name} (×{best.predicted_speedup:.3f}). How: {best.method}.",
                      markup=False, highlight=False)
        console.print(f"Switch it on: {best.switch_on}", markup=False, highlight=False)
    for note in plan.notes:
        console.print(f"note: {note}", markup=False, highlight=False)


def _printable(plan):
    """`plan` with `wording.printable` applied to every text it shows."""
    from dataclasses import replace

    from stragglers.wording import printable

    def text(value: str | None) -> str | None:
        return None if value is None else printable(value)

    return replace(plan, job=printable(plan.job), notes=[printable(n) for n in plan.notes],
                   remedies=[replace(r, name=printable(r.name), why_not=text(r.why_not),
                                     method=printable(r.method), cost=printable(r.cost),
                                     switch_on=printable(r.switch_on))
                             for r in plan.remedies])


def reasons_grid(plan) -> Table:
    """'#  remedy: cost' or 'why not' lines, one per distinct text (remedies that share a reason,
    such as the gradient codes for each s, share a line), wrapped with a hanging indent."""
    grouped: dict[tuple[bool, str], list[tuple[int, str]]] = {}
    for i, r in enumerate(plan.remedies, 1):
        text = r.cost if r.applies else (r.why_not or "")
        if text:
            grouped.setdefault((r.applies, text), []).append((i, r.name))
    grid = Table.grid(padding=(0, 1))
    grid.add_column(justify="right", no_wrap=True)
    grid.add_column()
    for (applies, text), rows in grouped.items():
        numbers = ", ".join(str(i) for i, _ in rows)
        names = ", ".join(name for _, name in rows)
        grid.add_row(numbers, Text(f"{names} — {'cost' if applies else 'why not'}: {text}"))
    return grid
