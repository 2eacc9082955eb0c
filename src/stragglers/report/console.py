"""The terminal report: a rich summary of one what-if analysis result."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from rich import box
from rich.columns import Columns
from rich.console import Console, Group, RenderableType
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from stragglers.report.summary import (
    LAUNCH_DELAY_MEANING,
    WorkerGrid,
    advice_of,
    after_others_words,
    as_result,
    attribution_note,
    combined_words,
    coverage_words,
    describe_where,
    fix_fraction_words,
    fmt,
    fmt_seconds,
    notes_by_kind,
    prediction_words,
    shape_words,
    share_words,
    title_of,
)
from stragglers.whatif.config import DECOMPOSE_SLOWDOWN, STRAGGLING_SLOWDOWN
from stragglers.whatif.result import AnalysisResult, WorkerRef
from stragglers.wording import printable_all

# Above this many DP ranks the worker grid shows coloured blocks instead of numbers.
GRID_NUMBERS_MAX_DP = 16
TOP_STEPS = 5


def slowdown_style(value: float | None, straggling: float = STRAGGLING_SLOWDOWN) -> str:
    """The colour of a slowdown value: green when clean, red when it hurts."""
    if value is None or not math.isfinite(value):
        return "dim"
    if value >= 1.25:
        return "bold red"
    if value >= straggling:
        return "red"
    if value >= DECOMPOSE_SLOWDOWN:
        return "yellow"
    return "green"


def print_report(result: AnalysisResult | Mapping[str, Any], console: Console | None = None) -> None:
    """Print the analysis result as a headline, attribution tables, worker grid and diagnosis."""
    # every string a trace file carried (names, hosts, op types, evidence quoting them) with its
    # control characters written as escapes: printed raw, they reach the operator's terminal
    r = as_result(printable_all(as_result(result).to_dict()))
    console = console or Console()
    console.print(_headline(r))
    notes = _notes(r)
    if notes is not None:
        console.print(notes)
    for warning in r.warnings:   # (one line each, as errors are: a pipe at 80 columns cut
        # a warning onto five lines, so a grep for it missed)
        console.print(Text(f"warning: {warning}", style="yellow"), soft_wrap=True)
    if r.decomposed:
        console.print(_attribution_tables(r))
        grid = WorkerGrid.of(r)
        if grid.values.size:
            console.print(_worker_grid(grid, console.width))
    else:
        console.print(Text(attribution_note(r), style="dim"))
    if r.step_slowdown:
        console.print(_top_steps(r))
    console.print(_diagnosis(r))


def _headline(r: AnalysisResult) -> Panel:
    job = r.job
    shape = shape_words(r)
    extent = ", ".join(f"{getattr(job, k):,} {k} analysed" for k in ("steps", "ops")
                       if isinstance(getattr(job, k), int))
    t = r.straggling_threshold
    verdict = (Text("PARTIAL TRACE: no job-wide verdict (straggling unknown)",
                    style="bold yellow") if r.straggling is None
               else Text(f"STRAGGLING (S ≥ {t})", style="bold red") if r.straggling
               else Text(f"not straggling (S ≥ {t}, but within the noise floor)",
                         style="bold green") if r.slowdown >= t
               else Text(f"not straggling (S < {t})", style="bold green"))
    lines = Text()
    lines.append(f"{job.name}", style="bold")
    if shape:
        lines.append(f"   {shape}")
    if job.world_size:
        lines.append(f"   world size {job.world_size}")
    if extent:
        lines.append(f"   ({extent})")
    coverage = coverage_words(r)
    if coverage:
        lines.append(f"\n{coverage}", style="yellow" if job.missing_workers else "")
    lines.append("\nslowdown S = ")
    lines.append(fmt(r.slowdown), style=slowdown_style(r.slowdown, t))
    lines.append(f"   waste W = 1 − 1/S = {fmt(r.waste, '.1%')}   ")
    lines.append_text(verdict)
    lines.append(f"\nsim_error {fmt(r.sim_error, '.2%')}")
    if r.sim_error_high:
        lines.append("  (above 5%: the replay does not match this trace well; "
                     "treat the numbers with care)", style="yellow")
    if r.launch_slowdown is not None:
        lines.append(f"   launch-delay slowdown {fmt(r.launch_slowdown)}")
    if any(v is not None for v in (r.t_base, r.t_nodelay, r.t_ideal)):
        lines.append(f"\nmean step: measured {fmt_seconds(r.t_base)}, without launch delays "
                     f"{fmt_seconds(r.t_nodelay)}, straggler-free {fmt_seconds(r.t_ideal)}")
    if r.m_w is not None or r.m_s is not None:
        lines.append(f"\nfix-fractions: M_W (top 3% workers) {fmt(r.m_w)}   "
                     f"M_S (last stage) {fmt(r.m_s)}")
        for why in (fix_fraction_words("M_W", r.m_w, "the top workers"),
                    fix_fraction_words("M_S", r.m_s, "the last stage")):
            if why:
                lines.append(f"\n  {why}", style="dim")
    if r.launch_slowdown is not None:
        lines.append(f"\nlaunch-delay slowdown = {LAUNCH_DELAY_MEANING}", style="dim")
    return Panel(lines, title="What-if straggler analysis", title_align="left", box=box.ROUNDED)


def _notes(r: AnalysisResult) -> Panel | None:
    notes = notes_by_kind(r)
    if not notes:
        return None
    body = Text()
    for i, (title, message) in enumerate(notes):
        body.append(("\n" if i else "") + f"{title}: ", style="bold")
        body.append(message)
    return Panel(body, title="What the trace does not show (reader notes)", title_align="left",
                 box=box.ROUNDED, border_style="yellow")


def _attribution_tables(r: AnalysisResult) -> Group:
    tables = []
    t = r.straggling_threshold
    if r.by_optype:
        ranked: list[tuple[str | int, float]] = sorted(r.by_optype.items(), key=lambda kv: -kv[1])
        tables.append(_value_table("By op type", "op type", ranked, t))
    if r.by_stage:
        tables.append(_value_table("By PP stage", "stage", sorted(r.by_stage.items()), t))
    if r.by_dp_rank:
        ranked = sorted(r.by_dp_rank.items(), key=lambda kv: -kv[1])
        title = "By DP rank" + (" (top 8)" if len(ranked) > 8 else "")
        tables.append(_value_table(title, "dp", ranked[:8], t))
    note = Text("S of a group = the slowdown left when only that group keeps its measured "
                "durations and everything else is ideal.", style="dim")
    # Side by side where they fit, else wrapped below each other (never truncated).
    return Group(note, Columns(tables, padding=(0, 4)))


def _value_table(title: str, key_name: str, rows: Sequence[tuple[str | int, float]],
                 t: float) -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column(key_name)
    table.add_column("S", justify="right")
    for key, value in rows:
        table.add_row(str(key), Text(fmt(value), style=slowdown_style(value, t)))
    return table


def _worker_grid(grid: WorkerGrid, width: int) -> Group:
    title = Text("Worker score S_w = min(S_dp, S_pp)  (rows: PP stage, columns: DP rank)",
                 style="italic")
    hottest = ", ".join(f"dp {d}/pp {p} {v:.3f}" for d, p, v in grid.hottest(3))
    footer = Text(f"hottest workers: {hottest}", style="dim")
    if len(grid.dp_ranks) <= GRID_NUMBERS_MAX_DP:
        return Group(title, _numeric_grid(grid), footer)
    return Group(title, *_block_grid(grid, width), footer)


def _numeric_grid(grid: WorkerGrid) -> Table:
    table = Table(box=box.SIMPLE, pad_edge=False)
    table.add_column("pp \\ dp", justify="right")
    for d in grid.dp_ranks:
        table.add_column(str(d), justify="right")
    for r, stage in enumerate(grid.stages):
        table.add_row(str(stage), *(Text(fmt(float(v), ".2f", "·"), style=slowdown_style(float(v)))
                                    for v in grid.values[r]))
    return table


def _block_grid(grid: WorkerGrid, width: int) -> list[Text]:
    """One coloured block per worker, folded into bands of DP ranks that fit the width."""
    band = max(16, width - 12)
    lines = []
    for lo in range(0, len(grid.dp_ranks), band):
        ranks = grid.dp_ranks[lo:lo + band]
        lines.append(Text(f"  dp {ranks[0]}–{ranks[-1]}", style="dim"))
        for r, stage in enumerate(grid.stages):
            line = Text(f"pp {stage:>4}  ")
            for v in grid.values[r, lo:lo + band]:
                v = float(v)
                line.append("█" if math.isfinite(v) else "·", style=slowdown_style(v))
            lines.append(line)
    return lines


def _top_steps(r: AnalysisResult) -> Group:
    steps = r.step_slowdown
    title = Text(f"Slowest steps (top {min(TOP_STEPS, len(steps))} of {len(steps)})",
                 style="italic")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("step", justify="right")
    table.add_column("S(step)", justify="right")
    culprits = {s.step: s for s in r.slowest_steps}
    if culprits:
        table.add_column("computed longest (× its stage's median worker)")
    for step, value in sorted(steps.items(), key=lambda kv: -kv[1])[:TOP_STEPS]:
        row: list[str | Text] = [str(step), Text(fmt(value), style=slowdown_style(
            value, r.straggling_threshold))]
        if culprits:
            c = culprits.get(step)
            row.append(_worker_words(c.worker) + f" {c.ratio:.2f}×"
                       if c is not None and c.worker is not None and c.ratio is not None else "-")
        table.add_row(*row)
    return Group(title, table)


def _worker_words(ref: WorkerRef) -> str:
    """'dp 6 / pp 0 (rank 6 on host)' for a WorkerRef."""
    rank = f"rank {ref.rank}" if ref.rank is not None else ""
    host = f" on {ref.host}" if ref.host else ""
    return f"dp {ref.dp} / pp {ref.pp}" + (f" ({rank}{host})" if rank or host else "")


def _diagnosis(r: AnalysisResult) -> Panel:
    parts: list[RenderableType] = []
    if not r.diagnosis:
        parts.append(Text("No diagnosis in this result.", style="dim"))
    for i, f in enumerate(r.diagnosis, 1):
        if i > 1:
            parts.append(Text(""))
        parts.append(Text.assemble((f"{i}. {title_of(f)}", "bold"), f" — {describe_where(f.where)}"))
        details = Text()
        prediction = prediction_words(f)
        if prediction:
            details.append("fixing it would make steps ")
            details.append(prediction, style="bold green")
        for extra in (share_words(f.share), after_others_words(f)):
            if extra:
                details.append(("\n" if details else "") + extra)
        if f.evidence:
            details.append(("\n" if details else "") + f"evidence: {f.evidence}")
        advice = advice_of(f)
        if advice:
            details.append(("\n" if details else "") + f"what to do: {advice}", style="cyan")
        if details:
            parts.append(Padding(details, (0, 0, 0, 3)))
    combined = combined_words(r)
    if combined:
        parts += [Text(""), Text(combined[0], style="bold"),
                  Padding(Text("\n".join(combined[1:])), (0, 0, 0, 3))]
    return Panel(Group(*parts), title="Diagnosis (most important first)", title_align="left",
                 box=box.ROUNDED)
