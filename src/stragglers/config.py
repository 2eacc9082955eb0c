"""One config pattern: a frozen dataclass per component, validated in one place.

Each setting is declared once with `setting(default, help, ...)`; the library builds configs
directly, YAML files go through `from_mapping` (unknown keys refused), and the CLI turns the
same fields into options: `--set NAME=VALUE` pairs with `cli_overrides`, or one `--name` option
per setting with `with_options`. Validation errors name the field and what was expected, as
`InputError`.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import inspect
import math
import numbers
import types
import typing
from typing import (Any, Callable, ClassVar, Mapping, NamedTuple, Optional, Sequence, TypeAlias,
                    TypeVar, Union)

from stragglers.errors import InputError


T = TypeVar("T")
R = TypeVar("R")

# A setting's value as `Config.to_dict` gives it: what JSON and YAML encoders take, kept as the
# config holds it (a tuple stays a tuple, a map of ranks keeps its int keys) so that
# `from_mapping(config.to_dict()) == config`; a nested dataclass (AdviseConfig.link) is a dict.
# Decoded JSON (trace/jsontypes.py's JsonValue) is one.
PlainValue: TypeAlias = Union[None, bool, int, float, str, Sequence["PlainValue"],
                              Mapping[str, "PlainValue"], Mapping[int, "PlainValue"]]
PlainObject: TypeAlias = dict[str, PlainValue]


@dataclasses.dataclass(frozen=True)
class Setting:
    """What `setting()` declares of a config field besides its default."""

    help: str = ""
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple | None = None
    flag: str | None = None    # its command-line option when not `--name-with-dashes`


_SETTING = "stragglers.config"   # the dataclass field metadata key that holds its Setting
_UNDECLARED = Setting()


def setting(default: T, help: str, *, minimum: float | None = None,
            maximum: float | None = None, choices: tuple | None = None,
            flag: str | None = None) -> T:
    """A config field with its documentation and bounds (checked by Config.__post_init__).

    `flag` is its command-line option (`with_options`) when not `--name-with-dashes`.
    """
    return dataclasses.field(default=default, metadata={
        _SETTING: Setting(help, minimum, maximum, choices, flag)})


def declared(f: dataclasses.Field) -> Setting:
    """The Setting of a config field (an empty one for a field not made by `setting`)."""
    return f.metadata.get(_SETTING, _UNDECLARED)


@dataclasses.dataclass(frozen=True)
class Config:
    """Base class: validates every field against its declared type, bounds and choices."""

    source: ClassVar[str] = "config"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.default is None and value is not None:
                # the default says nothing of the type: the annotation does
                _check_declared(type(self).__name__, f.name, value, _hints(type(self))[f.name])
            _check(type(self).__name__, f, value)

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

    def to_dict(self) -> PlainObject:
        """The settings as plain values (for JSON and YAML)."""
        return dataclasses.asdict(self)

    @classmethod
    def describe(cls) -> list[SettingHelp]:
        """(name, default, help) for every setting, for documentation and --help."""
        return [SettingHelp(f.name, f.default, declared(f).help) for f in dataclasses.fields(cls)]


class SettingHelp(NamedTuple):
    """One setting as `Config.describe` lists it."""

    name: str
    default: object     # of the setting's declared type, whatever that is
    help: str


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
        values[name] = _parse_value(fields[name], raw.strip(), source, _hints(cls)[name])
    return cls.from_mapping(values, source)


def with_options(cls: type[Config], *, exclude: tuple[str, ...] = ()
                 ) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Decorate a typer command with one option per scalar setting of `cls` (its help, its
    default, `--name-with-dashes` or the setting's `flag`); the command receives them as one
    validated `config: cls` argument. A bad value is a usage error naming the option (exit 2,
    as click's own checks)."""
    import typer

    fields = [f for f in dataclasses.fields(cls) if f.name not in exclude
              and _option_type(_hints(cls)[f.name]) is not None]

    def decorate(command: Callable[..., R]) -> Callable[..., R]:
        signature = inspect.signature(command)
        taken = set(signature.parameters)
        added = []
        for f in fields:
            if f.name in taken:
                raise TypeError(f"{command.__name__} already has a parameter {f.name!r}")
            added.append(inspect.Parameter(
                f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                annotation=_option_type(_hints(cls)[f.name]),
                default=typer.Option(f.default, _declaration(f), help=_option_help(f))))
        kept = [p for p in signature.parameters.values() if p.name != "config"]
        # the settings' options right after the command's arguments (help lists them first)
        arguments = [p for p in kept if isinstance(p.default, typer.models.ArgumentInfo)]
        rest = [p for p in kept if p not in arguments]

        @functools.wraps(command)
        def run(*args: Any, **kwargs: Any) -> R:
            values = {f.name: kwargs.pop(f.name) for f in fields}
            try:
                config = cls(**values)
            except InputError as exc:
                flag = next((flag_of(f) for f in fields if f.name == exc.field), exc.field)
                raise typer.BadParameter(exc.problem, param_hint=f"'{flag}'") from None
            return command(*args, config=config, **kwargs)

        run.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=arguments + added + rest)
        return run

    return decorate


def flag_of(f: dataclasses.Field) -> str:
    """The command-line option of a setting: its `flag`, else `--name-with-dashes`."""
    return declared(f).flag or "--" + f.name.replace("_", "-")


def _declaration(f: dataclasses.Field) -> str:
    """The option's declaration: a true-or-false setting can be turned either way."""
    flag = flag_of(f)
    return f"{flag}/--no-{flag[2:]}" if isinstance(f.default, bool) else flag


def _option_help(f: dataclasses.Field) -> str:
    spec = declared(f)
    text = spec.help[:1].upper() + spec.help[1:] + "."
    if spec.choices:
        text += f" One of {', '.join(map(str, spec.choices))}."
    lo, hi = spec.minimum, spec.maximum
    bounds = f"{lo:g}–{hi:g}" if lo is not None and hi is not None else \
        f"≥ {lo:g}" if lo is not None else f"≤ {hi:g}" if hi is not None else ""
    return f"{text} [{bounds}]" if bounds else text


def _option_type(hint: Any) -> Any:
    """The option's type for a setting's annotation, or None when it is no scalar."""
    optional, inner = _unwrap_optional(hint)
    if inner not in (bool, int, float, str) or (optional and inner is bool):
        return None
    return Optional[inner] if optional else inner


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """A config class's resolved annotations (computed once per class)."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _unwrap_optional(hint: Any) -> tuple[bool, Any]:
    """(whether None is allowed, the type besides None)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(rest) == 1 and len(rest) < len(typing.get_args(hint)):
            return True, rest[0]
    return False, hint


_WORDS = {int: "an integer", float: "a finite number", str: "text", bool: "true or false"}


def _check_declared(owner: str, name: str, value: Any, hint: Any) -> None:
    """Check a value against its annotation (scalars, containers by kind, classes)."""
    _, kind = _unwrap_optional(hint)
    origin = typing.get_origin(kind) or kind
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and _finite(value)
    elif origin in (collections.abc.Sequence, tuple, list):
        ok = isinstance(value, (tuple, list))
        kind = "a list"
    elif origin in (collections.abc.Mapping, dict):
        ok = isinstance(value, collections.abc.Mapping)
        kind = "a mapping"
    elif isinstance(origin, type):
        ok = isinstance(value, origin)
    else:
        return  # an annotation this check does not read (Any, a union of several types)
    if not ok:
        words = _WORDS.get(kind) or (kind if isinstance(kind, str) else f"a {kind.__name__}")
        raise InputError(owner, name, f"expected {words}, got {value!r}")


def _parse_value(f: dataclasses.Field, raw: str, source: str, hint: Any = None) -> Any:
    optional, declared = _unwrap_optional(hint)
    if f.default is None and optional and raw.lower() in ("none", "null"):
        return None
    kind = declared if f.default is None else type(f.default)   # None says nothing of it
    try:
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return raw.lower() in ("true", "1", "yes")
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
    except ValueError:
        words = {bool: "true or false", int: "a whole number", float: "a number"}
        raise InputError(source, f.name, f"expected {words.get(kind, str(kind))}, got "
                         f"{raw!r}") from None
    return raw


# the largest whole number a setting takes (int64's: numpy and SQLite hold them)
MAX_WHOLE = 2 ** 63 - 1


def _finite(value: numbers.Real) -> bool:
    """A finite number a setting can hold: a float not inf/NaN, an int within int64 (a
    400-digit int overflowed math.isfinite: internal error, not the setting's one line)."""
    if isinstance(value, numbers.Integral):
        return -MAX_WHOLE - 1 <= int(value) <= MAX_WHOLE
    return math.isfinite(value)


# the longest a duration setting (a name ending in _s that is not a rate, *_per_s) may be,
# whatever its own maximum: what a timer can wait and a clock can add (Event.wait(1e19) raised
# OverflowError past time_t's range and killed the monitor's rescan thread: rescan_s, red team
# round 9 F3). 1e9 s is 31 years: an operator's "never".
MAX_DURATION_S = 1e9


def _duration(name: str) -> bool:
    """Whether a setting of this name is a duration in seconds (not a rate per second)."""
    return name.endswith("_s") and "_per_" not in name


def _shown(value: Any) -> str:
    """A value as an error line shows it: at most 40 characters of it."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10 ** 40 else \
        f"a whole number of about {int(value.bit_length() * 0.30103) + 1} digits"
    return text if len(text) <= 40 else text[:37] + "..."


def _check(owner: str, f: dataclasses.Field, value: Any) -> None:
    spec = declared(f)
    default = f.default
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise InputError(owner, f.name, f"expected true or false, got {value!r}")
        return
    if isinstance(default, (int, float)) and default is not None:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise InputError(owner, f.name, f"expected a number, got {value!r}")
        if isinstance(default, int) and not isinstance(default, bool) and isinstance(value, float) \
                and not value.is_integer():
            raise InputError(owner, f.name, f"expected an integer, got {value!r}")
        if not _finite(value):
            raise InputError(owner, f.name, f"expected a finite number, got {_shown(value)}")
    lo, hi, choices = spec.minimum, spec.maximum, spec.choices
    if lo is not None and value is not None and value < lo:
        raise InputError(owner, f.name, f"expected at least {lo}, got {_shown(value)}")
    if _duration(f.name) and isinstance(value, (int, float)) and value > MAX_DURATION_S:
        raise InputError(owner, f.name, f"expected at most {MAX_DURATION_S:g} seconds (the "
                         f"longest a timer can wait: 31 years), got {_shown(value)}")
    if hi is not None and value is not None and value > hi:
        raise InputError(owner, f.name, f"expected at most {hi}, got {_shown(value)}")
    if choices is not None and value not in choices:
        raise InputError(owner, f.name, f"expected one of {', '.join(map(str, choices))}, "
                         f"got {value!r}")
