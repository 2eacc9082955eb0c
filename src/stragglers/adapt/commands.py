"""CLI commands of stragglers.adapt: `stragglers adapt serve` (the data-sharding service) and `status`."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from stragglers.errors import InputError, MissingExtraError

# The command that makes a token file: a random token that fits the 16-512 character rule.
TOKEN_FILE_RECIPE = "(umask 077; python3 -c 'import secrets; print(secrets.token_hex(32))' > {path})"


def serve_command(
    db: Path = typer.Option(..., "--db", help="SQLite file holding the shard state (created if absent)"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on (non-loopback needs --token-file)"),
    port: int = typer.Option(8151, "--port", help="TCP port"),
    token_file: Path = typer.Option(None, "--token-file",
                                    help="file whose first line is the service token (16-512 characters of"
                                         " [A-Za-z0-9._~+/=-], mode 0600), required to create data sets and"
                                         " jobs; create one with: " + TOKEN_FILE_RECIPE.format(path="FILE")),
    durable: bool = typer.Option(True, "--durable/--no-durable",
                                 help="fsync every commit (survives a machine crash)"),
    set_: list[str] = typer.Option(None, "--set", help="NAME=VALUE of ServiceConfig, repeatable"),
) -> None:
    """Serve the stateful data-sharding service (AntDT DDS) over HTTP."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise MissingExtraError(exc.name or "fastapi", "service") from exc
    from stragglers.adapt.service import ServiceConfig, serve
    from stragglers.config import cli_overrides
    from stragglers.serving import read_token_file

    base = cli_overrides(ServiceConfig, set_)
    config = base.replace(host=host, port=port, durable=durable)
    if db.exists() and db.is_dir():
        raise InputError(db, None, "expected a SQLite file, got a directory")
    if not db.parent.exists():
        raise InputError(db, None, f"directory {db.parent} does not exist")
    if token_file is not None and not token_file.exists() and not token_file.is_symlink():
        raise InputError(token_file, None, "--token-file: no such file; create it (a random"
                         " token of 16-512 characters of [A-Za-z0-9._~+/=-], readable by you"
                         f" only) with: {TOKEN_FILE_RECIPE.format(path=token_file)}")
    token = read_token_file(token_file)
    serve(db, config, token, announce=lambda url: typer.echo(
        f"shard service on {url} (state in {db}, {'durable' if durable else 'non-durable'} "
        "commits); Ctrl-C stops it"))


def status_command(
    dataset: str = typer.Argument(..., help="data set name"),
    url: str = typer.Option("http://127.0.0.1:8151", "--url", help="shard service URL"),
) -> None:
    """Print shard counts per epoch and the report of FAILED shards, as JSON."""
    from stragglers.adapt.client import ShardClient
    from stragglers.adapt.replies import to_builtins

    client = ShardClient(url, dataset, worker="cli", retry_s=2.0)
    try:
        typer.echo(json.dumps(to_builtins(client.status()), indent=1))
    finally:
        client.close()


def register(app: typer.Typer) -> None:
    """Add the `adapt` group (and the deprecated top-level aliases) to the `stragglers` app."""
    group = typer.Typer(name="adapt", help="Self-adaptive training (AntDT): the data-sharding service.",
                        no_args_is_help=True)
    group.command("serve")(serve_command)
    group.command("status")(status_command)
    app.add_typer(group, name="adapt")
    app.command("shard-server", hidden=True, deprecated=True,
                help="Deprecated: use `stragglers adapt serve`.")(serve_command)
    app.command("shard-status", hidden=True, deprecated=True,
                help="Deprecated: use `stragglers adapt status`.")(status_command)
