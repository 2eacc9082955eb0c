"""CLI commands of stragglers.monitor: `stragglers monitor serve`."""

from __future__ import annotations

import logging
from pathlib import Path

import typer

from stragglers.errors import MissingExtraError

group = typer.Typer(name="monitor", help="The live straggler monitor (service, dashboard, "
                    "alerts, Prometheus metrics).", no_args_is_help=True)


@group.callback()
def _group() -> None:
    """The live straggler monitor (service, dashboard, alerts, Prometheus metrics)."""


@group.command("serve")
def serve(
    db: str = typer.Option("stragglers-monitor.db", "--db",
                           help="SQLite file holding jobs, windows and alerts (created if "
                           "absent), or a postgresql://USER@HOST/DB URL that several instances "
                           "share (they divide the jobs by leases; needs --data-dir on a "
                           "shared file system)"),
    watch: list[Path] = typer.Option([], "--watch", help="a run directory, or a folder of run "
                                     "directories, to follow (repeatable)"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on (loopback by "
                             "default)"),
    port: int = typer.Option(8150, "--port", help="TCP port (0 picks a free one)"),
    token_file: Path | None = typer.Option(None, "--token-file", help="file whose first line "
                                           "is the bearer token writes must carry"),
    private: bool = typer.Option(False, "--private", help="reads need the token too"),
    config: Path | None = typer.Option(None, "--config", help="YAML file: settings, alert "
                                       "rules, webhooks"),
    data_dir: Path | None = typer.Option(None, "--data-dir", help="where uploaded parts are "
                                         "written (default: DB.uploads next to the db)"),
) -> None:
    """Serve the monitor: ingest watched runs and uploads, analyse windows, alert, dashboard."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
        import watchfiles  # noqa: F401
    except ImportError as exc:
        raise MissingExtraError(exc.name or "fastapi", "monitor") from None
    from stragglers.monitor.server import MonitorServer
    from stragglers.serving import read_token_file

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    # the service analyses windows in a process of its own (our main module is safe to
    # re-import there); a config file may still say analysis_process: false
    server = MonitorServer(db, watch, host, port, read_token_file(token_file), private, config,
                           data_dir, defaults={"analysis_process": True})
    typer.echo(f"stragglers monitor on {server.url} (store {server.store.path}"
               + (f", watching {', '.join(map(str, watch))}" if watch else "")
               + "); Ctrl-C stops it", err=False)
    server.run()


def register(app: typer.Typer) -> None:
    """Add the `monitor` group to the `stragglers` app."""
    app.add_typer(group, name="monitor")
