"""The terminal report: a rich summary of one what-if analysis result."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from rich import box
from rich.columns import Columns
from rich.console import Console, Group
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from stragglers.report.summary import (
    DECOMPOSITION_SLOWDOWN,
    STRAGGLING_SLOWDOWN,
    Summary,
    fmt,
    fmt_seconds,
    summarize,
)

# Above this many DP ranks the worker grid shows coloured blocks instead of numbers.
GRID_NUMBERS_MAX_DP = 16
TOP_STEPS = 5


def slowdown_style(value: float | None) -> str:
    """The colour of a slowdown value: green when clean, red when it hurts."""
    if value is None or not math.isfinite(value):
        return "dim"
    if value >= 1.25:
        return "bold red"
    if value >= STRAGGLING_SLOWDOWN:
        return "red"
    if value >= DECOMPOSITION_SLOWDOWN:
        return "yellow"
    return "green"


def print_report(result: Mapping[str, Any], console: Console | None = None) -> None:
    """Print the analysis result as a headline, attribution tables, worker grid and diagnosis."""
    summary = summarize(result)
    console = console or Console()
    console.print(_headline(summary))
    for warning in summary.warnings:
        console.print(Text(f"warning: {warning}", style="yellow"))
    if summary.decomposed:
        console.print(_attribution_tables(summary))
        if summary.worker_grid.size:
            console.print(_worker_grid(summary, console.width))
    else:
        console.print(Text(summary.attribution_note(), style="dim"))
    if summary.step_slowdown:
        console.print(_top_steps(summary))
    console.print(_diagnosis(summary))


def _headline(s: Summary) -> Panel:
    job = s.job
    shape = " × ".join(f"{k} {job[k]}" for k in ("dp", "pp", "tp", "dsp")
                       if job.get(k) is not None and (k != "dsp" or job[k] != 1))
    extent = ", ".join(f"{job[k]:,} {k}" for k in ("steps", "ops")
                       if isinstance(job.get(k), int))
    verdict = (Text(f"STRAGGLING (S ≥ {STRAGGLING_SLOWDOWN})", style="bold red") if s.straggling
               else Text(f"not straggling (S < {STRAGGLING_SLOWDOWN})", style="bold green"))
    lines = Text()
    lines.append(f"{s.job_name}", style="bold")
    if shape:
        lines.append(f"   {shape}")
    if job.get("world_size"):
        lines.append(f"   world size {job['world_size']}")
    if extent:
        lines.append(f"   ({extent})")
    lines.append("\nslowdown S = ")
    lines.append(fmt(s.slowdown), style=slowdown_style(s.slowdown))
    lines.append(f"   waste W = 1 − 1/S = {s.waste:.1%}   ")
    lines.append_text(verdict)
    lines.append(f"\nsim_error {fmt(s.sim_error, '.2%')}")
    if s.sim_error_high:
        lines.append("  (above 5%: the replay does not match this trace well; "
                     "treat the numbers with care)", style="yellow")
    if s.launch_slowdown is not None:
        lines.append(f"   launch-delay slowdown {fmt(s.launch_slowdown)}")
    if any(v is not None for v in s.step_times.values()):
        t = s.step_times
        lines.append(f"\nmean step: measured {fmt_seconds(t['T_base'])}, without launch delays "
                     f"{fmt_seconds(t['T_nodelay'])}, straggler-free {fmt_seconds(t['T_ideal'])}")
    if s.m_w is not None or s.m_s is not None:
        lines.append(f"\nfix-fractions: M_W (top 3% workers) {fmt(s.m_w)}   "
                     f"M_S (last stage) {fmt(s.m_s)}")
    return Panel(lines, title="What-if straggler analysis", title_align="left", box=box.ROUNDED)


def _attribution_tables(s: Summary) -> Group:
    tables = []
    if s.by_optype:
        tables.append(_value_table("By op type", "op type", s.by_optype))
    if s.by_stage:
        tables.append(_value_table("By PP stage", "stage", s.by_stage))
    if s.by_dp_rank:
        ranked = sorted(s.by_dp_rank, key=lambda kv: -kv[1])
        title = "By DP rank" + (" (top 8)" if len(ranked) > 8 else "")
        tables.append(_value_table(title, "dp", ranked[:8]))
    note = Text("S of a group = the slowdown left when only that group keeps its measured "
                "durations and everything else is ideal.", style="dim")
    # Side by side where they fit, else wrapped below each other (never truncated).
    return Group(note, Columns(tables, padding=(0, 4)))


def _value_table(title: str, key_name: str, rows: list[tuple[Any, float]]) -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column(key_name)
    table.add_column("S", justify="right")
    for key, value in rows:
        table.add_row(str(key), Text(fmt(value), style=slowdown_style(value)))
    return table


def _worker_grid(s: Summary, width: int) -> Group:
    title = Text("Worker score S_w = min(S_dp, S_pp)  (rows: PP stage, columns: DP rank)",
                 style="italic")
    hottest = ", ".join(f"dp {d}/pp {p} {v:.3f}" for d, p, v in s.hottest_workers(3))
    footer = Text(f"hottest workers: {hottest}", style="dim")
    if len(s.dp_ranks) <= GRID_NUMBERS_MAX_DP:
        return Group(title, _numeric_grid(s), footer)
    return Group(title, *_block_grid(s, width), footer)


def _numeric_grid(s: Summary) -> Table:
    table = Table(box=box.SIMPLE, pad_edge=False)
    table.add_column("pp \\ dp", justify="right")
    for d in s.dp_ranks:
        table.add_column(str(d), justify="right")
    for r, stage in enumerate(s.stages):
        table.add_row(str(stage), *(Text(fmt(float(v), ".2f", "·"), style=slowdown_style(float(v)))
                                    for v in s.worker_grid[r]))
    return table


def _block_grid(s: Summary, width: int) -> list[Text]:
    """One coloured block per worker, folded into bands of DP ranks that fit the width."""
    band = max(16, width - 12)
    lines = []
    for lo in range(0, len(s.dp_ranks), band):
        ranks = s.dp_ranks[lo:lo + band]
        lines.append(Text(f"  dp {ranks[0]}–{ranks[-1]}", style="dim"))
        for r, stage in enumerate(s.stages):
            line = Text(f"pp {stage:>4}  ")
            for v in s.worker_grid[r, lo:lo + band]:
                v = float(v)
                line.append("█" if math.isfinite(v) else "·", style=slowdown_style(v))
            lines.append(line)
    return lines


def _top_steps(s: Summary) -> Group:
    title = Text(f"Slowest steps (top {min(TOP_STEPS, len(s.step_slowdown))} of "
                 f"{len(s.step_slowdown)})", style="italic")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("step", justify="right")
    table.add_column("S(step)", justify="right")
    for step, value in sorted(s.step_slowdown, key=lambda kv: -kv[1])[:TOP_STEPS]:
        table.add_row(str(step), Text(fmt(value), style=slowdown_style(value)))
    return Group(title, table)


def _diagnosis(s: Summary) -> Panel:
    parts: list[Any] = []
    if not s.diagnosis:
        parts.append(Text("No diagnosis in this result.", style="dim"))
    for i, f in enumerate(s.diagnosis, 1):
        if i > 1:
            parts.append(Text(""))
        parts.append(Text.assemble((f"{i}. {f.title}", "bold"), f" — {f.where}"))
        details = Text()
        if f.speedup_if_fixed is not None:
            details.append("fixing it would make steps ")
            details.append(f"{f.speedup_if_fixed:.2f}× faster", style="bold green")
        if f.evidence:
            details.append(("\n" if details else "") + f"evidence: {f.evidence}")
        if f.advice and f.cause != "none":
            details.append(("\n" if details else "") + f"what to do: {f.advice}", style="cyan")
        if details:
            parts.append(Padding(details, (0, 0, 0, 3)))
    return Panel(Group(*parts), title="Diagnosis (most important first)", title_align="left",
                 box=box.ROUNDED)
