"""Restore bodies on their way in: the bytes held at once across tokens, counted as they arrive."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from starlette.requests import Request

from stragglers.adapt.errors import Busy


class UploadBytes:
    """Bytes of restore bodies held at once, across tokens (on the event loop: no lock), from
    their first byte until their restore is answered.

    Counted as they arrive, not as declared: a head that declares a body and sends nothing
    holds nothing (one such socket held the service's only restore slot, taken from the head,
    and every owner's restore was 503 for restore_grace_s, again and again). Past `limit` a
    token holding less than its fair share (`limit` over the tokens holding bytes, itself
    counted) is still let in, and one holding more is refused (503) its next bytes: tokens
    sending bodies just fast enough cannot hold the whole budget between them. So `held` may
    pass `limit` by a fair share; a body alone is always let in.
    """

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0
        self.by_token: dict[object, int] = {}

    def check(self, key: object, declared: int) -> None:
        """Busy when a body of `declared` bytes of `key` would not be let in now."""
        self._admit(key, declared)

    def _admit(self, key: object, n: int) -> None:
        mine = self.by_token.get(key, 0)
        if self.held - mine > 0 and self.held + n > self.limit and \
                mine + n > self.limit / (len(self.by_token) + (key not in self.by_token)):
            raise Busy(f"restore bodies of {len(self.by_token)} tokens hold {self.held} bytes,"
                       f" at most {self.limit} (restore_bytes_held), {mine} of them this"
                       " token's; retry in a moment")

    def take(self, key: object, n: int) -> None:
        """Count `n` more bytes of `key`'s body; Busy (nothing counted) past the budget."""
        self._admit(key, n)
        self.held += n
        self.by_token[key] = self.by_token.get(key, 0) + n

    def give(self, key: object, n: int) -> None:
        """`n` bytes of `key` let go of."""
        self.held -= n
        left = self.by_token.get(key, 0) - n
        if left > 0:
            self.by_token[key] = left
        else:
            self.by_token.pop(key, None)


class CountedBody(Request):
    """A request whose body's bytes are counted in an UploadBytes as they arrive (given back
    by release(), once its restore is answered)."""

    def __init__(self, request: Request, budget: UploadBytes, key: object):
        super().__init__(request.scope, request.receive)
        self.budget, self.key, self.size = budget, key, 0

    async def stream(self) -> AsyncGenerator[bytes, None]:
        async for chunk in super().stream():
            self.budget.take(self.key, len(chunk))
            self.size += len(chunk)
            yield chunk

    def release(self) -> None:
        """Give back every byte counted."""
        self.budget.give(self.key, self.size)
        self.size = 0
