"""The type of a decoded JSON value, for documents read from files before a reader checks them.

A field a profiler or a user wrote can hold any JSON value, whatever its documentation says, so
a reader types what it has not yet checked as `JsonValue` and narrows it with isinstance; the
checker then refuses code that uses such a value unchecked (`Any` would let it through).
"""

from __future__ import annotations

from typing import TypeAlias, Union

# What json.loads or msgspec (an untyped field) gives: the recursion is spelled with strings
# so the alias is also a valid expression at run time.
JsonValue: TypeAlias = Union[None, bool, int, float, str, list["JsonValue"],
                             dict[str, "JsonValue"]]
JsonObject: TypeAlias = dict[str, JsonValue]

__all__ = ["JsonObject", "JsonValue"]
