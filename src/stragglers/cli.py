"""The `stragglers` command: one group per capability, each registered by its own module."""

from __future__ import annotations

import importlib
import logging
import sys
import time
from typing import Optional

import typer
import typer.main
from typer.core import TyperOption
from rich.console import Console
from rich.markup import escape

from stragglers.errors import StragglersError
from stragglers.wording import printable

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
log = logging.getLogger("stragglers.cli")


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
    configure_logging(verbose)
    log.info("stragglers %s", " ".join(sys.argv[1:]))
    if verbose > 1:
        import platform

        from stragglers import __version__

        log.debug("stragglers %s on Python %s (%s)", __version__, platform.python_version(),
                  sys.executable)


def configure_logging(verbosity: int) -> None:
    """The package's loggers from -v (info) and -vv (debug, and torch's and httpx's warnings
    and up), on stderr; one handler however often it is called."""
    if verbosity <= 0:
        return
    from rich.logging import RichHandler

    logger = logging.getLogger("stragglers")
    logger.setLevel(logging.DEBUG if verbosity > 1 else logging.INFO)
    if not any(isinstance(h, RichHandler) for h in logger.handlers):
        handler = RichHandler(console=Console(stderr=True), show_path=False,
                              show_time=verbosity > 1)
        handler.addFilter(_printable_record)
        logger.addHandler(handler)
    logger.propagate = False  # a root handler (pytest's, a host application's) would repeat it


def _printable_record(record: logging.LogRecord) -> bool:
    """The record's message with control characters as escapes (it quotes names from files)."""
    record.msg, record.args = printable(record.getMessage()), None
    return True


# One module per capability owns its commands; each exposes register(app).
COMMAND_MODULES = (
    "stragglers.whatif.commands",
    "stragglers.advice.commands",
    "stragglers.trace.commands",
    "stragglers.record.commands",
    "stragglers.monitor.commands",
    "stragglers.collectives.commands",
    "stragglers.coding.commands",
    "stragglers.adapt.commands",
)

for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(app)


def command():
    """The click command tree of `app`, its option types written for a reader: flags and counts
    take no value (no `<bool>`, `<int>`), a repeatable option names its element (`<path>`, not
    `<list[Path]>`)."""
    root = typer.main.get_command(app)
    for cmd in _walk(root):
        for param in cmd.params:
            _reader_metavar(param)
        cmd.get_help_option = _help_option(cmd.get_help_option)  # made per context, by click
    return root


def _reader_metavar(param) -> None:
    if not isinstance(param, TyperOption) or param.metavar is not None:
        return
    if param.is_flag or param.count:
        param.metavar = ""
        param.show_default = param.show_default and not param.count  # "-vv", not "[default: 0]"
    elif param.multiple:
        label = param.bare_type()  # list[X]
        param.metavar = "<" + label.removeprefix("list[").removesuffix("]").lower() + ">"


def _help_option(make):
    def get_help_option(ctx):
        option = make(ctx)
        if option is not None:
            _reader_metavar(option)
        return option
    return get_help_option


def _walk(cmd):
    yield cmd
    for sub in getattr(cmd, "commands", {}).values():
        yield from _walk(sub)


def main() -> None:
    """Run the CLI: user errors exit 2, environment failures 3, each as one line on stderr."""
    started = time.perf_counter()
    try:
        # non-standalone click returns an Exit's code instead of raising it
        code = command()(standalone_mode=False, prog_name="stragglers")
        log.info("done in %.2f s", time.perf_counter() - started)
        sys.exit(code if isinstance(code, int) else 0)
    except StragglersError as exc:
        # escaped: a message quotes file names and rules, whose brackets are not markup
        Console(stderr=True).print(f"[bold red]error:[/] {escape(printable(str(exc)))}",
                                   highlight=False,
                                   soft_wrap=True)
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except OSError as exc:
        if exc.filename is not None and exc.strerror:
            # a path given on the command line that cannot be read or written (no such
            # directory, permission, read-only file system, disk full): it and the reason
            where = f"{exc.filename} → {exc.filename2}" if exc.filename2 else str(exc.filename)
            Console(stderr=True).print(f"[bold red]error:[/] {escape(printable(where))}: "
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
        f"[bold red]internal error:[/] {type(exc).__name__}: {escape(printable(str(exc)))} "
        "(this is a "
        "bug in stragglers; run with -v for the traceback and report it)", highlight=False,
        soft_wrap=True)
    sys.exit(4)


if __name__ == "__main__":
    main()
