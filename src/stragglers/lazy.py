"""Lazy package exports: a name's module is imported on first use (so torch loads only when needed)."""

from __future__ import annotations

import importlib
import warnings
from typing import Callable, Mapping, NamedTuple


class LazyExports(NamedTuple):
    """A package's `__all__`, `__getattr__` and `__dir__` (unpacked in that order)."""

    all: list[str]
    getattr: Callable[[str], object]    # an exported class, function or module
    dir: Callable[[], list[str]]


def lazy_exports(package: str, table: Mapping[str, str | tuple[str, str]],
                 renamed: Mapping[str, str] | None = None) -> LazyExports:
    """`__all__`, `__getattr__` and `__dir__` for a package exporting `table`.

    `table` maps a public name to the module defining it, or to (module, name there) when the
    public name differs. `renamed` maps an old public name to its new one in `table`: the old
    name keeps working, with a DeprecationWarning at each use, and is in neither `__all__` nor
    `dir()`. Use: `__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY)`.
    """
    names = sorted(table)
    namespace = importlib.import_module(package).__dict__
    renamed = dict(renamed or {})

    def getattr_(name: str) -> object:
        if name in renamed:     # not cached: every use of the old name warns
            warnings.warn(f"{package}.{name} is deprecated; use {package}.{renamed[name]}",
                          DeprecationWarning, stacklevel=2)
            return getattr_(renamed[name])
        target = table.get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attr = target if isinstance(target, tuple) else (target, name)
        value = getattr(importlib.import_module(module), attr)
        namespace[name] = value     # later lookups skip __getattr__
        return value

    def dir_() -> list[str]:
        return sorted(set(names) | {k for k in namespace if not k.startswith("_")})

    return LazyExports(names, getattr_, dir_)
