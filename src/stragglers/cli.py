"""The `stragglers` command: one group per capability, each registered by its own module."""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from stragglers.errors import StragglersError

app = typer.Typer(
    name="stragglers",
    help="Find, explain and remove stragglers in distributed training.\n\n"
         "Understand: analyze, advise, convert, synth.  Record: record.  Watch: monitor.  "
         "Tolerate: collectives, coding.  Adapt: adapt.  Run `stragglers COMMAND --help` for each.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

_verbosity = 0


def _version(value: bool) -> None:
    if value:
        from stragglers import __version__

        typer.echo(f"stragglers {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    verbose: int = typer.Option(0, "--verbose", "-v", count=True,
                                help="Log what the tool does (-v info, -vv debug)."),
    version: Optional[bool] = typer.Option(None, "--version", callback=_version, is_eager=True,
                                           help="Print the version and exit."),
) -> None:
    """Find, explain and remove stragglers in distributed training."""
    global _verbosity
    _verbosity = verbose
    if verbose:
        from rich.logging import RichHandler

        logger = logging.getLogger("stragglers")
        logger.setLevel(logging.DEBUG if verbose > 1 else logging.INFO)
        logger.addHandler(RichHandler(console=Console(stderr=True), show_path=False))


# One module per capability owns its commands; each exposes register(app).
COMMAND_MODULES = (
    "stragglers.whatif.commands",
    "stragglers.advise.commands",
    "stragglers.trace.commands",
    "stragglers.record.commands",
    "stragglers.monitor.commands",
    "stragglers.collectives.commands",
    "stragglers.coding.commands",
    "stragglers.adapt.commands",
)

for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(app)


def main() -> None:
    """Run the CLI: user errors exit 2, environment failures 3, each as one line on stderr."""
    try:
        # non-standalone click returns an Exit's code instead of raising it
        code = app(standalone_mode=False)
        sys.exit(code if isinstance(code, int) else 0)
    except StragglersError as exc:
        # escaped: a message quotes file names and rules, whose brackets are not markup
        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False,
                                   soft_wrap=True)
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except OSError as exc:
        if exc.filename is not None and exc.strerror:
            # a path given on the command line that cannot be read or written (no such
            # directory, permission, read-only file system, disk full): it and the reason
            where = f"{exc.filename} → {exc.filename2}" if exc.filename2 else str(exc.filename)
            Console(stderr=True).print(f"[bold red]error:[/] {escape(where)}: "
                                       f"{escape(exc.strerror)}", highlight=False,
                                       soft_wrap=True)
            sys.exit(2)
        _internal_error(exc)
    except (typer.Abort, KeyboardInterrupt):
        sys.exit(130)
    except Exception as exc:  # usage errors arrive here in non-standalone mode
        show = getattr(exc, "show", None)
        if callable(show) and hasattr(exc, "exit_code"):  # a click/typer usage error
            show()
            sys.exit(2)
        _internal_error(exc)


def _internal_error(exc: BaseException) -> None:
    """One line for a bug (the traceback with -v), exit 4."""
    if _verbosity:
        raise exc
    Console(stderr=True).print(
        f"[bold red]internal error:[/] {type(exc).__name__}: {escape(str(exc))} (this is a "
        "bug in stragglers; run with -v for the traceback and report it)", highlight=False,
        soft_wrap=True)
    sys.exit(4)


if __name__ == "__main__":
    main()
