"""The connection guard below every service's app: head, body and send timeouts, idle eviction,
a cap of connections per client and in all, shared fairly among clients at the cap (uvicorn's
protocol class, wrapped)."""

from __future__ import annotations

import asyncio
import json
import re
import select
import socket
import struct
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from stragglers.serving_quota import AnonymousPace, RateLimited, client_key


@dataclass(frozen=True)
class ConnectionLimits:
    """What one connection may hold of a service, enforced below the app (serving.py's
    protocol): uvicorn has a keep-alive timeout between requests but no timeout for a request's
    head or body, and counts idle connections against `limit_concurrency`, so 1,000 sockets
    that send nothing answered every other client 503."""

    max_connections: int = 1000          # open connections; past it one is evicted (below)
    per_client: int = 256                # open connections from one address
    header_timeout_s: float = 10.0       # a request's head, from its first byte (or the accept)
    max_head_bytes: int = 64 * 1024      # a request's head (httptools sets no bound: 431 past it)
    body_min_bytes_per_s: float = 8192.0  # a body slower than this, once past the grace, is cut
    body_grace_s: float = 10.0
    # at the cap, a body this old (the slowest first) or a response unread this long may be
    # closed to admit a new connection: shorter than body_grace_s, or connections opened faster
    # than that, each sending part of a body, would hold the cap against every new client
    cap_grace_s: float = 1.0
    send_stall_s: float = 30.0           # a response the client stops reading for this long is cut
    sweep_s: float = 1.0
    # after an answer that ends a connection (431, 400, 408), what the client still sends is
    # read and dropped this long, its write side shut: closed with bytes unread, the kernel
    # resets the connection and the client's stack drops the answer it had (lingering close)
    linger_s: float = 2.0
    # the answer to a request refused below the app (malformed for the parser, a head over
    # max_head_bytes) is written after this pause, the connection's reads paused meanwhile, as
    # ServiceGuard's own refusals are: answered at once, a client looping on malformed
    # requests took the event loop (and a log line each) as fast as it could send them
    refusal_delay_s: float = 0.25



# the scope key under which the protocol hands ServiceGuard a request target that is not a
# path (absolute-form, `GET http://host/path`): httptools keeps only its path in the scope, so
# the authority that RFC 9112 says names the target (not the Host header) was never checked
TARGET_KEY = "stragglers.request_target"


# the scope key under which the protocol counts the bytes a request's body reads carried
# besides the body (chunk sizes, extensions, trailers): read_bounded counts them toward its limit
FRAMING_KEY = "stragglers.body_framing"


# the scope key under which `park` keeps an event while a request waits for its turn and has
# done nothing yet (backpressure): at a connection cap such a connection is closed first after
# idle ones (503), and one its client closed or a server shutting down ends the wait at once (a flooding owner's requests waiting their turns held every connection of a loopback
# address, and another job's new connection was refused)
PARKED_KEY = "stragglers.parked"


# the scope key an app sets (admit_body) once it has judged a request from its head (its token
# checked): behind ServiceGuard(gate_bodies=True) no body is read, and no `100 Continue` sent,
# before it. uvicorn says 100 Continue at the app's first receive(): a route that read its body
# before the ownership check asked a stranger's client for up to 1 MiB before its 403.
BODY_ADMITTED_KEY = "stragglers.body_admitted"


def admit_body(scope: MutableMapping[str, Any]) -> None:
    """Let the app read the request's body (its head was judged: see BODY_ADMITTED_KEY)."""
    scope[BODY_ADMITTED_KEY] = True


class BodyNotAdmitted(RuntimeError):
    """An app read a request body before admit_body (a route without its head check: a bug,
    answered 500, nothing of the body read)."""


# the scope key the protocol sets on each request of a connection whose client half-closed or
# closed it (its FIN read; the two look the same) before the request was answered: such a
# request's wait for its turn (park) ends at once. A FIN keeps the connection open (a
# half-closed client is answered), so a read abandoned while it waited held its place among
# its address's, and then a turn, for up to the pace's four turns
GONE_KEY = "stragglers.client_gone"


# the scope key under which the protocol gives a request `watch()`: park calls it so that the
# client's FIN or reset is seen at once even while the connection's reads are paused (uvicorn
# reads nothing, the FIN included, while a pipelined request waits behind the one in progress)
WATCH_KEY = "stragglers.watch_hangup"


async def park(scope: dict, seconds: float) -> bool:
    """Wait `seconds` for a request's turn, its connection marked closable meanwhile; False
    when it was closed (by its client, a connection cap or a shutdown) or its client
    half-closed it (then or before): do nothing of it."""
    if scope.get(GONE_KEY):
        return False
    watch = scope.get(WATCH_KEY)
    if watch is not None:
        watch()
    woken = scope[PARKED_KEY] = asyncio.Event()
    try:
        await asyncio.wait_for(woken.wait(), seconds)
    except asyncio.TimeoutError:
        pass
    finally:
        scope.pop(PARKED_KEY, None)   # (cancelled too: no longer parked)
    return not woken.is_set()


def _unpark(conn) -> None:
    """End the wait of a connection's parked request (see park)."""
    woken = _parked_event(conn)
    if woken is not None:
        woken.set()


def _hung_up(conn) -> None:
    """The client of `conn` sent its FIN: its requests not answered yet (the one in progress,
    those pipelined behind it) wait for no turn (GONE_KEY), and one waiting now stops; a
    refusal waiting its turn (the protocol's _g_refuse) is dropped, the connection closed."""
    if getattr(conn, "_g_refusing", None) is not None:
        conn.transport.close()
        return
    cycles = [conn.cycle, *(c for c, _ in getattr(conn, "pipeline", None) or ())]
    for cycle in cycles:
        if cycle is not None and not cycle.response_complete:
            cycle.scope[GONE_KEY] = True
    running = getattr(conn, "_g_scope", None)
    if running is not None:
        running[GONE_KEY] = True
    if _parked(conn):
        _unpark(conn)


# A service's error body from (status, message); the default is `{"error": message}`.
# An error body: text fields, None where a field does not apply (the shard service's `field`).
ErrorBody = dict[str, "str | None"]
ErrorShape = Callable[[int, str], ErrorBody]


def plain_error(status: int, message: str) -> ErrorBody:
    """The error body of a service without a shape of its own."""
    return {"error": message}


# the headers of every response of the services, whoever writes it: ServiceGuard adds them to
# the app's answers, json_response_bytes writes them on the protocol's own
SECURITY_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"content-security-policy",
     b"default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
     b"img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
     b"form-action 'self'; frame-ancestors 'none'"),
]
_SECURITY_LINES = b"".join(k + b": " + v + b"\r\n" for k, v in SECURITY_HEADERS)


def json_response_bytes(status: int, reason: str, message: str,
                        shape: ErrorShape = plain_error, head_only: bool = False) -> bytes:
    """A whole HTTP/1.1 response with a JSON error body, closing the connection, with the
    security headers of the app's answers: every answer the protocol writes itself when there
    is no app to answer (a head the parser refuses, one too large, a timeout, a connection
    refused or closed at a cap) is this one (it wrote nosniff only: a 400 or 408 of the
    same service came without its frame and script policy). `head_only`: the answer to a
    HEAD request, its body left out (RFC 9110 9.3.2; its length said, as the app's are)."""
    body = json.dumps(shape(status, message)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n").encode()
    return head + _SECURITY_LINES + b"\r\n" + (b"" if head_only else body)



def guarded_protocol(base: type, limits: ConnectionLimits,
                     shape: ErrorShape = plain_error,
                     anonymous: Callable[[], AnonymousPace | None] | None = None) -> type:
    """uvicorn's HTTP protocol class `base` with ConnectionLimits enforced (see there); its
    own error bodies (timeouts, a head too large, a request not HTTP) in `shape`; each of its
    refusals waits its client address's turn of the pace `anonymous()` gives (None: none), as
    a request without a credential does in ServiceGuard."""
    book = _Connections(limits)

    class Guarded(base):
        _g_shape = staticmethod(shape)
        _g_limits = limits

        def connection_made(self, transport) -> None:
            super().connection_made(_LingeringTransport(transport, self))
            now = time.monotonic()
            self._g_phase_at, self._g_phase_cycle, self._g_bytes = now, None, 0
            self._g_phase_bytes, self._g_fresh, self._g_served = 0, True, 0
            self._g_payload = 0    # body bytes the parser handed to the app (see data_received)
            self._g_body = None    # (cycle, started_at, bytes then)
            self._g_stalled: float | None = None  # since when the client has not read what it was sent
            self._g_eof = False    # the client half-closed: close once its requests are answered
            self._g_head_over = False
            # what the parser refused of the request, once it did: (part, its words, method)
            self._g_parse_error: tuple[str, str, str | None] | None = None
            parser = getattr(self, "parser", None)
            if parser is not None and hasattr(base, "on_header"):
                self.parser = _HttptoolsErrors(parser, self)
            self._g_lingering: asyncio.TimerHandle | None = None   # see _g_linger
            self._g_refusing: asyncio.TimerHandle | None = None    # see _g_refuse
            self._g_paced: tuple[AnonymousPace, object] | None = None   # its refusal's turn
            self._g_watched: int | None = None   # its descriptor, watched for a hang-up
            conn = getattr(self, "conn", None)
            if conn is not None and hasattr(conn, "next_event"):
                _bound_h11_heads(self, conn)
            app: Any = getattr(self, "app")   # (uvicorn's, untyped here)
            # the scope of the request in progress: httptools' `cycle` is the one parsed
            # last, a pipelined one behind it (whose scope a parked request is not in)
            self._g_scope: dict | None = None

            async def watched_app(scope, receive, send) -> None:
                scope[WATCH_KEY] = watch
                self._g_scope = scope
                try:
                    await app(scope, receive, send)
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if task is None or not task.cancelling():
                        raise   # (not this request's own cancellation)
                    self._g_cancelled(scope)

            def watch() -> None:
                book.watch(self)
            self.app = watched_app
            book.admit(self)

        def _g_cancelled(self, scope: dict) -> None:
            """The request of `scope` cancelled (uvicorn cancels those still running past its
            graceful shutdown timeout, and logs one line saying so): its connection ends here,
            answered 503 unless its response began. Raised on, the cancellation reached
            uvicorn's wrapper, which logged it with a traceback of every frame of the app (an
            event stream open at SIGTERM: 80 lines on the service's stderr)."""
            cycle = self.cycle if self.cycle is not None and self.cycle.scope is scope else None
            started = cycle is None or getattr(cycle, "response_started", False)
            if cycle is not None:
                cycle.disconnected = True   # (uvicorn then neither answers 500 nor logs)
            raw: Any = getattr(self.transport, "raw", self.transport)
            try:
                if not started and not raw.is_closing():
                    raw.write(json_response_bytes(
                        503, "Service Unavailable", "request: the service stopped before it "
                        "was answered; retry once it is back", self._g_shape,
                        scope.get("method") == "HEAD"))
                raw.close()
            except (OSError, RuntimeError):
                pass

        def connection_lost(self, exc) -> None:
            for timer in (self._g_lingering, self._g_refusing):
                if timer is not None:
                    timer.cancel()
            self._g_unpace()
            book.closed(self)
            if _parked(self):
                _unpark(self)   # nobody is left to answer: the request is dropped
            super().connection_lost(exc)

        def shutdown(self) -> None:
            if self._g_lingering is not None or self._g_refusing is not None:
                # answered already, or refused: nothing to wait for
                self.transport.close()
                return
            if _parked(self):   # a request waiting its turn does not hold a shutdown up
                _unpark(self)
                self.transport.close()
                return
            if _body_left(self) and not getattr(self.cycle, "response_started", False):
                # nor one whose body is still to come (the apps act on whole bodies only):
                # a body trickled just above body_min_bytes_per_s held SIGTERM up for as long
                # as it took to arrive
                _close(self)
                return
            super().shutdown()

        def data_received(self, data: bytes) -> None:
            if self._g_lingering is not None or self._g_refusing is not None:
                return   # the rest of a request already refused: dropped (see _g_linger)
            # bytes of the next request's head (not the rest of a body answered before it was
            # read, as a 413 is)
            head = _waiting(self) and not _body_left(self)
            if head and not self._g_phase_bytes:
                self._g_phase_at = time.monotonic()   # the head starts with its first byte
            self._g_bytes += len(data)
            if head:
                self._g_phase_bytes += len(data)
            cycle = self.cycle
            in_body = not head and _body_left(self)
            before = len(cycle.body) if cycle is not None else 0
            held = _unparsed(self)
            super().data_received(data)
            # A body's progress is what reaches the app (the parser's body bytes), not what the
            # wire carried: chunk extensions and framing are dropped by the parser, and a
            # stream of them (1 byte of body per 8 KB) passed the rate check for ever.
            got = len(cycle.body) - before if cycle is not None else 0
            self._g_payload += max(got, 0)
            if in_body and cycle is not None and self.cycle is cycle:
                # what the body's reads carried besides its bytes, counted toward the app's body
                # limit (read_bounded): extensions are no free channel. (Not a read that also
                # began the next request, pipelined: its head is no part of this body; like the
                # read that brings a head, one such read per request goes uncounted.)
                # (h11 keeps a pipelined request's bytes unparsed until this one is answered)
                extra = len(data) - got - (_unparsed(self) - held)
                scope = cycle.scope
                scope[FRAMING_KEY] = scope.get(FRAMING_KEY, 0) + max(extra, 0)
            if head and self._g_phase_bytes > limits.max_head_bytes and _waiting(self) \
                    and not self.transport.is_closing():
                _close(self, 431, "Request Header Fields Too Large",
                       f"request head: more than {limits.max_head_bytes} bytes", linger=True)

        def _g_refuse(self, answer: bytes) -> None:
            """Write `answer` (a whole response ending the connection) after refusal_delay_s
            or its address's turn, whichever is later (_g_turn), reading nothing meanwhile,
            then linger (see _g_linger)."""
            if self._g_refusing is not None or self._g_lingering is not None \
                    or self.transport.is_closing():
                return
            try:
                self.transport.pause_reading()
            except (OSError, RuntimeError):
                pass

            loop = asyncio.get_running_loop()
            delay = max(limits.refusal_delay_s, self._g_turn())
            due = time.monotonic() + delay
            if delay > limits.refusal_delay_s:
                book.watch(self)   # (its reads paused: its client leaving is seen at once)

            def answer_now() -> None:
                # (a loop's timer may fire early: libuv's clock is read once an iteration, and
                # on a busy host that reading is stale; the pause holds on the real clock)
                left = due - time.monotonic()
                if left > 0:
                    self._g_refusing = loop.call_later(left, answer_now)
                    return
                self._g_unpace()
                if not self.transport.is_closing():
                    self.transport.write(answer)
                    self._g_linger()
            self._g_refusing = loop.call_later(delay, answer_now)

        def _g_turn(self) -> float:
            """How long a refusal of this connection waits for its client address's turn of
            the anonymous pace, taken now (held until answered: _g_unpace); past the pace's
            longest wait, nothing is taken and it waits that long. A request the parser
            refused never reached ServiceGuard's pace: a flood of malformed ones, a connection
            each, was answered as fast as connections came (after the refusal pause only),
            each an accept, a parse and a close of the event loop's, unpaced."""
            pace = anonymous() if anonymous is not None else None
            if pace is None:
                return 0.0
            key = pace.address(str((self.client or ("?",))[0]))
            try:
                wait = pace.turn(key)
            except RateLimited as exc:
                return exc.park_s or pace.max_wait_s
            self._g_paced = (pace, key)
            return wait

        def _g_unpace(self) -> None:
            """The refusal's turn is over (answered, or its client gone: the request was read
            and refused all the same, so its turn stays taken)."""
            if self._g_paced is not None:
                pace, key = self._g_paced
                self._g_paced = None
                pace.leave(key)

        def _g_linger(self) -> None:
            """End the connection after the answer written last: the write side shut once it
            is sent, the client's further bytes dropped until it closes or linger_s passes."""
            if self._g_lingering is not None or self.transport.is_closing():
                return
            unset = getattr(self, "_unset_keepalive_if_required", None)
            if unset is not None:
                unset()   # (its handler would write to the shut side)
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True   # a pipelined request in progress: not answered
                cycle.message_event.set()
            try:
                self.transport.write_eof()
                self.transport.resume_reading()   # (paused while a pipelined request ran)
            except (OSError, RuntimeError, NotImplementedError):
                self.transport.close()
                return
            self._g_lingering = asyncio.get_running_loop().call_later(
                limits.linger_s, self.transport.close)
            book.linger(self)

        if hasattr(base, "on_header"):   # httptools: the parser's callbacks (h11 bounds its own)
            def on_message_begin(self) -> None:
                self._g_head_size, self._g_head_over, self._g_trailers = 0, False, False
                self._g_url_seen = False   # (the method is parsed once the target begins)
                super().on_message_begin()

            def on_url(self, url: bytes) -> None:
                self._g_url_seen = True
                self._g_count_head(len(url))
                super().on_url(url)

            def on_header(self, name: bytes, value: bytes) -> None:
                self._g_count_head(len(name) + len(value) + 4)
                if getattr(self, "_g_trailers", False):
                    # a chunked body's trailer field: never one of the request's headers
                    # (RFC 9110 6.5.1; h11 drops them). uvicorn appended it to the list its
                    # scope holds, so when the whole request came in one read the app saw it:
                    # a trailer 'Authorization' authorized a write that a slower network, or
                    # h11, refused 401.
                    return
                super().on_header(name, value)

            def _g_count_head(self, n: int) -> None:
                # counted as the parser reads the head, whatever the reads' sizes: a head over
                # the bound arriving whole in one read was parsed and served before the check
                # of data_received (which counts only heads still incomplete after a read)
                self._g_head_size += n
                if self._g_head_size > limits.max_head_bytes:
                    self._g_head_over = True
                    raise _HeadTooLarge()   # the parser stops: send_400_response answers 431

        def eof_received(self) -> bool | None:
            if self._g_lingering is not None:
                self.transport.close()   # the client has read the answer and stopped
                return None
            # A client that half-closes once its request is sent (shutdown(SHUT_WR)) is
            # answered: the transport used to close at once, after the app had acted on the
            # request (a lease taken, nobody told). A request whose body is still to come is
            # never completed: closed.
            cycle = self.cycle
            whole = cycle is not None and not cycle.response_complete \
                and not getattr(cycle, "more_body", False)
            if (whole and not _waiting(self)) or getattr(self, "pipeline", None):
                self._g_eof = True
                _hung_up(self)
                return True   # keep the write side open
            return super().eof_received()

        def pause_writing(self) -> None:
            # the transport holds more than its high-water mark unsent: the client stopped
            # reading (a response uvicorn awaits without end, holding its connection busy)
            if self._g_stalled is None:
                self._g_stalled = time.monotonic()
            super().pause_writing()

        def resume_writing(self) -> None:
            self._g_stalled = None
            super().resume_writing()

        def on_response_complete(self) -> None:
            book.fresh.pop(self, None)
            super().on_response_complete()
            self._g_phase_at = time.monotonic()
            if self.cycle is None or self.cycle.response_complete:
                # waiting for the next head; not when a pipelined request started (h11 starts
                # it within on_response_complete, httptools' `cycle` is the last one parsed):
                # taken for an idle connection, its client's FIN closed it unanswered
                self._g_phase_cycle = self.cycle
            self._g_phase_bytes, self._g_fresh, self._g_body = 0, False, None
            self._g_served += 1
            if self._g_eof and self.cycle is not None and self.cycle.response_complete \
                    and not getattr(self, "pipeline", None):
                self.transport.close()   # half-closed, every request answered
            elif self._g_eof:
                _hung_up(self)   # (h11 parses a pipelined request only now, after the FIN)

        def on_headers_complete(self) -> None:
            # (httptools' protocol only: h11's leaves the whole target in the scope's path)
            self._g_trailers = True   # header fields from here on are trailers (httptools)
            if self.parser.get_http_version() == "1.0":
                # RFC 9110 10.1.1: an HTTP/1.0 request's 100-continue expectation is ignored
                # (h11 does); uvicorn's httptools path sent it an HTTP/1.1 interim answer
                self.expect_100_continue = False
            url = getattr(self, "url", b"")
            if url and not url.startswith(b"/"):
                self.scope[TARGET_KEY] = bytes(url)
            super().on_headers_complete()

        def send_400_response(self, msg: str) -> None:
            # (the parser refused the request: after a pause, as every refusal below the app)
            refused, self._g_parse_error = self._g_parse_error, None
            method = refused[2] if refused is not None else self._g_method()
            if getattr(self, "_g_head_over", False):
                self._g_refuse(json_response_bytes(
                    431, "Request Header Fields Too Large",
                    f"request head: more than {limits.max_head_bytes} bytes", self._g_shape,
                    method == "HEAD"))
                return
            # the parser's own words, naming what it refused (uvicorn answered every refusal
            # "Invalid HTTP request received.", whatever was wrong)
            if refused is None:
                text = f"request: {msg}"
            else:
                part, said = refused[:2]
                text = f"request: the HTTP parser refused its {part}: {said}; {_EXPECTED[part]}"
            self._g_refuse(json_response_bytes(400, "Bad Request", text, self._g_shape,
                                               method == "HEAD"))

        def _g_method(self) -> str | None:
            """The method of the request an answer written here refuses, where it is known
            (its answer then has no body if it is HEAD): the request in progress, else the
            head being read, once the parser is past its method."""
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete and not _waiting(self):
                return cycle.scope.get("method")
            if hasattr(base, "on_header"):   # httptools
                parser = getattr(self, "parser", None)
                if parser is None or not getattr(self, "_g_url_seen", False):
                    return None
                return parser.get_method().decode("latin-1")
            conn = getattr(self, "conn", None)
            return _h11_method(conn) if conn is not None else None

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded


def _bound_h11_heads(protocol, conn) -> None:
    """h11's Connection of `protocol` refusing (431, as send_400_response words it) every
    request whose target and headers pass max_head_bytes: h11 bounds only a head still
    incomplete, so one that arrived whole in one read, or pipelined, was served."""
    import h11

    real = conn.next_event
    limit = protocol._g_limits.max_head_bytes

    def next_event():
        # (read before h11 takes the head's bytes from its buffer: the method of a head it
        # refuses, a HEAD's answer then without a body)
        method, body = _h11_method(conn), conn.their_state is h11.SEND_BODY
        try:
            event = real()
        except h11.RemoteProtocolError as exc:
            # h11's own bound on a head still incomplete (h11_max_incomplete_event_size, made
            # max_head_bytes by uvicorn_server): answered 431 like the others, not 400
            protocol._g_head_over = exc.error_status_hint == 431
            part = "body" if body else "request line" if \
                str(exc).startswith("illegal request line") else "head"
            protocol._g_parse_error = (part, _said(str(exc)), method)
            raise
        if isinstance(event, h11.Request) and len(event.target) + sum(
                len(k) + len(v) + 4 for k, v in event.headers) > limit:
            protocol._g_head_over = True
            protocol._g_parse_error = ("head", "too large",
                                       event.method.decode("latin-1"))
            raise h11.RemoteProtocolError("request head too large", 431)
        return event
    conn.next_event = next_event


def _h11_method(conn) -> str | None:
    """The method that begins the head h11 has not parsed yet (None: not there yet, or no
    head waits)."""
    import h11

    if conn.their_state is not h11.IDLE:
        return None
    # (h11's ReceiveBuffer keeps its bytes in `_data`, as _unparsed counts them)
    data = getattr(getattr(conn, "_receive_buffer", None), "_data", None)
    if data is None:
        return None
    method, space, _ = bytes(data[:40]).lstrip(b"\r\n").partition(b" ")
    return method.decode("latin-1") if space and method.isalpha() else None


# what each part of a request the parser refuses was expected to be (its answer's last words)
_EXPECTED = {
    "request line": "expected METHOD /path HTTP/1.1",
    "target": "expected a path of visible ASCII characters (others %-encoded)",
    "head": "expected HTTP/1.1 header lines (RFC 9112)",
    "body": "expected the body framed as its head declares (RFC 9112)",
}


def _said(text: str, limit: int = 120) -> str:
    """A parser's message fit for an answer: one line of printable ASCII, at most `limit`
    characters (h11 quotes the request's own bytes, up to a whole head)."""
    text = re.sub(r"bytearray\((b['\"].*)\)$", r"\1", text.strip())
    text = "".join(c if " " <= c <= "~" else c.encode("unicode_escape").decode("ascii")
                   for c in text)
    return text if len(text) <= limit else text[:limit] + "..."


class _HttptoolsErrors:
    """httptools' parser of a guarded protocol, keeping what it refused (the protocol's
    _g_parse_error) before uvicorn answers: uvicorn drops the parser's error and its words."""

    __slots__ = ("raw", "_protocol")

    def __init__(self, raw, protocol):
        self.raw, self._protocol = raw, protocol

    def __getattr__(self, name: str):
        return getattr(self.raw, name)

    def feed_data(self, data: bytes) -> None:
        try:
            self.raw.feed_data(data)
        except Exception as exc:
            self._protocol._g_parse_error = self._refused(exc)
            raise

    def _refused(self, exc: Exception) -> tuple[str, str, str | None] | None:
        """(part, the parser's words, method) of a request `exc` refuses; None for an upgrade."""
        import httptools

        if not isinstance(exc, httptools.HttpParserError):
            return None   # (HttpParserUpgrade: uvicorn's own path)
        cause = exc.__context__
        if isinstance(exc, httptools.HttpParserCallbackError) and \
                isinstance(cause, httptools.HttpParserError):
            # a callback's own parse failed (uvicorn's parse_url of a CONNECT's authority)
            exc = cause
        said = _said(str(exc))
        if isinstance(exc, httptools.HttpParserInvalidMethodError):
            return "request line", said, None   # (get_method() is then a stale one)
        part = "target" if isinstance(exc, httptools.HttpParserInvalidURLError) \
            else "body" if getattr(self._protocol, "_g_trailers", False) else "head"
        method = self.raw.get_method().decode("latin-1")
        if method == "PRI":   # (llhttp's words for it: "Pause on PRI/Upgrade")
            part, said = "request line", "the HTTP/2 preface (PRI *) is not served here"
        return part, said, method


class _LingeringTransport:
    """The transport a guarded protocol sees: its close() while the request's body is still
    arriving lingers (the protocol's _g_linger) instead of closing with bytes unread. The app's
    answers that end a connection before reading the body (413, 401/403 on a restore) reached
    a client that sends its whole body before reading (urllib, curl) as a connection reset:
    the kernel resets a socket closed with bytes unread, and the client's stack drops the
    answer it had received."""

    __slots__ = ("raw", "_protocol")

    def __init__(self, raw, protocol):
        self.raw, self._protocol = raw, protocol

    def __getattr__(self, name: str):
        return getattr(self.raw, name)

    def is_closing(self) -> bool:
        return self.raw.is_closing() or self._protocol._g_lingering is not None

    def close(self) -> None:
        p = self._protocol
        if p._g_lingering is None and p._g_refusing is None and not self.raw.is_closing() \
                and _body_left(p):
            p._g_linger()
            return
        self.raw.close()


class _HeadTooLarge(Exception):
    """Raised from a parser callback: the request head passed ConnectionLimits.max_head_bytes."""


class _Connections:
    """The open connections of one server, swept every `sweep_s` on its event loop."""

    def __init__(self, limits: ConnectionLimits):
        self.limits = limits
        # (connections are uvicorn protocol objects with the guard's _g_ fields: Any)
        self.open: dict[Any, None] = {}     # insertion-ordered
        self.fresh: dict[Any, None] = {}    # those that never completed a request, oldest first
        self.by_client: dict[str, int] = {}
        # answered (a 503 at a cap, a 408, a 431...) and lingering (see _g_linger): out of
        # `open` and the client's count, but each holds a descriptor until it is closed,
        # oldest first
        self.lingering: dict[Any, None] = {}
        self._timer: asyncio.TimerHandle | None = None
        self.watched: dict[int, Any] = {}   # descriptor -> connection (watch)
        self._hangup_poll: Any = None
        self._no_epoll = False

    def admit(self, conn) -> None:
        client = _client(conn)
        self.open[conn] = None
        self.fresh[conn] = None
        self.by_client[client] = self.by_client.get(client, 0) + 1
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.limits.sweep_s,
                                                                self.sweep)
        self._shed()
        if self.by_client[client] > self.limits.per_client:
            self._make_room(conn, client)
        if len(self.open) > self.limits.max_connections and not conn.transport.is_closing():
            self._make_room_fairly(conn, client)

    def forget(self, conn) -> None:
        """Take `conn` out of the open connections and its client's count."""
        self.fresh.pop(conn, None)
        if self.open.pop(conn, 1) is None:
            client = _client(conn)
            self.by_client[client] -= 1
            if not self.by_client[client]:
                del self.by_client[client]

    def linger(self, conn) -> None:
        """`conn` was answered and lingers: no longer open, still a descriptor (_shed)."""
        self.forget(conn)
        self.lingering[conn] = None

    def closed(self, conn) -> None:
        """`conn` is closed (its connection_lost): its descriptor is free."""
        self.forget(conn)
        self.lingering.pop(conn, None)
        fd = conn._g_watched
        if fd is not None and self.watched.get(fd) is conn:
            # (closed, the descriptor left the epoll set already; a new connection given
            # the same number since is another entry, kept)
            del self.watched[fd]
            try:
                self._hangup_poll.unregister(fd)
            except (OSError, ValueError):
                pass

    def watch(self, conn) -> None:
        """Tell `conn`'s client hanging up (its FIN or a reset) at once (_hung_up), even while
        its reads are paused: an epoll set of such connections' sockets, waiting for
        EPOLLRDHUP only (not for data: a pipelined request unread is no event), read by the
        event loop. Where there is no epoll, only a FIN read (eof_received) tells."""
        poll = self._hangup_poll
        if poll is None:
            if not hasattr(select, "epoll") or self._no_epoll:
                return
            try:
                poll = self._hangup_poll = select.epoll()
                asyncio.get_running_loop().add_reader(poll.fileno(), self._hangups)
            except (OSError, RuntimeError, NotImplementedError):
                self._no_epoll, self._hangup_poll = True, None
                return
        sock = conn.transport.get_extra_info("socket")
        try:
            fd = sock.fileno() if sock is not None else -1
        except OSError:
            return
        if fd < 0 or self.watched.get(fd) is conn:
            return
        mask = select.EPOLLRDHUP   # (EPOLLHUP and EPOLLERR are reported whatever the mask)
        try:
            if fd in self.watched:   # a closed connection's number, reused by this one
                poll.modify(fd, mask)
            else:
                poll.register(fd, mask)
        except FileExistsError:
            poll.modify(fd, mask)
        except OSError:
            return
        self.watched[fd] = conn
        conn._g_watched = fd

    def _hangups(self) -> None:
        """The watched connections whose clients hung up: each told once (_hung_up)."""
        poll = self._hangup_poll
        if poll is None:
            return
        for fd, _ in poll.poll(0):
            conn = self.watched.pop(fd, None)
            try:
                poll.unregister(fd)
            except OSError:
                pass
            if conn is not None and not conn.transport.is_closing():
                _hung_up(conn)

    def _shed(self) -> None:
        """Close lingering connections at once, oldest first, while they and the open ones
        pass max_connections: answered already, they hold descriptors the new one needs.
        Lingering out of the count, connections evicted for room kept theirs up to linger_s:
        past RLIMIT_NOFILE (max_connections set below it) accept() failed and uvloop reset
        every new client. (The one evicted or refused for the newest connection may linger
        on, one past the cap, until the next connection needs its descriptor: closed at
        once, a request its client sent meanwhile met a reset, not its 503.)"""
        while self.lingering and \
                len(self.open) + len(self.lingering) > self.limits.max_connections:
            c = next(iter(self.lingering))
            del self.lingering[c]
            raw = getattr(c.transport, "raw", c.transport)
            try:
                if raw.get_write_buffer_size():
                    _close(c, abort=True)   # its client does not read: a close would wait
                else:
                    raw.close()   # (its answer sent and its write side shut: a FIN already)
            except Exception:   # noqa: BLE001 - a transport already gone
                pass

    def _make_room_fairly(self, new, client: str) -> None:
        """At the cap of all connections, room for `new` is made by the client holding the
        most (one of its idle or slow ones, else, if it holds more than `new`'s client, its
        oldest busy one), so that a client holding few connections is never locked out by one
        holding many (from several addresses, busy connections could otherwise fill the cap past
        any per-client share); past that, the oldest idle one anywhere, else `new` is refused."""
        mine = self.by_client.get(client, 0)
        # the largest holders first (among equals `new`'s own client first)
        hogs = sorted(((n, c) for c, n in self.by_client.items() if n >= mine),
                      key=lambda nc: (-nc[0], nc[1] != client))
        for n, other in hogs:
            victim = self._evictable(new, other)
            if victim is not None:
                self._evict(victim)
                return
        if hogs[0][0] > mine:
            busy = next((c for c in self.open if c is not new and _client(c) == hogs[0][1]
                         and not c.transport.is_closing()), None)
            if busy is not None:
                started = getattr(busy.cycle, "response_started", False)
                _close(busy, None if started else 503, "Service Unavailable",
                       "request: the service is full of connections and this client holds "
                       "the most of them; retry later", abort=started)
                self.forget(busy)
                return
        idle = self._evictable(new, None, idle_only=True)
        if idle is not None:
            self._evict(idle)
            return
        _close(new, 503, "Service Unavailable", "request: too many connections are busy; "
               "retry later")
        self.forget(new)

    def _evictable(self, new, client: str | None, idle_only: bool = False):
        """The connection of `client` (None: any) best closed to make room: the oldest that
        never sent a whole request, else an idle keep-alive one (oldest first), else one whose
        client stopped reading its response, else one whose request waits its turn (park),
        else the slowest body past its grace (unless `idle_only`); None."""
        now = time.monotonic()
        # the oldest connection that never sent a whole request, found without a scan of all
        for c in self.fresh:
            if c is not new and _waiting(c) and not c.transport.is_closing() and \
                    c._g_refusing is None and (client is None or _client(c) == client):
                return c
        best, best_key = None, None
        for c in self.open:
            if c is new or (client is not None and _client(c) != client) \
                    or c.transport.is_closing():
                continue
            if c._g_stalled is not None:
                if idle_only or now - c._g_stalled < self.limits.cap_grace_s:
                    continue
                key = (2, c._g_stalled)
            elif c._g_refusing is not None:
                # its refusal waits its address's turn (_g_turn): as a parked request, the
                # last to go (closed first, its client reconnected at once: refusals unpaced)
                if idle_only:
                    continue
                key = (3, c._g_phase_at)
            elif _waiting(c):
                key = (0 if c._g_fresh else 1, c._g_phase_at)
            elif _parked(c):
                key = (3, c._g_phase_at)
            elif idle_only:
                continue
            elif c._g_body is not None and now - c._g_body[1] >= self.limits.cap_grace_s:
                key = (4, (c._g_payload - c._g_body[2]) / max(now - c._g_body[1], 1e-3))
            else:
                continue
            if best_key is None or key < best_key:
                best, best_key = c, key
        return best

    def _evict(self, c) -> None:
        """Close `c` to make room (a 503, unless its client stopped reading its response)."""
        if c._g_stalled is not None:
            _close(c, abort=True)
        elif _waiting(c):
            # answered all the same: "idle" is what this end has read, and a request its
            # client sent meanwhile (a pool reusing it, a new connection's first request on
            # its way) met a bare close, a ReadError with nothing to say why
            _close(c, 503, "Service Unavailable", "request: the service is full of "
                   "connections and this one was idle; retry later")
        elif _parked(c):
            _unpark(c)   # the app, woken, does nothing of it
            _close(c, 503, "Service Unavailable", "request: still waiting its turn while the"
                   " service is full of connections; retry later")
        else:
            _close(c, 503, "Service Unavailable", "request body: too slow while the "
                   "service is full of connections; retry later")
        self.forget(c)

    def _make_room(self, new, client: str | None) -> None:
        """Close one connection (of `client`; None: any) to make room for `new` (see
        _evictable); when every one is busy, `new` is refused (503, JSON)."""
        victim = self._evictable(new, client)
        if victim is not None and (_parked(victim) or victim._g_refusing is not None) \
                and len(self.open) <= self.limits.max_connections:
            # its requests wait their turns (no work, a descriptor each; the cap of all bounds
            # them): closing one made its client reconnect at once, a loop of evictions that
            # spun the CPUs as the flood it replaced
            return
        if victim is not None:
            self._evict(victim)
            return
        _close(new, 503, "Service Unavailable", "request: too many connections are "
               "busy (from this client)" if client else "request: too many connections "
               "are busy; retry later")
        self.forget(new)

    def sweep(self) -> None:
        self._timer = None
        now, lim = time.monotonic(), self.limits
        for c in list(self.open):
            if c.transport.is_closing() or c._g_lingering is not None \
                    or c._g_refusing is not None:
                continue   # (a lingering or refused one closes itself)
            if c._g_stalled is not None and now - c._g_stalled > lim.send_stall_s:
                # (aborted: a close would wait for the unsent bytes to be taken, for ever; the
                # app may count its response complete once all of it is in the transport)
                _close(c, abort=True)
                continue
            if _waiting(c):
                if _body_left(c):   # a body answered before it was read, still coming
                    if now - c._g_phase_at > lim.header_timeout_s:
                        _close(c)
                    continue
                if not c._g_phase_bytes and not c._g_fresh:
                    continue   # idle between requests: uvicorn's keep-alive timeout
                if now - c._g_phase_at > lim.header_timeout_s:
                    if c._g_phase_bytes:
                        _close(c, 408, "Request Timeout", f"request head: not complete "
                               f"within {lim.header_timeout_s:g} s", linger=True)
                    else:
                        _close(c)
                continue
            cycle = c.cycle
            if cycle is None or not getattr(cycle, "more_body", False) \
                    or cycle.response_complete:
                continue
            if c._g_body is None or c._g_body[0] is not cycle:
                c._g_body = (cycle, now, c._g_payload)
                continue
            if getattr(c.flow, "read_paused", False):   # the app is not reading: not the client's fault
                c._g_body = (cycle, c._g_body[1] + lim.sweep_s, c._g_body[2])
                continue
            spent = now - c._g_body[1]
            if spent > lim.body_grace_s and \
                    c._g_payload - c._g_body[2] < lim.body_min_bytes_per_s * spent:
                _close(c, None if getattr(cycle, "response_started", False) else 408,
                       "Request Timeout", f"request body: slower than "
                       f"{lim.body_min_bytes_per_s:g} bytes/s")
        if self.open:
            self._timer = asyncio.get_running_loop().call_later(lim.sweep_s, self.sweep)


def _unparsed(conn) -> int:
    """Bytes received and not parsed yet (h11's buffer; httptools parses all it is given)."""
    buffer = getattr(getattr(conn, "conn", None), "_receive_buffer", None)
    return len(buffer) if buffer is not None else 0


def _waiting(conn) -> bool:
    """Whether a connection waits for a request's head (no request in progress)."""
    return conn.cycle is conn._g_phase_cycle


def _parked(conn) -> bool:
    """Whether a connection's request waits for its turn (the app set PARKED_KEY)."""
    return _parked_event(conn) is not None


def _parked_event(conn) -> asyncio.Event | None:
    """The event a connection's request waiting for its turn waits on (park); None."""
    cycle = conn.cycle
    for scope in (getattr(conn, "_g_scope", None),
                  None if cycle is None or cycle.response_complete else cycle.scope):
        woken = (scope or {}).get(PARKED_KEY)
        if isinstance(woken, asyncio.Event):
            return woken
    return None


def _body_left(conn) -> bool:
    """Whether the current request's body is still arriving."""
    return conn.cycle is not None and getattr(conn.cycle, "more_body", False)


def _client(conn) -> str:
    """The client a connection comes from as the caps count it ('?' when unknown): an IPv6
    address's /64 (client_key, the anonymous pace's rule: counted per address, one host took
    a share per address of its /64, and at the cap of all none of its was "the most")."""
    return client_key(str((conn.client or ("?",))[0]))


def _close(conn, status: int | None = None, reason: str = "", message: str = "",
           abort: bool = False, linger: bool = False) -> None:
    """Close a connection, answering `status` first unless None; `linger`: `status` answered
    after the refusal pause, its client's unread bytes drained (the protocol's _g_refuse),
    else closed at once (at a cap)."""
    answer = b""
    if status is not None:
        method = conn._g_method() if hasattr(conn, "_g_method") else None
        answer = json_response_bytes(status, reason, message,
                                     getattr(conn, "_g_shape", plain_error), method == "HEAD")
    if linger and answer and not abort:
        # (a head over the bound, not complete in time; _g_refuse does nothing to a connection
        # refused or lingering already)
        conn._g_refuse(answer)
        return
    lingering = getattr(conn, "_g_lingering", None) is not None
    try:
        if answer and not lingering:
            conn.transport.write(answer)
        if status is not None and not abort and not lingering:
            # the answer's write side shut and the client's bytes read and dropped until it
            # closes (or linger_s): closed at once with its request unread (sent as it was
            # refused or evicted), the kernel reset the connection and the client's stack
            # dropped the 503 it had, a ReadError or "disconnected without a response" (seen
            # at 256+ connections from one address). Out of the open ones now, room is made,
            # but its descriptor is held until it closes: _Connections._shed
            conn._g_linger()
            conn.connections.discard(conn)
        elif abort:
            # a reset, not a FIN queued behind the bytes the client does not take (the kernel
            # would keep those for minutes): SO_LINGER 0, then the socket is closed
            sock = conn.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.transport.abort()
        else:
            # (at once, even with a body still arriving: a connection closed at a cap makes
            # room now, it does not linger)
            getattr(conn.transport, "raw", conn.transport).close()
        # gone from uvicorn's count now (its connection_lost comes later): its own limit
        # would otherwise answer the connection admitted in its place with a plain-text 503
        conn.connections.discard(conn)
    except Exception:   # noqa: BLE001 - a transport already gone
        pass
    cycle = getattr(conn, "cycle", None)
    if cycle is not None and not cycle.response_complete:
        cycle.disconnected = True
        cycle.message_event.set()
