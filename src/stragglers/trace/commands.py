"""CLI commands of stragglers.trace."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from stragglers.config import with_options
from stragglers.errors import InputError
from stragglers.trace.synth.spec import (GC, GCInCompute, HeavyLastStage, HostStall, Injection,
                                         SequenceImbalance, SlowCollective, SlowLink, SlowWorker,
                                         SynthSpec)

if TYPE_CHECKING:
    from stragglers.trace.model import Trace
    from stragglers.trace.synth.truth import InjectedCause

log = logging.getLogger(__name__)


def register(app: typer.Typer) -> None:
    """Add this capability's commands to the `stragglers` app."""
    app.command("synth")(synth)
    app.command("synth-gpu")(synth_gpu)
    app.command("convert")(convert_command)


def convert_command(
    source: Path = typer.Argument(..., help="A run directory, an NDTimeline .parquet trace or "
                                  "PyTorch-profiler .json(.gz) files (one file or a folder)."),
    dest: Path = typer.Argument(..., help="A .parquet path (NDTimeline + meta YAML beside it) or a "
                                "run directory."),
    meta: Optional[Path] = typer.Option(None, "--meta", help="NDTimeline metadata YAML of SOURCE."),
    dp_size: Optional[int] = typer.Option(None, "--dp-size", help="PyTorch-profiler input: DP size."),
    pp_size: Optional[int] = typer.Option(None, "--pp-size", help="PyTorch-profiler input: PP size."),
) -> None:
    """Convert a trace between our run format and NDTimeline (lossless), or from profiler JSON."""
    from rich.console import Console

    from stragglers.trace.convert import convert

    out = convert(source, dest, meta, dp_size=dp_size, pp_size=pp_size)
    Console().print(f"wrote {out}", markup=False, highlight=False)


@with_options(SynthSpec)
def synth(
    out_dir: Path = typer.Argument(..., help="Run directory to write (meta.json + Parquet)."),
    slow_worker: Optional[str] = typer.Option(None, help="DP,STAGE,FACTOR: one slow worker."),
    heavy_last_stage: Optional[float] = typer.Option(None, help="FACTOR on the last stage's "
                                                     "forward/backward."),
    seq_imbalance: Optional[str] = typer.Option(None, help="lognormal or uniform sequence "
                                                "lengths, packed per microbatch."),
    max_len: int = typer.Option(16384, help="Longest sequence (with --seq-imbalance)."),
    tokens_per_mb: int = typer.Option(16384, help="Packed tokens per microbatch "
                                      "(with --seq-imbalance)."),
    gc_rate: Optional[float] = typer.Option(None, help="GC pauses per worker per step."),
    gc_length: float = typer.Option(0.2, help="GC pause length in seconds (with --gc-rate)."),
    slow_link: Optional[str] = typer.Option(None, help="p2p:DP,FROM,TO,FACTOR or "
                                            "collective:OPTYPE,STAGE|all,FACTOR."),
    slow_link_steps: Optional[str] = typer.Option(None, help="Comma-separated steps the slow "
                                                  "link affects (default: every step)."),
    host_stall: Optional[str] = typer.Option(None, help="DP,STAGE,SECONDS: host-side work "
                                             "before that worker's first op of each step."),
    host_stall_steps: Optional[str] = typer.Option(None, help="Comma-separated steps the host "
                                                   "stall hits (default: every step)."),
    gc_in_compute: Optional[float] = typer.Option(None, help="GC pauses per worker per step "
                                                  "inside forward/backward (no gc rows; "
                                                  "length --gc-length)."),
    force: bool = typer.Option(False, help="Replace the op tables of an existing run directory."),
    config: SynthSpec = SynthSpec(),
) -> None:
    """Generate a synthetic job trace with injected straggler causes (ground truth in meta.json)."""
    # the job's shape options (--dp ... --step-gap, --name) are SynthSpec's settings
    # (with_options); each injection option below becomes one typed injection of the spec
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from stragglers.trace.runformat import RANK_FILE, write_run
    from stragglers.trace.synth import generate

    existing = [p for p in out_dir.iterdir() if RANK_FILE.match(p.name)] \
        if out_dir.is_dir() else []
    if existing and not force:
        raise InputError(out_dir, None, f"already holds {len(existing)} op tables; pass --force "
                         "to replace them")
    injections: list[Injection | None] = [
        _parse_slow_worker(slow_worker) if slow_worker else None,
        HeavyLastStage(heavy_last_stage) if heavy_last_stage is not None else None,
        SequenceImbalance(dist=seq_imbalance, max_len=max_len, tokens_per_mb=tokens_per_mb)
        if seq_imbalance else None,
        GC(gc_rate, gc_length) if gc_rate is not None else None,
        _parse_slow_link(slow_link, slow_link_steps) if slow_link else None,
        _parse_host_stall(host_stall, host_stall_steps) if host_stall else None,
        GCInCompute(gc_in_compute, gc_length) if gc_in_compute is not None else None,
    ]
    spec = config.replace(injections=tuple(i for i in injections if i is not None))
    console = Console(stderr=True)
    # descriptions carry file names: plain text, not rich markup; no bar where stderr is no
    # terminal (it would leave a blank line); -v logs the stages either way
    with Progress(SpinnerColumn(), TextColumn("{task.description}", markup=False),
                  TimeElapsedColumn(), console=console, transient=True,
                  disable=not console.is_terminal) as progress:
        progress.add_task("generating the trace", total=None)
        log.info("generating the trace: %s", spec)
        trace = generate(spec)
        progress.add_task(f"writing {len(trace):,} ops", total=None)
        log.info("writing %s ops to %s", f"{len(trace):,}", out_dir)
        for path in existing:
            path.unlink()
        write_run(out_dir, trace)
    typer.echo(f"wrote {out_dir}: {summary(trace)}")


def synth_gpu(
    out_dir: Path = typer.Argument(..., help="Folder to write rank-N.json.gz (+ truth.yaml) into."),
    ranks: int = typer.Option(8, min=2, max=256, help="Ranks (one GPU each, data parallel)."),
    steps: int = typer.Option(6, min=1, max=1000, help="Profiled steps."),
    all_to_alls: int = typer.Option(2, min=0, max=16, help="Blocking all-to-alls per forward."),
    buckets: int = typer.Option(4, min=1, max=64, help="DDP gradient buckets (unequal sizes)."),
    late_rank: Optional[str] = typer.Option(None, help="RANK,MICROSECONDS: that rank's host "
                                            "starts every step late."),
    slow_rank: Optional[str] = typer.Option(None, help="RANK,FACTOR: that rank's GPU computes "
                                            "FACTOR times as long."),
    slow_group: Optional[str] = typer.Option(None, help="R1;R2;...,FACTOR: those ranks compute "
                                             "FACTOR times as long."),
    tp_size: int = typer.Option(1, min=1, max=64, help="Tensor parallelism (blocks of ranks "
                                "all-reducing after every forward piece)."),
    cp_size: int = typer.Option(1, min=1, max=64, help="Context parallelism (groups tp apart "
                                "exchanging K/V after every forward piece)."),
    cp_comm: str = typer.Option("all_gather", help="How a CP group exchanges K/V: all_gather, "
                                "ring (ring attention's send/recv) or all_to_all."),
    pp_size: int = typer.Option(1, min=1, max=64, help="Pipeline stages (GPipe; Megatron order, "
                                "pp slowest)."),
    microbatches: int = typer.Option(1, min=1, max=64, help="Microbatches through the "
                                     "pipeline per step."),
    grad_norm: bool = typer.Option(False, help="Clip gradients: an all-reduce of the norm over "
                                   "every rank before the optimizer."),
    expert_groups: int = typer.Option(1, min=1, max=64, help="Expert-parallel groups the "
                                      "all-to-alls run in."),
    hot_expert: Optional[str] = typer.Option(None, help="RANK,WEIGHT: routing sends that rank "
                                             "WEIGHT times its share of the rows."),
    slow_link: Optional[str] = typer.Option(None, help="RANK,FACTOR: the all-to-alls of that "
                                            "rank's expert group transfer FACTOR times as long."),
    seed: int = typer.Option(0, help="Random seed (same seed, same files)."),
) -> None:
    """Write a synthetic GPU job as PyTorch-profiler JSON, one file per rank, with ground truth."""
    from stragglers.trace.synth.kineto import GpuJob, write_gpu_job

    def pair(text: str, field: str, cast) -> tuple:
        a, b = _numbers(text, field, 2)
        try:
            return cast(a), float(b)
        except ValueError:
            raise InputError("stragglers synth-gpu", field, f"expected two comma-separated "
                             f"values, got {text!r}") from None

    def ranks_of(text: str) -> tuple[int, ...]:
        out = tuple(int(x) for x in text.split(";"))
        if any(not 0 <= r < ranks for r in out):
            raise ValueError(text)
        return out

    if ranks % (tp_size * cp_size * pp_size):
        raise InputError("stragglers synth-gpu", "--tp-size", f"tp {tp_size} × cp {cp_size} × "
                         f"pp {pp_size} does not divide the {ranks} ranks")
    if cp_comm not in ("all_gather", "ring", "all_to_all"):
        raise InputError("stragglers synth-gpu", "--cp-comm", f"{cp_comm!r}: expected "
                         "all_gather, ring or all_to_all")
    if expert_groups > ranks:
        raise InputError("stragglers synth-gpu", "--expert-groups", f"{expert_groups} groups "
                         f"of {ranks} ranks; expected at most one group per rank")
    for field, value in (("--hot-expert", hot_expert), ("--slow-link", slow_link)):
        if value and not all_to_alls:
            raise InputError("stragglers synth-gpu", field, "needs all-to-alls "
                             "(--all-to-alls 1 or more)")
    fields = ("--late-rank", "--slow-rank", "--hot-expert", "--slow-link")
    late, slow, hot, link = one_rank = [pair(text, field, int) if text else None for field, text
                                        in zip(fields, (late_rank, slow_rank, hot_expert,
                                                        slow_link))]
    for field, given in zip(fields, one_rank):
        if given is not None and not 0 <= given[0] < ranks:
            raise InputError("stragglers synth-gpu", field, f"rank {given[0]} is not one of the "
                             f"{ranks} ranks")
    job = GpuJob(ranks=ranks, steps=steps, seed=seed, all_to_alls=all_to_alls, buckets=buckets,
                 tp_size=tp_size, cp_size=cp_size, cp_comm=cp_comm, pp_size=pp_size,
                 microbatches=microbatches, grad_norm=grad_norm, expert_groups=expert_groups,
                 late_rank=late, slow_rank=slow,
                 slow_group=pair(slow_group, "--slow-group", ranks_of) if slow_group else None,
                 hot_expert=hot, slow_link=link)
    truth = write_gpu_job(job, out_dir)
    causes = "; ".join(f"{c['cause']} {c['ranks']}" for c in truth["causes"])
    typer.echo(f"wrote {out_dir}: {ranks} ranks x {steps} steps of Kineto JSON; ground truth: "
               f"{causes}")


def summary(trace: Trace) -> str:
    """One line: size of the job and the injected causes with their measured impact."""
    from stragglers.trace.synth.truth import ground_truth

    m = trace.meta
    steps = m.extra.get("generator", {}).get("steps") or len(set(trace.ops["step"].tolist()))
    causes = "; ".join(_describe_cause(t) for t in ground_truth(trace)) or "none (noise only)"
    return (f"{len(trace):,} ops, dp {m.dp_size} x pp {m.pp_size} x vpp {m.vpp_size}, "
            f"{steps} steps; ground truth: {causes}")


def _describe_cause(truth: InjectedCause) -> str:
    text = truth.cause
    for key in truth.where.__struct_fields__:
        values = getattr(truth.where, key)
        if values is None:   # not narrowed along this dimension
            continue
        shown = values if len(values) <= 6 else f"[{values[0]}..{values[-1]}] ({len(values)})"
        text += f" {key}={shown}"
    factor = truth.params.get("factor")
    if factor is not None:
        text += f" x{factor:g}"
    if truth.impact is not None:
        text += f" (step time x{truth.impact:.3f})"
    return text


def _numbers(text: str, field: str, count: int) -> list[str]:
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != count or not all(parts):
        raise InputError("stragglers synth", field, f"expected {count} comma-separated values, "
                         f"got {text!r}")
    return parts


def _parse_slow_worker(text: str) -> SlowWorker:
    d, p, f = _numbers(text, "--slow-worker", 3)
    try:
        return SlowWorker(int(d), int(p), float(f))
    except ValueError:
        raise InputError("stragglers synth", "--slow-worker", f"expected DP,STAGE,FACTOR "
                         f"(integers and a number), got {text!r}") from None


def _parse_host_stall(text: str, steps: str | None) -> HostStall:
    d, p, sec = _numbers(text, "--host-stall", 3)
    try:
        stall = HostStall(int(d), int(p), float(sec))
    except ValueError:
        raise InputError("stragglers synth", "--host-stall", f"expected DP,STAGE,SECONDS "
                         f"(integers and a number), got {text!r}") from None
    return stall.replace(steps=_steps(steps, "--host-stall-steps")) if steps else stall


def _steps(text: str, field: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise InputError("stragglers synth", field, "expected comma-separated step numbers, "
                         f"got {text!r}") from None


def _parse_slow_link(text: str, steps: str | None) -> SlowLink | SlowCollective:
    kind, _, rest = text.partition(":")
    try:
        link: SlowLink | SlowCollective | None = None
        if kind == "p2p":
            d, a, b, f = _numbers(rest, "--slow-link", 4)
            link = SlowLink(int(d), int(a), int(b), float(f))
        elif kind == "collective":
            optype, stage, f = _numbers(rest, "--slow-link", 3)
            link = SlowCollective(optype, float(f), None if stage == "all" else int(stage))
        if link is not None:
            return link.replace(steps=_steps(steps, "--slow-link-steps")) if steps else link
    except ValueError:
        pass
    raise InputError("stragglers synth", "--slow-link", "expected p2p:DP,FROM,TO,FACTOR or "
                     f"collective:OPTYPE,STAGE|all,FACTOR, got {text!r}")
