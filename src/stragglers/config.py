"""One config pattern: a frozen dataclass per component, validated in one place.

Each setting is declared once with `setting(default, help, ...)`; the library builds configs
directly, YAML files go through `from_mapping` (unknown keys refused), and the CLI turns the
same fields into options with `cli_overrides`. Validation errors name the field and what was
expected, as `InputError`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Mapping

from stragglers.errors import InputError


def setting(default: Any, help: str, *, minimum: float | None = None,
            maximum: float | None = None, choices: tuple | None = None) -> Any:
    """A config field with its documentation and bounds (checked by Config.__post_init__)."""
    return dataclasses.field(default=default, metadata={
        "help": help, "minimum": minimum, "maximum": maximum, "choices": choices})


@dataclasses.dataclass(frozen=True)
class Config:
    """Base class: validates every field against its declared type, bounds and choices."""

    source: ClassVar[str] = "config"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check(type(self).__name__, f, getattr(self, f.name))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None, source: object = None):
        """Build from a mapping (e.g. parsed YAML); unknown keys are an error naming the source."""
        values = dict(values or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise InputError(source or cls.__name__, unknown[0],
                             f"unknown setting; expected one of {', '.join(sorted(names))}")
        try:
            return cls(**values)
        except InputError as exc:
            raise InputError(source or cls.__name__, exc.field, exc.problem) from None

    def replace(self, **changes):
        """A copy with some settings changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The settings as plain values (for JSON and YAML)."""
        return dataclasses.asdict(self)

    @classmethod
    def describe(cls) -> list[tuple[str, Any, str]]:
        """(name, default, help) for every setting, for documentation and --help."""
        return [(f.name, f.default, f.metadata.get("help", "")) for f in dataclasses.fields(cls)]


def cli_overrides(cls: type[Config], text: list[str] | None, source: str = "--set"):
    """Parse `name=value` pairs given on the command line into a config of class `cls`."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for item in text or []:
        name, sep, raw = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in fields:
            raise InputError(source, item, f"expected NAME=VALUE with NAME one of "
                             f"{', '.join(sorted(fields))}")
        values[name] = _parse_value(fields[name], raw.strip(), source)
    return cls.from_mapping(values, source)


def _parse_value(f: dataclasses.Field, raw: str, source: str) -> Any:
    kind = type(f.default)
    try:
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return raw.lower() in ("true", "1", "yes")
        if kind in (int, float):
            return kind(raw)
    except ValueError:
        words = {bool: "true or false", int: "a whole number", float: "a number"}
        raise InputError(source, f.name, f"expected {words.get(kind, kind.__name__)}, got "
                         f"{raw!r}") from None
    return raw


def _check(owner: str, f: dataclasses.Field, value: Any) -> None:
    meta = f.metadata
    default = f.default
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise InputError(owner, f.name, f"expected true or false, got {value!r}")
        return
    if isinstance(default, (int, float)) and default is not None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InputError(owner, f.name, f"expected a number, got {value!r}")
        if isinstance(default, int) and not isinstance(default, bool) and isinstance(value, float) \
                and not value.is_integer():
            raise InputError(owner, f.name, f"expected an integer, got {value!r}")
        if not math.isfinite(value):
            raise InputError(owner, f.name, f"expected a finite number, got {value!r}")
    lo, hi, choices = meta.get("minimum"), meta.get("maximum"), meta.get("choices")
    if lo is not None and value is not None and value < lo:
        raise InputError(owner, f.name, f"expected at least {lo}, got {value!r}")
    if hi is not None and value is not None and value > hi:
        raise InputError(owner, f.name, f"expected at most {hi}, got {value!r}")
    if choices is not None and value not in choices:
        raise InputError(owner, f.name, f"expected one of {', '.join(map(str, choices))}, "
                         f"got {value!r}")
