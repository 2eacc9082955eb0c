"""CLI commands of stragglers.whatif: `stragglers analyze`."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

log = logging.getLogger(__name__)

# Exit status of `analyze --fail-on-straggling` when the job is straggling (bad input is 2).
EXIT_STRAGGLING = 1


def register(app: typer.Typer) -> None:
    """Add this capability's commands to the `stragglers` app."""
    app.command("analyze", help="How much faster would this job be without stragglers, and who "
                "or what is to blame.")(analyze_command)
    app.command("schema", help="Print the JSON Schema of `stragglers analyze --json` (generated "
                "from the result types; docs/result.schema.json).")(schema_command)


def schema_command() -> None:
    """Print the JSON Schema of the analysis result, generated from its types."""
    import json

    from stragglers.whatif.result import json_schema

    typer.echo(json.dumps(json_schema(), indent=2, ensure_ascii=False))


def analyze_command(
    path: Path = typer.Argument(..., help="A run directory (meta.json + Parquet), an NDTimeline "
                                "trace-<name>.parquet (its meta-<name>.yaml is found beside it), "
                                "or PyTorch-profiler .json(.gz) files (one file or a folder)."),
    meta: Optional[Path] = typer.Option(None, "--meta", help="NDTimeline metadata YAML."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the full result as JSON "
                                            "(strict JSON, with schema_version)."),
    html_out: Optional[Path] = typer.Option(None, "--html", help="Write a self-contained HTML report."),
    perfetto: Optional[Path] = typer.Option(None, "--perfetto", help="Write measured and ideal "
                                            "timelines (Chrome-trace JSON) into this directory."),
    steps: Optional[str] = typer.Option(None, "--steps", help="Only these steps, e.g. '12,20-23'; "
                                        "'all' keeps every step, warm-up included."),
    dp_size: Optional[int] = typer.Option(None, "--dp-size", help="PyTorch-profiler traces: "
                                          "DP size (ranks are placed in Megatron order)."),
    pp_size: Optional[int] = typer.Option(None, "--pp-size", help="PyTorch-profiler traces: "
                                          "PP size."),
    tp_size: Optional[int] = typer.Option(None, "--tp-size", help="PyTorch-profiler traces: "
                                          "tensor-parallel size (each TP rank a worker)."),
    fail_on_straggling: bool = typer.Option(
        False, "--fail-on-straggling", help=f"Exit with status {EXIT_STRAGGLING} when the job is "
        "straggling (S ≥ the threshold), after writing every report: for CI."),
    fail_threshold: Optional[float] = typer.Option(
        None, "--fail-threshold", min=1.0, help="The S at which --fail-on-straggling fails "
        "(default: the straggling threshold, 1.1)."),
    settings: Optional[list[str]] = typer.Option(
        None, "--set", metavar="NAME=VALUE", help="A diagnosis setting (DiagnosisConfig, "
        "documented in src/stragglers/whatif/README.md), e.g. --set worker_min_excess=0.2; "
        "repeatable."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No console report."),
    dask: Optional[str] = typer.Option(None, "--dask", metavar="ADDRESS", help="Run directories: "
                                       "read and replay the steps in partitions on the Dask "
                                       "scheduler at ADDRESS (tcp://host:8786; the workers must "
                                       "see PATH). Same results as one process."),
    workers: Optional[int] = typer.Option(None, "--workers", help="Like --dask, on a local Dask "
                                          "cluster of this many worker processes."),
) -> None:
    """How much faster would this job be without stragglers, and who or what is to blame.

    Exit status: 0 when the analysis ran; 2 for bad input (a one-line error naming the file and
    field); with --fail-on-straggling, 1 when S ≥ the threshold.
    """
    from stragglers.report import print_report, write_html, write_perfetto
    from stragglers.smallfiles import write_report_file
    from stragglers.whatif._analyze import analyze_with_model, timelines

    from stragglers.config import cli_overrides
    from stragglers.whatif.config import DiagnosisConfig

    console = Console()
    selection = _steps_option(steps)
    config = cli_overrides(DiagnosisConfig, settings, "--set")
    err = Console(stderr=True)

    def progress(msg: str) -> None:
        """The bar on a terminal; the -v log either way (each stage of the analysis)."""
        bar.update(task, description=msg)
        log.info("%s", msg)

    # descriptions carry file names: plain text, not rich markup; no bar (and none of the
    # blank line it leaves behind) where stderr is no terminal
    with Progress(SpinnerColumn(), TextColumn("{task.description}", markup=False),
                  TimeElapsedColumn(), console=err, transient=True,
                  disable=not err.is_terminal) as bar:
        task = bar.add_task(f"reading {path}")
        if dask is not None or workers is not None:
            result, w = _on_dask(path, dask, workers, (meta, dp_size, pp_size, tp_size, perfetto),
                                 progress, config, selection)
        elif _streams(path, (meta, dp_size, pp_size, tp_size, perfetto)):
            from stragglers.whatif.partitioned import analyze_run

            log.info("analysing %s by step partitions", path)
            result, w = analyze_run(path, progress=progress, config=config, **selection)
        else:
            trace = _read(path, meta, dp_size, pp_size, tp_size)
            result, w = analyze_with_model(trace, progress=progress, config=config, **selection)
        if json_out:
            bar.update(task, description=f"writing {json_out}")
            json_out.parent.mkdir(parents=True, exist_ok=True)
            write_report_file(json_out, result.to_json())
        if html_out:
            bar.update(task, description=f"writing {html_out}")
            write_html(result, html_out)
        if perfetto:
            bar.update(task, description=f"writing timelines into {perfetto}")
            rows, lines = timelines(w, trace)
            write_perfetto(perfetto, rows, lines, result)
    if not quiet:
        print_report(result, console)
    for label, out in (("JSON", json_out), ("HTML report", html_out), ("Perfetto timelines", perfetto)):
        if out:
            console.print(f"{label}: {out.resolve()}", markup=False, highlight=False)
    threshold = result.straggling_threshold if fail_threshold is None else fail_threshold
    if fail_on_straggling and result.slowdown >= threshold:
        Console(stderr=True).print(f"straggling: S = {result.slowdown:.3f} ≥ {threshold} "
                                   f"(--fail-on-straggling): exit {EXIT_STRAGGLING}")
        # SystemExit, not typer.Exit: the CLI runs click with standalone_mode=False, which turns
        # typer.Exit into a return value and would lose the status.
        sys.exit(EXIT_STRAGGLING)


def _read(path: Path, meta, dp_size, pp_size, tp_size):
    """The whole trace, in this process."""
    from stragglers.trace.load import load_trace

    log.info("reading %s", path)
    trace = load_trace(path, meta, dp_size=dp_size, pp_size=pp_size, tp_size=tp_size)
    log.info("read %s ops of %s rank(s)", f"{len(trace):,}",
             len(trace.meta.extra.get("ranks_read") or []) or "all")
    return trace


def _streams(path: Path, whole_trace_options) -> bool:
    """Whether the analysis reads the run by step partitions (a run directory, and no option
    that needs the whole trace in one process): its memory is then the grid's, not the trace's."""
    from stragglers.trace.runformat import META_FILE

    return path.is_dir() and (path / META_FILE).is_file() and \
        all(v is None for v in whole_trace_options)


def _on_dask(path: Path, address, workers, single_process_only, progress, config, selection):
    """The analysis of a run directory by step partitions on Dask (whatif/dask_runner.py)."""
    from stragglers.errors import InputError
    from stragglers.whatif.dask_runner import analyze_run_on_dask

    flag = "--dask" if address is not None else "--workers"
    for name, value in zip(("--meta", "--dp-size", "--pp-size", "--tp-size", "--perfetto"),
                           single_process_only):
        if value is not None:
            raise InputError(flag, None, f"analyses a run directory by step partitions; {name} "
                             "needs the whole trace in one process (leave it out, or drop "
                             f"{flag})")
    log.info("analysing %s on Dask (%s)", path,
             address if address is not None else f"{workers} local workers")
    return analyze_run_on_dask(path, address=address, workers=workers, progress=progress,
                               config=config, **selection)


def _steps_option(spec: Optional[str]) -> dict:
    """analyze() keywords for --steps: a list of steps, or every step (warm-up included)."""
    from stragglers.trace.load import parse_steps

    if spec is not None and spec.strip().lower() == "all":
        return {"steps": "all"}
    return {"steps": parse_steps(spec)}
