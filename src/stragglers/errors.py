"""User-facing errors: each names the file, the field and what was expected."""

from __future__ import annotations


class StragglersError(Exception):
    """Base class for errors the CLI reports as one line with exit code 2."""


class InputError(StragglersError):
    """Bad input: names the source (file), the field and what was expected."""

    def __init__(self, source: object, field: str | None, problem: str):
        self.source = str(source)
        self.field = field
        self.problem = problem
        where = f"{self.source}: field '{field}'" if field else self.source
        super().__init__(f"{where}: {problem}")


class DependencyCycleError(StragglersError):
    """The dependency graph has a cycle; the message names the ops involved."""


class MissingExtraError(StragglersError):
    """An optional dependency (torch, fastapi) is needed for this command."""

    def __init__(self, module: str, extra: str):
        super().__init__(
            f"this command needs '{module}', which is not installed; "
            f"install it with: pip install 'stragglers[{extra}]'"
            + (" (and torch==2.13.0)" if module == "torch" else "")
        )
