"""The HTML report: one self-contained page (plotly.js inline) that opens offline."""

from __future__ import annotations

import html
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from stragglers.report.summary import (
    HEATMAP_RANGE,
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
from stragglers.smallfiles import write_report_file
from stragglers.whatif.result import AnalysisResult

# Cells get their value written in them up to this many DP ranks × stages.
HEATMAP_TEXT_MAX_CELLS = 256

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto;
       max-width: 1100px; padding: 0 1rem; color: #222; line-height: 1.45; }
h1 { font-size: 1.6rem; margin-bottom: .2rem; } h2 { font-size: 1.2rem; margin-top: 2rem; }
.job { color: #555; margin-top: 0; }
.cards { display: flex; flex-wrap: wrap; gap: .8rem; margin: 1rem 0; }
.card { border: 1px solid #ddd; border-radius: 8px; padding: .6rem 1rem; min-width: 9rem; }
.card .value { font-size: 1.5rem; font-weight: 600; } .card .label { color: #666; font-size: .85rem; }
.bad { color: #c0392b; } .good { color: #1e8449; } .warn { color: #b9770e; }
.explain { color: #444; font-size: .95rem; background: #f7f7f7; padding: .6rem 1rem;
           border-radius: 6px; }
#diagnosis li { margin-bottom: .8rem; } .evidence { color: #444; } .advice { color: #1a5276; }
.note { color: #666; font-style: italic; }
"""


def write_html(result: AnalysisResult | Mapping[str, Any], path: str | Path) -> Path:
    """Write the analysis result as one self-contained HTML page; returns the path written."""
    page = render_html(result)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_report_file(path, page)
    return path


class _Plots(NamedTuple):
    """The page's four figures (or their HTML divs); None where the result has no data for one."""

    heatmap: Any
    steps: Any
    optypes: Any
    stages: Any


def render_html(result: AnalysisResult | Mapping[str, Any]) -> str:
    """The HTML page of an analysis result as a string (plotly.js embedded, no network)."""
    r = as_result(result)
    grid = WorkerGrid.of(r)
    by_optype = sorted(r.by_optype.items(), key=lambda kv: -kv[1])
    by_stage = sorted(r.by_stage.items())
    figures = _Plots(
        heatmap=_heatmap_figure(grid),
        steps=_steps_figure(r),
        optypes=_bar_figure([k for k, _ in by_optype], [v for _, v in by_optype],
                            "op type restored to measured", r.slowdown),
        stages=_bar_figure([f"stage {k}" for k, _ in by_stage], [v for _, v in by_stage],
                           "PP stage restored to measured", r.slowdown),
    )
    plots = _Plots(*(_figure_div(fig, f"{name}-plot") if fig is not None else None
                     for name, fig in zip(_Plots._fields, figures)))
    head_script = ""
    if any(p is not None for p in plots):
        from plotly.offline import get_plotlyjs

        # The whole plotly.js inline (what include_plotlyjs=True embeds), once for all figures.
        head_script = ("<script>window.PlotlyConfig = {MathJaxConfig: 'local'};</script>\n"
                       f"<script>{get_plotlyjs()}</script>")
    name = r.job.name
    title = f"Straggler report — {name}"
    skipped = f'<p class="note">{_e(attribution_note(r))}</p>'
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_e(title)}</title>",
        f"<style>{_CSS}</style>",
        head_script,
        "</head><body>",
        f"<h1>What-if straggler analysis: {_e(name)}</h1>",
        f'<p class="job">{_e(_job_line(r))}</p>',
        _coverage(r),
        _headline(r),
        _explanation(r),
        _notes(r),
        _warnings(r),
        _diagnosis(r),
        _section("heatmap", "Worker scores S<sub>w</sub> (DP rank × PP stage)",
                 "One hot cell: a faulty worker. A hot last row: stage imbalance. "
                 "Random scattered cells: sequence-length imbalance. "
                 f"Colour scale fixed at {HEATMAP_RANGE[0]}–{HEATMAP_RANGE[1]}.",
                 plots.heatmap or skipped),
        _section("steps", "Slowdown per step",
                 "S(step) = step time without launch delays / straggler-free step time. "
                 "A flat line means the slowdown is persistent; spikes are one-off events.",
                 plots.steps or '<p class="note">No per-step slowdown in this result.</p>'),
        _section("optypes", "Attribution by op type",
                 "S if only this op type kept its measured durations and everything else were "
                 "ideal. The dashed line is the job's S.",
                 plots.optypes or skipped),
        _section("stages", "Attribution by pipeline stage",
                 "S if only this stage kept its measured durations.",
                 plots.stages or skipped),
        '<p class="note">Method: Lin et al., "Understanding Stragglers in Large Model Training '
        'Using What-if Analysis", OSDI 2025. Generated by stragglers.</p>',
        "</body></html>",
    ])


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _job_line(r: AnalysisResult) -> str:
    job = r.job
    parts = [shape_words(r, " · ", upper=True)] if shape_words(r) else []
    if job.world_size:
        parts.append(f"world size {job.world_size}")
    for k in ("steps", "ops"):
        v = getattr(job, k)
        if isinstance(v, int):
            parts.append(f"{v:,} {k} analysed")
    return " · ".join(parts)


def _coverage(r: AnalysisResult) -> str:
    words = coverage_words(r)
    if not words:
        return ""
    css = "warn" if r.job.missing_workers else "job"
    return f'<p id="coverage" class="{css}">{_e(words)}</p>'


def _card(value: str, label: str, css: str = "") -> str:
    return (f'<div class="card"><div class="value {css}">{_e(value)}</div>'
            f'<div class="label">{label}</div></div>')


def _headline(r: AnalysisResult) -> str:
    verdict = (("unknown: partial trace", "warn") if r.straggling is None
               else ("straggling", "bad") if r.straggling
               else ("not straggling (within noise)", "good") if r.slowdown >= r.straggling_threshold
               else ("not straggling", "good"))
    cards = [
        _card(fmt(r.slowdown), "slowdown S", "bad" if r.straggling else "good"),
        _card(fmt(r.waste, ".1%"), "resource waste W = 1 − 1/S"),
        _card(verdict[0], f"verdict (straggling when S ≥ {r.straggling_threshold})", verdict[1]),
        _card(fmt(r.sim_error, ".2%"), "replay error sim_error",
              "warn" if r.sim_error_high else ""),
    ]
    if r.launch_slowdown is not None:
        cards.append(_card(fmt(r.launch_slowdown), "launch-delay slowdown (see below)"))
    if r.t_base is not None:
        cards.append(_card(fmt_seconds(r.t_base), "mean measured step"))
    if r.t_ideal is not None:
        cards.append(_card(fmt_seconds(r.t_ideal), "mean straggler-free step"))
    for name, value, what in (("W", r.m_w, "the top 3% workers"), ("S", r.m_s, "the last stage")):
        if value is None:
            continue
        share = 0 <= value <= 1  # a share only inside [0, 1]; the note below says why not
        cards.append(_card(fmt(value), f"M<sub>{name}</sub>: " + (
            f"share of the excess fixed by {what}" if share else
            f"fix fraction of {what}, outside 0–1 (see below)"), "" if share else "warn"))
    why = [w for w in (fix_fraction_words("M_W", r.m_w, "the top workers"),
                       fix_fraction_words("M_S", r.m_s, "the last stage")) if w]
    notes = "".join(f'<p class="note">{_e(w)}.</p>' for w in why)
    return f'<section id="headline"><div class="cards">{"".join(cards)}</div>{notes}</section>'


def _explanation(r: AnalysisResult) -> str:
    launch = f" <b>Launch-delay slowdown</b> = {_e(LAUNCH_DELAY_MEANING)}" \
        if r.launch_slowdown is not None else ""
    return (
        '<div class="explain" id="explanation"><b>S</b> (slowdown) = mean step time replayed '
        "with the measured durations / mean step time replayed with idealised, straggler-free "
        "durations (compute at its mean, communication at its median transfer time). S = 1.25 "
        "means steps take 25% longer than they would without stragglers; <b>W</b> is the share "
        "of GPU time wasted. <b>S<sub>w</sub></b> (worker score) = min(S of the worker's DP "
        "rank, S of its PP stage), where the S of a group is the slowdown left when only that "
        f"group keeps its measured durations.{launch}</div>")


def _notes(r: AnalysisResult) -> str:
    notes = notes_by_kind(r)
    if not notes:
        return ""
    lis = "".join(f'<li><b>{_e(title)}</b>: {_e(message)}</li>' for title, message in notes)
    return (f'<section id="notes"><h2 class="warn">What the trace does not show</h2>'
            f'<p class="note">Notes from the trace reader: what it could not see or had to '
            f"assume. The numbers below rest on them.</p><ul>{lis}</ul></section>")


def _warnings(r: AnalysisResult) -> str:
    items = list(r.warnings)
    if r.sim_error_high:
        items.insert(0, "The replay misses the measured step time by more than 5%: "
                        "treat the numbers below with care.")
    if not items:
        return ""
    lis = "".join(f"<li>{_e(w)}</li>" for w in items)
    return f'<section id="warnings"><h2 class="warn">Warnings</h2><ul>{lis}</ul></section>'


def _diagnosis(r: AnalysisResult) -> str:
    if not r.diagnosis:
        body = '<p class="note">No diagnosis in this result.</p>'
    else:
        lis = []
        for f in r.diagnosis:
            prediction = prediction_words(f)
            speedup = (f' Fixing it would make steps <b class="good">{_e(prediction)}</b>.'
                       if prediction else "")
            shares = "".join(f'<br><span class="share">{_e(x)}.</span>'
                             for x in (share_words(f.share), after_others_words(f)) if x)
            advice = advice_of(f)
            advice = f'<br><span class="advice">What to do: {_e(advice)}.</span>' if advice else ""
            evidence = f'<br><span class="evidence">{_e(f.evidence)}</span>' if f.evidence else ""
            lis.append(f'<li data-cause="{_e(f.cause)}"><b>{_e(title_of(f))}</b> — '
                       f"{_e(describe_where(f.where))}.{speedup}{shares}{evidence}{advice}</li>")
        body = f"<ol>{''.join(lis)}</ol>"
    combined = combined_words(r)
    if combined:
        rest = "".join(f"<br>{_e(x)}." for x in combined[1:])
        body += f'<p id="combined"><b>{_e(combined[0])}</b>.{rest}</p>'
    return f'<section id="diagnosis"><h2>Diagnosis (most important first)</h2>{body}</section>'


def _section(sid: str, title: str, explain: str, content: str) -> str:
    return (f'<section id="{sid}"><h2>{title}</h2><p class="explain">{explain}</p>'
            f"{content}</section>")


def _figure_div(fig: Any, div_id: str) -> str:
    import plotly.io as pio

    return pio.to_html(fig, full_html=False, include_plotlyjs=False, div_id=div_id,
                       default_height="440px", config={"displaylogo": False})


LABEL_BACKDROP = "rgba(255, 255, 255, 0.85)"


def _layout(**kwargs: Any) -> dict[str, Any]:
    return dict(template="plotly_white", margin=dict(l=60, r=30, t=30, b=50), **kwargs)


def _heatmap_figure(grid: WorkerGrid) -> Any:
    if not grid.values.size:
        return None
    import plotly.graph_objects as go

    z = [[None if v != v else float(v) for v in row] for row in grid.values]
    small = grid.values.size <= HEATMAP_TEXT_MAX_CELLS
    fig = go.Figure(go.Heatmap(
        z=z, x=grid.dp_ranks, y=grid.stages, zmin=HEATMAP_RANGE[0], zmax=HEATMAP_RANGE[1],
        colorscale="YlOrRd", colorbar=dict(title="S_w"),
        texttemplate="%{z:.2f}" if small else None,
        hovertemplate="DP rank %{x}, PP stage %{y}<br>S_w = %{z:.3f}<extra></extra>"))
    # Stage 0 on top so the last stage is the bottom row ("hot last row").
    fig.update_layout(**_layout(xaxis=dict(title="DP rank", type="category"),
                                yaxis=dict(title="PP stage", type="category",
                                           autorange="reversed")))
    return fig


def _steps_figure(r: AnalysisResult) -> Any:
    if not r.step_slowdown:
        return None
    import plotly.graph_objects as go

    ordered = sorted(r.step_slowdown.items())
    steps = [k for k, _ in ordered]
    values = [v for _, v in ordered]
    # the slowest steps name the worker that computed longest in them (hover text)
    who = {s.step: f"<br>computed longest: dp {s.worker.dp} / pp {s.worker.pp}"
           + (f" (rank {s.worker.rank})" if s.worker.rank is not None else "")
           + f", {s.ratio:.2f}× its stage's median worker"
           for s in r.slowest_steps if s.worker is not None and s.ratio is not None}
    fig = go.Figure(go.Bar(x=steps, y=values, marker_color="#e67e22",
                           customdata=[who.get(k, "") for k in steps],
                           hovertemplate="step %{x}: S = %{y:.3f}%{customdata}<extra></extra>"))
    # the two line labels on opposite sides, on a backdrop: S and the threshold are often close
    fig.add_hline(y=r.slowdown, line_dash="dash", annotation_text=f"job S {r.slowdown:.3f}",
                  annotation_position="top left", annotation_bgcolor=LABEL_BACKDROP)
    fig.add_hline(y=r.straggling_threshold, line_dash="dot", line_color="#c0392b",
                  annotation_text="straggling", annotation_position="bottom right",
                  annotation_bgcolor=LABEL_BACKDROP)
    lo = min(min(values), 1.0) - 0.02
    # steps on a number axis with whole-step ticks, few enough to stay apart at any run length
    # (a category axis labels every step: 200 steps crowd into one another)
    fig.update_layout(**_layout(xaxis=dict(title="step", type="linear", tickformat="d",
                                           dtick=step_tick(steps)),
                                yaxis=dict(title="S(step)", range=[lo, max(values) * 1.05])))
    return fig


def step_tick(steps: list[int], most: int = 12) -> int:
    """Distance between step ticks: 1, 2, 5, 10, 20, 50, … so at most `most` ticks show."""
    span = max(steps) - min(steps) + 1
    tick = 1
    while span / tick > most:
        for factor in (2, 5 / 2, 2):  # 1 → 2 → 5 → 10 → …
            tick = round(tick * factor)
            if span / tick <= most:
                break
    return tick


def _bar_figure(labels: list[str], values: list[float], xtitle: str, job_s: float) -> Any:
    if not labels:
        return None
    import plotly.graph_objects as go

    fig = go.Figure(go.Bar(x=labels, y=values, marker_color="#2e86c1",
                           hovertemplate="%{x}: S = %{y:.3f}<extra></extra>"))
    fig.add_hline(y=job_s, line_dash="dash", annotation_text=f"job S {job_s:.3f}")
    lo = min(min(values), 1.0) - 0.02
    fig.update_layout(**_layout(xaxis=dict(title=xtitle, type="category"),
                                yaxis=dict(title="S", range=[lo, max(max(values), job_s) * 1.05])))
    return fig
