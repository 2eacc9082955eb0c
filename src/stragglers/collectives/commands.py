"""CLI commands of stragglers.collectives."""

from __future__ import annotations

import subprocess
import sys
import time

import typer
from rich.console import Console
from rich.table import Table

from stragglers.errors import InputError, MissingExtraError


def register(app: typer.Typer) -> None:
    """Add this capability's commands to the `stragglers` app."""

    @app.command("stragglar-schedule")
    def stragglar_schedule(
        n: int = typer.Argument(..., help="number of ranks (the straggler is rank n-1)"),
        show: bool = typer.Option(True, help="print the rounds in the spec's notation"),
    ) -> None:
        """Synthesise, verify and time the StragglAR phase-2 schedule for n ranks."""
        from stragglers.collectives.schedule import synthesize, verify

        if n < 2:
            raise InputError("stragglar-schedule", "N", f"need at least 2 ranks, got {n}")
        synthesize.cache_clear()
        t0 = time.perf_counter()
        sched = synthesize(n)
        seconds = time.perf_counter() - t0
        console = Console()
        if show:
            console.print(sched.describe(), highlight=False)
        t0 = time.perf_counter()
        verify(sched)
        verify_s = time.perf_counter() - t0
        console.print(f"n={n}: {sched.num_rounds} rounds (lower bound {sched.lower_bound}), "
                      f"{sched.method}; generated and verified in {seconds:.3f} s "
                      f"(verification alone {verify_s:.3f} s); verifier: OK", highlight=False)
        if sched.note:
            console.print(f"note: {sched.note}", highlight=False)

    @app.command("stragglar-model")
    def stragglar_model(
        n: int = typer.Argument(..., help="number of ranks"),
        size_mb: float = typer.Option(1024.0, help="buffer size in MiB"),
        delay_ms: float = typer.Option(0.0, help="straggler delay D in ms"),
        alpha_us: float = typer.Option(3.0, help="per-message latency α in µs"),
        bandwidth_gibs: float = typer.Option(450.0, help="link bandwidth 1/β in GiB/s"),
    ) -> None:
        """α–β times of Ring, halving/doubling, tree and StragglAR with a straggler delay."""
        from stragglers.collectives.cost_model import (ALGORITHMS, LinkModel, algorithm_time,
                                                       break_even_delay)

        if n < 2 or size_mb < 0 or delay_ms < 0 or alpha_us < 0 or bandwidth_gibs <= 0:
            raise InputError("stragglar-model", None,
                             "need N >= 2, size/delay/alpha >= 0 and bandwidth > 0")
        link = LinkModel.from_bandwidth(alpha_us * 1e-6, bandwidth_gibs * 2**30)
        size = size_mb * 2**20
        table = Table(title=f"n={n}, s={size_mb:g} MiB, D={delay_ms:g} ms")
        table.add_column("algorithm")
        table.add_column("time (ms)", justify="right")
        table.add_column("vs ring", justify="right")
        ring = algorithm_time("ring", n, size, link, delay_ms / 1e3)
        for name in ALGORITHMS:
            t = algorithm_time(name, n, size, link, delay_ms / 1e3)
            table.add_row(name, f"{t * 1e3:.3f}", f"{ring / t:.3f}x")
        console = Console()
        console.print(table)
        console.print(f"StragglAR beats Ring once D > {break_even_delay(n, size, link) * 1e3:.3f} ms")

    @app.command("calibrate-collectives")
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
            raise InputError("calibrate-collectives", "--nproc", f"need >= 2 processes, got {nproc}")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "stragglers.collectives.calibrate", "--max-size-mb", str(max_size_mb)]
        console = Console()
        console.print("running: " + " ".join(cmd), highlight=False)
        with console.status("measuring α and β …"):
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            raise InputError("calibrate-collectives", None,
                             f"torchrun failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
        values = None
        for line in proc.stdout.splitlines():
            if line.startswith("ALPHA_BETA"):
                values = [float(v) for v in line.split()[1:]]
            else:
                console.print(line, highlight=False)
        if values is None:
            raise InputError("calibrate-collectives", None, "the workers printed no measurement")
        alpha, beta = values[0], values[1]
        bw = f"{1 / beta / 2**30:.3f}" if beta > 0 else "inf"
        console.print(f"use them with: stragglers stragglar-model N --alpha-us {alpha * 1e6:.1f} "
                      f"--bandwidth-gibs {bw}", highlight=False)
