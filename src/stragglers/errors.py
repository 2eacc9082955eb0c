"""Errors for users: each names the file or field and what was expected, and has an exit code.

Two families, so a user (and a script) can tell them apart:

* `InputError` (exit 2): the input is wrong (a file, a field, an option, a request). Fix the
  input and run again.
* `EnvironmentFailure` (exit 3): the input was fine but something around it failed (a torchrun
  child died, a service answered 5xx, a port was taken). Retrying or fixing the machine helps.
"""

from __future__ import annotations


class StragglersError(Exception):
    """Base class for errors the CLI reports as one line (never a traceback)."""

    exit_code = 2


class InputError(StragglersError):
    """Bad input: names the source (file), the field and what was expected."""

    exit_code = 2

    def __init__(self, source: object, field: str | None, problem: str):
        self.source = str(source)
        self.field = field
        self.problem = problem
        where = f"{self.source}: field '{field}'" if field else self.source
        super().__init__(f"{where}: {problem}")

    @property
    def named(self) -> str:
        """The problem with its field named, without the source (a refusal listed by file)."""
        return f"field '{self.field}': {self.problem}" if self.field else self.problem


class DependencyCycleError(InputError):
    """The trace's dependency graph has a cycle; the message names the ops involved."""

    def __init__(self, message: str):
        StragglersError.__init__(self, message)
        self.source, self.field, self.problem = "trace", None, message


class MissingExtraError(StragglersError):
    """An optional dependency (torch, fastapi) is needed for this command."""

    exit_code = 3

    def __init__(self, module: str, extra: str):
        super().__init__(
            f"this command needs '{module}', which is not installed; "
            f"install it with: pip install 'stragglers[{extra}]'"
            + (" (and torch==2.13.0)" if module == "torch" else "")
        )


class EnvironmentFailure(StragglersError):
    """Not the input's fault: a child process, a service or the machine failed (exit 3)."""

    exit_code = 3

    def __init__(self, what: str, problem: str):
        self.what = what
        self.problem = problem
        super().__init__(f"{what}: {problem}")


def one_line_if_uncaught(exc: StragglersError) -> None:
    """Have Python print `exc` as one error line, not a traceback, should nothing catch it.

    For library calls inside a user's own script (`attach` refusing a mesh under torchrun):
    every rank would otherwise print a traceback through our code for what is one bad input.
    Other exceptions, and this one caught by the script, are untouched.
    """
    import os
    import sys

    previous = sys.excepthook

    def hook(kind, value, tb):
        if value is not exc:
            return previous(kind, value, tb)
        rank = os.environ.get("RANK")
        where = f"rank {rank}: " if rank is not None else ""
        # one write of the whole line (print writes the text and its newline apart): every
        # rank of a job prints at once to one pipe, and two ranks' lines were spliced
        sys.stderr.write(f"error: {where}{value}\n")
        sys.stderr.flush()

    sys.excepthook = hook
