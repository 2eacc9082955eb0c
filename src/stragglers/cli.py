"""The `stragglers` command: each capability registers its own subcommands."""

from __future__ import annotations

import importlib
import sys

import typer
from rich.console import Console

from stragglers.errors import StragglersError

app = typer.Typer(
    name="stragglers",
    help="Find, explain and remove stragglers in distributed training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)



@app.callback()
def _root() -> None:
    """Find, explain and remove stragglers in distributed training."""


# One module per capability owns its commands; each exposes register(app).
COMMAND_MODULES = (
    "stragglers.trace.commands",
    "stragglers.whatif.commands",
    "stragglers.collectives.commands",
    "stragglers.coding.commands",
    "stragglers.adapt.commands",
)

for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(app)


def main() -> None:
    """Run the CLI; user errors become one line on stderr and exit code 2."""
    try:
        app(standalone_mode=False)
    except StragglersError as exc:
        Console(stderr=True).print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(130)
    except Exception as exc:  # usage errors arrive here in non-standalone mode
        show = getattr(exc, "show", None)
        if callable(show) and hasattr(exc, "exit_code"):  # a click/typer usage error
            show()
            sys.exit(2)
        raise


if __name__ == "__main__":
    main()
