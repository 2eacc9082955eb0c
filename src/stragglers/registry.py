"""Named implementations of a protocol, registered where they are defined (no if/elif on names)."""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

from stragglers.errors import InputError

T = TypeVar("T")


class Registry(Generic[T]):
    """A name → implementation table for one protocol; lookups of unknown names list the choices."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: register the decorated class or factory under `name`."""
        def add(item: T) -> T:
            if name in self._items and self._items[name] is not item:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._items[name] = item
            return item
        return add

    def get(self, name: str, field: str | None = None) -> T:
        """The implementation called `name`; an InputError naming the choices otherwise."""
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise InputError(self.kind, field or self.kind, f"expected one of "
                             f"{', '.join(self.names())}, got {name!r}") from None

    def names(self) -> list[str]:
        """Registered names in registration order."""
        return list(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)
