"""CLI of stragglers.record: `stragglers record -- torchrun ... train.py args` (the launcher form)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import typer

from stragglers.errors import EnvironmentFailure, InputError


def register(app: typer.Typer) -> None:
    """Add the `record` command to the `stragglers` app."""
    app.command("record", help="Run a training command with recording switched on for every "
                "stragglers.record.attach() in it.",
                context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
                )(record_command)


def _build_native_hooks() -> None:
    """Build attach's native hooks here, once, before the job's ranks start (they load them)."""
    from stragglers.record import native

    if os.environ.get(native.ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return
    try:
        built = native.load() is not None
    except Exception:  # no torch here: the job's own environment decides
        return
    if not built:
        typer.echo("stragglers record: building attach's native hooks (once, ~30 s)", err=True)
        if native.load(build=True) is None:
            typer.echo(f"stragglers record: native hooks unavailable ({native.last_error()}); "
                       "the job records with Python hooks", err=True)


def record_command(
    command: list[str] = typer.Argument(..., help="The job to run, after `--`, e.g. "
                                        "-- torchrun --nproc-per-node 8 train.py --lr 3e-4"),
    out: Path = typer.Option(Path("runs/job"), "--out", help="The run directory every rank "
                             "writes into."),
    sample_every: int = typer.Option(1, "--sample-every", min=1, help="Record one step in k."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an earlier run in --out."),
) -> None:
    """Run COMMAND with STRAGGLERS_RECORD=1 and the run directory in its environment.

    The job's code needs only `stragglers.record.attach(model, optimizer)` (its `out` is
    overridden); the exit status is the job's. Then: `stragglers analyze OUT`.
    """
    from stragglers.record._attach import ENV_DIR, ENV_OVERWRITE, ENV_SAMPLE, ENV_SWITCH

    if not command:
        raise InputError("record", "command", "expected the job to run after `--`")
    if shutil.which(command[0]) is None and not Path(command[0]).exists():
        raise InputError("record", "command", f"{command[0]!r} is not a program on PATH")
    out = out.resolve()
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise InputError(out, None, "is not empty (it holds an earlier run's files); choose a "
                         "new --out or pass --overwrite")
    env = {**os.environ, ENV_SWITCH: "1", ENV_DIR: str(out), ENV_SAMPLE: str(sample_every),
           ENV_OVERWRITE: "1" if overwrite else "0"}
    _build_native_hooks()
    try:
        code = subprocess.call(command, env=env)
    except OSError as exc:
        raise EnvironmentFailure(f"record: {command[0]}", f"could not start ({exc})") from None
    if code == 0 and not (out / "meta.json").exists():
        typer.echo(f"stragglers record: the job finished but wrote no run into {out}: does it "
                   "call stragglers.record.attach(model, optimizer)?", err=True)
    elif (out / "meta.json").exists():
        typer.echo(f"stragglers record: run in {out}; analyse it with: stragglers analyze {out}",
                   err=True)
    if code < 0:   # the job was killed by a signal: the shell's convention, 128 + its number
        typer.echo(f"stragglers record: the job was killed by signal {-code}", err=True)
        code = 128 - code
    elif code:
        typer.echo(f"stragglers record: the job exited with status {code}", err=True)
    raise typer.Exit(code)
