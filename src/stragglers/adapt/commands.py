"""CLI commands of stragglers.adapt: the data-sharding service and a status query."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from stragglers.errors import InputError, MissingExtraError


def register(app: typer.Typer) -> None:
    """Add this capability's commands to the `stragglers` app."""

    @app.command("shard-server")
    def shard_server(
        db: Path = typer.Option(..., "--db", help="SQLite file holding the shard state (created if absent)"),
        host: str = typer.Option("127.0.0.1", "--host", help="address to listen on"),
        port: int = typer.Option(8151, "--port", help="TCP port"),
        durable: bool = typer.Option(True, "--durable/--no-durable",
                                     help="fsync every commit (survives a machine crash)"),
    ) -> None:
        """Serve the stateful data-sharding service (AntDT DDS) over HTTP."""
        try:
            import fastapi  # noqa: F401
            import uvicorn  # noqa: F401
        except ImportError as exc:
            raise MissingExtraError(exc.name or "fastapi", "service") from exc
        if not 0 <= port <= 65535:
            raise InputError("--port", None, f"expected 0..65535, got {port}")
        if db.exists() and db.is_dir():
            raise InputError(db, None, "expected a SQLite file, got a directory")
        if not db.parent.exists():
            raise InputError(db, None, f"directory {db.parent} does not exist")
        from stragglers.adapt.service import serve

        typer.echo(f"shard service on http://{host}:{port} (state in {db},"
                   f" {'durable' if durable else 'non-durable'} commits); Ctrl-C stops it")
        serve(db, host, port, durable)

    @app.command("shard-status")
    def shard_status(
        dataset: str = typer.Argument(..., help="data set name"),
        url: str = typer.Option("http://127.0.0.1:8151", "--url", help="shard service URL"),
    ) -> None:
        """Print shard counts per epoch and the report of FAILED shards, as JSON."""
        from stragglers.adapt.client import ShardClient

        client = ShardClient(url, dataset, worker="cli", retry_s=2.0)
        try:
            typer.echo(json.dumps(client.status(), indent=1))
        finally:
            client.close()
