"""The error kinds of the shard service and control plane, and the HTTP status of each."""

from __future__ import annotations

import hmac

from stragglers.errors import EnvironmentFailure, InputError, StragglersError


class LeaseLost(StragglersError):
    """The worker no longer holds the shard (lease expired and the shard was requeued)."""


class Fenced(LeaseLost):
    """A newer incarnation of this worker joined: this one must stop (its calls are refused)."""


class ShufflePaused(Exception):
    """A lease needs a big epoch's shuffle its token may not start yet (its share of the
    shuffle threads spent): the lease is rolled back, and the service waits for the token's
    pause and makes the shuffle before committing it again (never an answer of its own)."""

    def __init__(self, key: tuple[int, int, int]):
        super().__init__(f"the shuffle of {key} waits for its token's pause")
        self.key = key


class Conflict(StragglersError):
    """The request contradicts existing state (a re-create with another config, a stale config)."""


class NotFound(StragglersError):
    """No such data set (or job)."""


class Forbidden(StragglersError):
    """The bearer token does not own this data set (or job)."""


class Unauthorized(StragglersError):
    """No (well-formed) bearer token on a write."""


class QuotaExceeded(StragglersError):
    """The token (or the whole service) already holds as many data sets or controllers as allowed."""


class RateLimited(QuotaExceeded):
    """New tokens appear faster than the service lets them (per client or in all); retry after
    `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Quarantined(StragglersError):
    """A stored row of this data set is damaged: its calls are refused, other data sets are served."""


class DiskFull(EnvironmentFailure):
    """A write refused for want of space (a full disk, a quota, the file-size limit): nothing of
    it was stored; retry once space is freed."""


class Busy(StragglersError):
    """Too many heavy reads are queued; retry later."""


class BodyTooLarge(InputError):
    """The request body exceeds the service's limit."""


class BodyTooSlow(InputError):
    """A request body that did not arrive within the time the service gives it."""


class UnsupportedMediaType(InputError):
    """A request body that is not declared as JSON in UTF-8 (Content-Type)."""


# The HTTP status of each kind (first match): whose fault it is, and whether to retry.
HTTP_STATUS = ((BodyTooLarge, 413), (BodyTooSlow, 408), (UnsupportedMediaType, 415), (Unauthorized, 401), (Forbidden, 403), (NotFound, 404),
               (Conflict, 409), (LeaseLost, 409), (QuotaExceeded, 429), (InputError, 400),
               (Quarantined, 503), (Busy, 503), (DiskFull, 507), (EnvironmentFailure, 503))


def authorize(owner_sha256: str | None, token_sha256: str | None, what: str) -> None:
    """Constant-time check that the caller's token digest is the owner's."""
    if owner_sha256 is None:
        return  # created without a token (in-process use): anyone with the file may write
    if token_sha256 is None or not hmac.compare_digest(owner_sha256, token_sha256):
        raise Forbidden(f"the bearer token does not own {what}")
