"""CLI commands of stragglers.whatif: `stragglers analyze`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


def register(app: typer.Typer) -> None:
    """Add this capability's commands to the `stragglers` app."""
    app.command("analyze")(analyze_command)


def analyze_command(
    path: Path = typer.Argument(..., help="A run directory (meta.json + Parquet), an NDTimeline "
                                "trace-<name>.parquet (its meta-<name>.yaml is found beside it), "
                                "or PyTorch-profiler .json(.gz) files (one file or a folder)."),
    meta: Optional[Path] = typer.Option(None, "--meta", help="NDTimeline metadata YAML."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the full result as JSON."),
    html_out: Optional[Path] = typer.Option(None, "--html", help="Write a self-contained HTML report."),
    perfetto: Optional[Path] = typer.Option(None, "--perfetto", help="Write measured and ideal "
                                            "timelines (Chrome-trace JSON) into this directory."),
    steps: Optional[str] = typer.Option(None, "--steps", help="Only these steps, e.g. '12,20-23'."),
    dp_size: Optional[int] = typer.Option(None, "--dp-size", help="PyTorch-profiler traces: "
                                          "DP size (ranks are placed in Megatron order)."),
    pp_size: Optional[int] = typer.Option(None, "--pp-size", help="PyTorch-profiler traces: "
                                          "PP size."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No console report."),
) -> None:
    """How much faster would this job be without stragglers, and who or what is to blame."""
    from stragglers.report import print_report, write_html, write_perfetto
    from stragglers.trace.load import load_trace, parse_steps
    from stragglers.whatif.analyze import analyze_with_model, timelines

    console = Console()
    step_list = parse_steps(steps)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(f"reading {path}")
        trace = load_trace(path, meta, dp_size=dp_size, pp_size=pp_size)
        result, w = analyze_with_model(
            trace, step_list, progress=lambda msg: bar.update(task, description=msg))
        if json_out:
            bar.update(task, description=f"writing {json_out}")
            json_out.parent.mkdir(parents=True, exist_ok=True)
            json_out.write_text(json.dumps(result, indent=2))
        if html_out:
            bar.update(task, description=f"writing {html_out}")
            write_html(result, html_out)
        if perfetto:
            bar.update(task, description=f"writing timelines into {perfetto}")
            rows, lines = timelines(w, trace)
            write_perfetto(perfetto, rows, lines)
    if not quiet:
        print_report(result, console)
    for label, out in (("JSON", json_out), ("HTML report", html_out), ("Perfetto timelines", perfetto)):
        if out:
            console.print(f"{label}: {out.resolve()}")
