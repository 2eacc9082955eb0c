"""CLI commands of stragglers.collectives: the `stragglers collectives` group."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import typer
from rich.console import Console
from rich.table import Table

from stragglers.errors import EnvironmentFailure, InputError, MissingExtraError


MAX_SCHEDULE_N = 4096   # what `collectives model` prices (by its rounds: no schedule built)
# what `collectives schedule` builds and verifies: a power of two's schedule is written down
# (1,024 ranks: ~4 s; 4,096: 8.4 M transfers, 2.2 GB), another n's searched greedily, ~n³
# (512: ~2 s; 1,000: ~18 s; 4,095: ~20 min of CPU)
MAX_BUILT_N, MAX_BUILT_POWER_OF_TWO = 512, 1024


def stragglar_schedule(
    n: int = typer.Option(..., "--n", help="number of ranks (the straggler is rank n-1)"),
    show: bool = typer.Option(True, help="print the rounds in docs/stragglar.md's notation"),
) -> None:
    """Synthesise, verify and time the StragglAR phase-2 schedule for n ranks."""
    from stragglers.collectives.schedule import synthesize, verify

    if n < 2:
        raise InputError("collectives schedule", "--n", f"need at least 2 ranks, got {n}")
    power = n & (n - 1) == 0
    if n > (MAX_BUILT_POWER_OF_TWO if power else MAX_BUILT_N):
        raise InputError("collectives schedule", "--n", f"{n} ranks: a schedule holds ~n²/2 "
                         f"transfers ({n * n // 2:,} here) and another n than a power of two's "
                         f"is searched greedily (~n³); at most {MAX_BUILT_N} ranks, or a power "
                         f"of two up to {MAX_BUILT_POWER_OF_TWO} (`collectives model` prices "
                         f"up to {MAX_SCHEDULE_N} without building it)")
    synthesize.cache_clear()
    t0 = time.perf_counter()
    sched = synthesize(n)
    seconds = time.perf_counter() - t0
    console = Console()
    if show:
        # plain text, not through rich: wrapping n rounds of n/2 transfers each took rich
        # minutes at n = 1024 (the schedule itself: 2 s)
        typer.echo(schedule_legend(n))
        typer.echo(sched.describe())
    t0 = time.perf_counter()
    verify(sched)
    verify_s = time.perf_counter() - t0
    console.print(f"n={n}: {sched.num_rounds} rounds (lower bound {sched.lower_bound}), "
                  f"{sched.method}; generated and verified in {seconds:.3f} s "
                  f"(verification alone {verify_s:.3f} s); verifier: OK", highlight=False)
    if sched.note:
        console.print(f"note: {sched.note}", highlight=False)


def schedule_legend(n: int) -> str:
    """How to read `Schedule.describe()` (the notation of docs/stragglar.md §2), < 80 columns."""
    return (f"StragglAR phase 2 for n={n}, one line per round; S = the straggler "
            f"(rank {n - 1}).\n"
            "  a⇄S:k    a and S swap chunk k (a's partial sum, S's data): both then hold it\n"
            "  a→b:k    a copies the reduced chunk k to b\n"
            "  a⇄b:k/l  a sends reduced chunk k to b, b sends reduced chunk l to a\n")


def stragglar_model(
    n: int = typer.Option(..., "--n", help="number of ranks"),
    size_mb: float = typer.Option(1024.0, help="buffer size in MiB"),
    delay_ms: float = typer.Option(0.0, help="straggler delay D in ms"),
    alpha_us: float = typer.Option(3.0, help="per-message latency α in µs"),
    bandwidth_gibs: float = typer.Option(450.0, help="link bandwidth 1/β in GiB/s"),
) -> None:
    """α–β times of Ring, halving/doubling, tree and StragglAR with a straggler delay."""
    from stragglers.collectives.cost_model import LinkModel, algorithm_time, break_even_delay
    from stragglers.protocols import ALLREDUCE_ALGORITHMS

    if not 2 <= n <= MAX_SCHEDULE_N:   # StragglAR's time counts the rounds of its schedule
        raise InputError("collectives model", "--n", f"expected 2 to {MAX_SCHEDULE_N} ranks "
                         f"(StragglAR's time needs its schedule, built for n ranks), got {n}")
    for name, value, ok in (("--size-mb", size_mb, size_mb >= 0),
                            ("--delay-ms", delay_ms, delay_ms >= 0), ("--alpha-us", alpha_us, alpha_us >= 0),
                            ("--bandwidth-gibs", bandwidth_gibs, bandwidth_gibs > 0)):
        # NaN fails `ok`; an infinite bandwidth is a model (β = 0: calibrate suggests it when
        # it measures no per-byte cost), an infinite size, delay or latency is not
        if not ok or (value == float("inf") and name != "--bandwidth-gibs"):
            raise InputError("collectives model", name, f"expected a finite number "
                             f"{'> 0' if name == '--bandwidth-gibs' else '>= 0'}, got {value}")
    link = LinkModel.from_bandwidth(alpha_us * 1e-6, bandwidth_gibs * 2**30)
    size = size_mb * 2**20
    table = Table(title=f"n={n}, s={size_mb:g} MiB, D={delay_ms:g} ms")
    table.add_column("algorithm")
    table.add_column("time (ms)", justify="right")
    table.add_column("vs ring", justify="right")
    ring = algorithm_time("ring", n, size, link, delay_ms / 1e3)
    for name in ALLREDUCE_ALGORITHMS.names():
        t = algorithm_time(name, n, size, link, delay_ms / 1e3)
        table.add_row(name, f"{t * 1e3:.3f}", f"{ring / t:.3f}x")
    console = Console()
    console.print(table)
    console.print(f"StragglAR beats Ring once D > {break_even_delay(n, size, link) * 1e3:.3f} ms")


def calibrate_collectives(
    nproc: int = typer.Option(2, help="processes to launch with torchrun on this host"),
    max_size_mb: float = typer.Option(16.0, help="largest message to time (MiB)"),
) -> None:
    """Measure α and β of gloo (or NCCL with GPUs) here, by ping-pong under torchrun."""
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise MissingExtraError("torch", "train") from exc
    if nproc < 2:
        raise InputError("collectives calibrate", "--nproc", f"need >= 2 processes, got {nproc}")
    if not max_size_mb > 0:
        raise InputError("collectives calibrate", "--max-size-mb", f"need > 0, got {max_size_mb}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "stragglers.collectives.calibrate", "--max-size-mb", str(max_size_mb)]
    console = Console()
    console.print("running: " + " ".join(cmd), markup=False, highlight=False)
    with console.status("measuring α and β …"):
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:  # the input was fine: the launch or a worker failed
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise EnvironmentFailure("torchrun (calibration workers)",
                                 f"exited with {proc.returncode}: {last}")
    values = None
    for line in proc.stdout.splitlines():
        if line.startswith("ALPHA_BETA"):
            values = [float(v) for v in line.split()[1:]]
        else:
            console.print(line, highlight=False)
    if values is None:
        raise EnvironmentFailure("torchrun (calibration workers)", "printed no measurement")
    alpha, beta = values[0], values[1]
    bw = f"{1 / beta / 2**30:.3f}" if beta > 0 else "inf"
    console.print(f"use them with: stragglers collectives model --n N --alpha-us {alpha * 1e6:.1f} "
                  f"--bandwidth-gibs {bw}", highlight=False)


def register(app: typer.Typer) -> None:
    """Add the `stragglers collectives` group (and the old names as hidden deprecated aliases)."""
    group = typer.Typer(name="collectives", no_args_is_help=True,
                        help="StragglAR AllReduce: schedules, the α–β model, calibration.")
    group.command("schedule")(stragglar_schedule)
    group.command("model")(stragglar_model)
    group.command("calibrate")(calibrate_collectives)
    app.add_typer(group, name="collectives")
    for old, new, fn in (("stragglar-schedule", "schedule", stragglar_schedule),
                         ("stragglar-model", "model", stragglar_model),
                         ("calibrate-collectives", "calibrate", calibrate_collectives)):
        app.command(old, hidden=True, deprecated=True,
                    help=f"Deprecated: use `stragglers collectives {new}`.")(fn)
