"""Limits per key (a token, a client address, a job) on requests in progress and the body
bytes they hold, so that one writer cannot take a whole service's upload budget; the rate at
which new owners (tokens, jobs) may appear; and the pace of requests without a credential."""

from __future__ import annotations

import ipaddress
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any


class LimitExceeded(Exception):
    """A key is at one of its limits: `what` says which (one line, for the service's error)."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


class InProgress:
    """Requests in progress per key (used on one event loop: no lock)."""

    def __init__(self) -> None:
        self.requests: dict[object, int] = {}

    def leave(self, key: object) -> None:
        """A request of `key` is over."""
        n = self.requests.get(key, 0) - 1
        if n > 0:
            self.requests[key] = n
        else:
            self.requests.pop(key, None)


class KeyedLimits(InProgress):
    """Requests in progress and body bytes held per key, each bounded (used on one event loop:
    no lock). `name` says what a key is, in the messages ("token", "client", "job").

    A key holding nothing is always let in with one body (a part larger than the byte limit
    could otherwise never be stored); past that, a body whose bytes would take the key past
    `max_bytes` is refused as they arrive, like the service's own budget.
    """

    def __init__(self, name: str, max_requests: int, max_bytes: int):
        super().__init__()
        self.name, self.max_requests, self.max_bytes = name, max_requests, max_bytes
        self.held: dict[object, int] = {}

    def enter(self, key: object) -> None:
        """Count a request of `key` in progress; LimitExceeded past max_requests."""
        n = self.requests.get(key, 0)
        if n >= self.max_requests:
            raise LimitExceeded(f"this {self.name} has {n} requests in progress, its limit")
        self.requests[key] = n + 1


    def fits(self, key: object, n: int) -> bool:
        """Whether a body of `n` bytes (declared) would be let in now."""
        held = self.held.get(key, 0)
        return held == 0 or held + n <= self.max_bytes

    def take(self, key: object, n: int, mine: int = 0) -> None:
        """Count `n` more body bytes of `key` (`mine`: what this request holds already);
        LimitExceeded when the key holds bytes of other requests and would pass max_bytes."""
        held = self.held.get(key, 0)
        if held - mine > 0 and held + n > self.max_bytes:
            raise LimitExceeded(f"this {self.name} holds {held} bytes of uploads, at most "
                                f"{self.max_bytes}")
        self.held[key] = held + n

    def give(self, key: object, n: int) -> None:
        """`n` body bytes of `key` are let go of."""
        left = self.held.get(key, 0) - n
        if left > 0:
            self.held[key] = left
        else:
            self.held.pop(key, None)


class RequestLimits:
    """One request's share of several KeyedLimits (its token's, its client's, ...): entered
    at once, bytes taken from all, everything given back by `close` and `give`."""

    def __init__(self, pairs: list[tuple[KeyedLimits, object]]):
        self.pairs: list[tuple[KeyedLimits, object]] = []
        self.open = True
        try:
            for limits, key in pairs:
                limits.enter(key)
                self.pairs.append((limits, key))
        except LimitExceeded:
            self.close()
            raise

    def fits(self, n: int) -> bool:
        """Whether a body of `n` bytes (declared) would be let in by every limit now."""
        return all(limits.fits(key, n) for limits, key in self.pairs)

    def take(self, n: int, mine: int = 0) -> None:
        """Count `n` body bytes in every limit, none when one refuses them."""
        done = []
        try:
            for limits, key in self.pairs:
                limits.take(key, n, mine)
                done.append((limits, key))
        except LimitExceeded:
            for limits, key in done:
                limits.give(key, n)
            raise

    def give(self, n: int) -> None:
        """`n` body bytes let go of, in every limit."""
        for limits, key in self.pairs:
            limits.give(key, n)

    def close(self) -> None:
        """The request is over (its bytes are given back separately); idempotent."""
        if self.open:
            self.open = False
            for limits, key in self.pairs:
                limits.leave(key)


def quota_client(host: str | None) -> str | None:
    """The key per-client quotas count a request under: its client (client_key: an IPv6
    address's /64), or None (no per-client quota) for a loopback or unknown one — every local
    process connects from loopback, and may pick any of 127.0.0.0/8 as its source, so a
    loopback address tells no two clients apart (one process would take every local client's
    share; local clients are told apart by their tokens, and what they may create is bounded
    by the rates below and the service's limits)."""
    if not host:
        return None
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return host   # a name (a UNIX socket path, a test client): counted as given
    mapped = getattr(address, "ipv4_mapped", None)   # ::ffff:127.0.0.1 on a dual-stack socket
    return None if (mapped or address).is_loopback else client_key(host)


def client_key(host: str) -> str:
    """The client a request's address stands for, as every per-client share counts it (the
    anonymous pace, the connection caps, the quotas): an IPv4 address itself, an IPv6 one its
    /64 (one host holds a whole /64: counted per address, it took a share per address it
    picked), an IPv4-mapped one its IPv4; anything else (a UNIX socket path, a test client's
    name) as given."""
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return host
    mapped = getattr(address, "ipv4_mapped", None)
    if mapped is not None:
        return str(mapped)
    if address.version == 6:
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


class RateLimited(LimitExceeded):
    """Past a creation rate: `retry_after_s` until the next one would be let in."""

    def __init__(self, what: str, retry_after_s: float):
        super().__init__(what)
        self.retry_after_s = retry_after_s
        self.park_s: float | None = None   # Backpressure: how long to wait before answering


class _Bucket:
    """A token bucket: `capacity` at once, refilled at `rate` per second."""

    __slots__ = ("level", "at")

    def __init__(self, capacity: float, now: float):
        self.level, self.at = capacity, now

    def fill(self, capacity: float, rate: float, now: float) -> float:
        self.level = min(capacity, self.level + (now - self.at) * rate)
        self.at = now
        return self.level


class MintRate:
    """How fast new owners (tokens creating their first data set or controller, new jobs) may
    appear, per client and in total: a token bucket of `per_client` a minute for each client
    key (None: no per-client bucket, see quota_client) and one of `total` a minute for all.

    Owners once admitted are remembered (the last `remember` of them), so a retried or later
    creation of the same owner costs nothing; a new one past a rate is RateLimited (429 with
    Retry-After). Used from one thread at a time (each service's event loop).

    A count is given back (refund) only when every request that relied on it was refused: two
    overlapping creations of one new owner, the first refused, gave it back while the second
    went on to succeed, uncounted. Each request admitted under an owner's count holds it until
    it is refused; one that succeeds never lets go, so the count stays.
    """

    def __init__(self, name: str, per_client: float, total: float, remember: int = 65536,
                 clock=time.monotonic):
        self.name, self.per_client, self.total = name, per_client, total
        self.remember, self.clock = remember, clock
        self.known: OrderedDict[object, None] = OrderedDict()
        self._all = _Bucket(total, clock())
        self._clients: dict[str, _Bucket] = {}
        # per owner counted here: [requests holding its count (admitted, not refused), the
        # client charged]; an owner known otherwise (know) has none
        self._holders: dict[object, list] = {}

    def know(self, owner: object) -> None:
        """Remember `owner` as admitted (one that owns something already: no mint)."""
        self.known[owner] = None
        self.known.move_to_end(owner)
        while len(self.known) > self.remember:
            self._holders.pop(self.known.popitem(last=False)[0], None)

    def admit(self, owner: object, client: str | None) -> bool:
        """Let `owner` create (counting it as new unless known); RateLimited past a rate.
        True when the request holds a count (counted now or by a request not yet settled):
        it must call refund if it is refused."""
        if owner in self.known:
            self.known.move_to_end(owner)
            holders = self._holders.get(owner)
            if holders is None:
                return False
            holders[0] += 1
            return True
        now = self.clock()
        bucket = None
        if client is not None:
            bucket = self._clients.get(client)
            if bucket is None:
                if len(self._clients) >= 4096:   # forget the clients whose buckets are full
                    self._clients = {k: b for k, b in self._clients.items()
                                     if b.fill(self.per_client, self.per_client / 60, now)
                                     < self.per_client}
                bucket = self._clients[client] = _Bucket(self.per_client, now)
            if bucket.fill(self.per_client, self.per_client / 60, now) < 1:
                raise RateLimited(f"client {client} created more than {self.per_client:g} new "
                                  f"{self.name}s a minute", (1 - bucket.level) * 60 /
                                  self.per_client)
        if self._all.fill(self.total, self.total / 60, now) < 1:
            raise RateLimited(f"more than {self.total:g} new {self.name}s a minute were "
                              "created in all", (1 - self._all.level) * 60 / self.total)
        self._all.level -= 1
        if bucket is not None:
            bucket.level -= 1
        self.know(owner)
        self._holders[owner] = [1, client]
        return True

    def refund(self, owner: object, client: str | None = None) -> None:
        """A request whose admit returned True was refused after all (a bad body): once every
        request holding `owner`'s count was, the count is given back (to the client charged),
        so heads with fresh tokens and bodies that fail cannot use up the creations other
        clients are let. (`client`: unused, the charged one is kept.)"""
        holders = self._holders.get(owner)
        if holders is None:
            return   # (forgotten meanwhile: nothing to give back)
        holders[0] -= 1
        if holders[0] > 0:
            return   # another request holds it still: it may succeed
        del self._holders[owner]
        self.known.pop(owner, None)
        self._all.level = min(self.total, self._all.level + 1)
        charged = holders[1]
        bucket = self._clients.get(charged) if charged is not None else None
        if bucket is not None:
            bucket.level = min(self.per_client, bucket.level + 1)


class CpuContention:
    """Whether the calling thread's machine has no CPU to spare: over the last `window_s` the
    thread waited for a CPU (its run-queue wait, /proc/thread-self/schedstat) at least `share`
    of the time it wanted one (waiting + running). Sampled at most once per window; where the
    kernel does not say (no schedstat), contended. `share` 0: always contended."""

    PATH = "/proc/thread-self/schedstat"

    def __init__(self, share: float = 0.25, window_s: float = 0.25, clock=time.monotonic,
                 read=None):
        self.share, self.window_s, self.clock = share, window_s, clock
        self.read = read or self._schedstat
        self._at = -float("inf")
        self._last: tuple[int, int] | None = None
        self._verdict = True

    @classmethod
    def _schedstat(cls) -> tuple[int, int] | None:
        """(ns on a CPU, ns waiting for one) of the calling thread, None where unknown."""
        try:
            with open(cls.PATH, "rb") as f:
                ran, waited = f.read().split()[:2]
            return int(ran), int(waited)
        except (OSError, ValueError):
            return None

    def __call__(self) -> bool:
        if self.share <= 0:
            return True
        now = self.clock()
        if now - self._at < self.window_s:
            return self._verdict
        self._at = now
        sample = self.read()
        if sample is None:
            self._last, self._verdict = None, True
            return True
        if self._last is not None:
            ran, waited = sample[0] - self._last[0], sample[1] - self._last[1]
            if ran + waited >= 1_000_000:   # (under 1 ms of wanting a CPU: the last verdict)
                self._verdict = waited >= self.share * (ran + waited)
        self._last = sample
        return self._verdict


class Backpressure(InProgress):
    """Requests in progress per key (a token, a client): up to `free` go straight; past that,
    each waits its turn at `rate` a second (a burst of `burst` at once), so that a key
    flooding on many connections is answered at that pace, its clients idle between answers
    rather than spinning the machine's CPUs; a turn further off than `max_wait_s` is
    RateLimited (429 with Retry-After). A job's own calls, a few at a time, never wait.

    Fair under contention: while another key is active (a request in progress, or one
    answered within `recent_s`) and `contended()` says the machine has no CPU to spare, a key
    past `free` gets its turns at `shared_rate` instead (no burst), waited for up to
    `shared_max_wait_s`, at most `max_waiting` at once; one further off takes no turn and is
    refused after `shared_refusal_wait_s`: a flooding owner's closed loops then sleep, giving
    the CPU back to the keys asking a few at a time, which never wait. (At 2,000 a second one
    owner's 256 local connections, answered as fast as their own CPU let them ask, kept another
    job's leases waiting for a CPU 3.7-11 times as long.) A key may have `allowance(key)`
    requests in progress free of that pace (a job's workers, each asking one at a time: a big
    job's 48 workers were held to 25 a second, 14-40 times below their pace), and only keys
    that `counts(key)` say so are "another key" (an anonymous /health probe once a second
    made every big job wait). A request that names who asks in its body (`deferrable`) is
    not let through on the allowance: under contention its turn is DEFERRED (up to
    `max_waiting` of a key at once) until the body says who, and `settle` then gives it the
    shared turn unless its caller found it free (a worker that earned it by its work: a token
    that joined as many workers as it flooded with connections was a big job by the
    allowance, and its flood went unpaced).
    Used on one event loop (no lock)."""

    def __init__(self, name: str, free: int, rate: float, burst: float, max_wait_s: float,
                 clock=time.monotonic, shared_rate: float | None = None,
                 contended=lambda: True, recent_s: float = 1.0,
                 shared_max_wait_s: float | None = None, max_waiting: int = 1 << 30,
                 shared_refusal_wait_s: float | None = None,
                 allowance: Callable[[object], int] | None = None,
                 counts: Callable[[object], bool] = lambda key: True):
        super().__init__()
        self.allowance, self.counts = allowance, counts
        self._counted = 0   # keys that count with a request in progress
        self.name, self.free, self.max_wait_s, self.clock = name, free, max_wait_s, clock
        self.interval = 1.0 / rate
        self.tolerance = burst * self.interval
        self.shared_interval = 1.0 / shared_rate if shared_rate else None
        self.contended, self.recent_s = contended, recent_s
        self.shared_max_wait_s = shared_max_wait_s or max_wait_s
        self.max_waiting = max_waiting
        self.shared_refusal_wait_s = shared_refusal_wait_s or self.shared_max_wait_s
        self._due: dict[object, float] = {}   # per key: its theoretical next turn (GCRA)
        self._left: OrderedDict[object, float] = OrderedDict()   # keys gone idle, when

    def leave(self, key: object) -> None:
        super().leave(key)
        if key not in self.requests and self.counts(key):
            self._counted -= 1
            now = self._left[key] = self.clock()
            self._left.move_to_end(key)
            self._forget_idle(now)

    def _forget_idle(self, now: float) -> None:
        """Drop the keys idle for longer than recent_s (the oldest first)."""
        while self._left and next(iter(self._left.values())) < now - self.recent_s:
            self._left.popitem(last=False)

    def _others_active(self, key: object, now: float) -> bool:
        """Whether a key other than `key` has a request in progress or had one lately."""
        self._forget_idle(now)
        mine = key in self.requests and self.counts(key)
        return self._counted - mine > 0 or len(self._left) - (key in self._left) > 0

    def turn(self, key: object, deferrable: bool = False, allowed: bool = True) -> float:
        """Count a request of `key` in progress and return how long it waits for its turn
        (0: none; DEFERRED: decided by `settle` once its body is read); RateLimited (nothing
        counted) when that is more than max_wait_s. `allowed`: whether the key's allowance
        may free it (requests bounded per key elsewhere); `deferrable`: see the class."""
        n = self.requests.get(key, 0)
        wait = 0.0
        if n >= self.free:
            now = self.clock()
            # (the allowance last: it may read the store, the others are in memory)
            shared = (self.shared_interval is not None and self._others_active(key, now)
                      and self.contended())
            if shared and deferrable and n < self.max_waiting:
                # settled once its body names who asks (a job's workers joining had no
                # allowance yet: their joins and first leases waited shared turns)
                wait = DEFERRED
            elif shared and allowed and self.allowance is not None and n < self.allowance(key):
                wait = self._wait(key, n, now, False)   # within the allowance: its own pace
            else:
                wait = self._wait(key, n, now, shared)
        if n == 0 and self.counts(key):
            self._counted += 1
        self.requests[key] = n + 1
        return wait

    def settle(self, key: object, free: bool) -> float:
        """The wait of a DEFERRED request of `key` (counted in progress): none when its
        caller found it `free` (earned: the key's turns, maybe far off after a flood of its
        own, are not its), else a turn at the shared pace while that applies, at the key's
        own otherwise; RateLimited past the longest wait (it stays counted until it leaves)."""
        now = self.clock()
        n = self.requests.get(key, 1) - 1   # (the others in progress)
        if free or n < self.free:
            return 0.0
        shared = (self.shared_interval is not None and self._others_active(key, now)
                  and self.contended())
        return self._wait(key, n, now, shared)

    def give_back(self, key: object) -> None:
        """The turn `key` took last at its own pace, given back: its request was never served
        (its client left, or a connection cap closed it, while it waited), and turns that
        stayed taken let abandoned requests push the key's next turn out (a burst of 1,000
        connections, most closed at a cap while they waited, left a loopback /health probe
        refused 429)."""
        due = self._due.get(key)
        if due is not None:
            self._due[key] = max(due - self.interval, self.clock())

    def charge(self, key: object, turns: float) -> None:
        """`turns` more of `key`'s turns at its own pace taken after the fact (what a request
        cost past its one turn)."""
        if turns > 0:
            now = self.clock()
            self._due[key] = max(self._due.get(key, now), now) + turns * self.interval

    def _wait(self, key: object, n: int, now: float, shared: bool) -> float:
        """Take `key`'s next turn (GCRA) with `n` of its requests in progress: the wait."""
        dues, interval, tolerance = self._due, self.interval, self.tolerance
        longest = park = self.max_wait_s
        if shared and self.shared_interval is not None:
            # on the key's one timeline (turns of their own were new turns each time
            # contention came and went), never faster than the key's own pace; waited for
            # longer (a refusal is an answer too, as dear to a flooding client as a
            # lease), up to max_waiting at once
            interval = max(self.interval, self.shared_interval)
            tolerance = min(self.tolerance, interval)
            # a refusal reserves no turn: answered after the longest refusal wait (a
            # client giving up sooner costs nothing), so N connections are refused about
            # N / that a second, not N / longest
            longest, park = self.shared_max_wait_s, self.shared_refusal_wait_s
            if n >= self.max_waiting:
                raise _refused(f"this {self.name} has {n} requests waiting their turns,"
                               " its limit; retry later", park + longest, park)
        due = max(dues.get(key, now), now)
        wait = max(0.0, due - tolerance - now)
        if wait > longest:
            raise _refused(f"this {self.name} has {n} requests in progress and asks"
                           f" faster than {1 / interval:g} a second; retry later",
                           max(wait, park), park)
        if len(dues) >= 65536:   # forget the keys whose turns are past
            for past in [k for k, d in dues.items() if d <= now]:
                del dues[past]
        dues[key] = due + interval
        return wait


DEFERRED = -1.0   # Backpressure.turn: the turn is decided by settle once the body is read


def _refused(what: str, retry_after_s: float, park_s: float) -> RateLimited:
    """A turn refused, to be answered after `park_s` (the longest wait that applied: a refusal
    answered sooner is one more answer a flooding client spins on)."""
    refused = RateLimited(what, retry_after_s)
    refused.park_s = park_s
    return refused


class AnonymousPace:
    """The pace of every request its app does not pace itself (`credentialed(scope)` False: no
    token, a wrong one), whatever its route — /health, a dashboard file, a 404, a request
    refused: each client address (an IPv6 one's /64) gets `per_s` turns a second after a
    burst of `burst`, and all addresses together `per_s_in_all` after as many (a flood from
    many addresses); an answer takes a turn more per `bytes_per_turn` of its body past the
    first (8 loops of plotly.min.js, 3.6 MB, at 41 turns a second slowed uploads 3.5x); a
    request waits its turn parked, and one further off than `max_wait_s` is refused,
    answered 429 after that wait (Backpressure's GCRA). Turns, not requests in
    progress: a cheap route's handler never yields, so each request of a flood found none
    in progress and went free (8 processes looping on /health were answered ~480 a second
    with one in progress free; each answer ~0.2 ms of the event loop, they slowed another
    job's uploads 2.2x: benchmarks/monitor_dos.py). Routes left unpaced by name were each
    found by a flood in turn; here none is. A request whose client left (or that a connection
    cap closed) before its turn came gives its turns back. Used on one event loop (no
    lock)."""

    ALL = "all"   # the key of every anonymous request in `in_all`

    def __init__(self, credentialed: Callable[[Mapping[str, Any]], bool], per_s: float,
                 burst: float, max_wait_s: float = 8.0, per_s_in_all: float | None = None,
                 bytes_per_turn: int = 64 << 10, clock=time.monotonic):
        self.credentialed, self.bytes_per_turn = credentialed, bytes_per_turn
        self.pressure = Backpressure("client address", 0, per_s, burst, max_wait_s,
                                     clock=clock)
        in_all = per_s_in_all or 4 * per_s
        # (a second's turns at once, at least the burst of one address)
        self.in_all = Backpressure("service's anonymous request", 0, in_all,
                                   max(in_all, burst, 1.0), max_wait_s, clock=clock)
        self.max_wait_s = max_wait_s

    def turn(self, key: object) -> float:
        """Count a request of `key` in progress (in its address's and in all) and return how
        long it waits for its turn; RateLimited (nothing counted) past max_wait_s."""
        wait = self.pressure.turn(key)
        try:
            return max(wait, self.in_all.turn(self.ALL))
        except RateLimited:
            self.pressure.give_back(key)
            self.pressure.leave(key)
            raise

    def leave(self, key: object, served: bool = True, sent: int = 0) -> None:
        """A request of `key` is over: answered (`sent` bytes of body: a turn more per
        `bytes_per_turn` past the first) or refused, or (`served` False) its client gone
        before its turn came: then its turns are given back."""
        if not served:
            self.pressure.give_back(key)
            self.in_all.give_back(self.ALL)
        elif sent > self.bytes_per_turn:
            more = sent / self.bytes_per_turn - 1
            self.pressure.charge(key, more)
            self.in_all.charge(self.ALL, more)
        self.pressure.leave(key)
        self.in_all.leave(self.ALL)

    def key(self, scope: Mapping[str, Any]) -> object | None:
        """Whose turn a request waits for: None when credentialed (not paced here), else its
        client's address, an IPv6 one as its /64 (one host holds a whole /64)."""
        if self.credentialed(scope):
            return None
        return self.address(str((scope.get("client") or ("?",))[0]))

    # the key of a client address (the one rule of every per-client share: client_key)
    address = staticmethod(client_key)
