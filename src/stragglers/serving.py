"""What the HTTP services and their clients share: server, socket, bodies, tokens, URLs."""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import json
import logging
import os
import re
import sqlite3
import stat
import signal
import socket
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from stragglers.errors import EnvironmentFailure, InputError

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (only this machine can connect); InputError
    naming --host when it is no address or name this machine can resolve."""
    try:
        infos = socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        raise _unresolvable(host) from None
    return all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def check_url(url: object, source: str, field: str = "url") -> urllib.parse.SplitResult:
    """A service's base URL split into parts; InputError naming `source` and `field` unless
    it is http(s)://host[:port][/path] (a bad port or bracket was an internal error)."""
    problem = f"expected http://host:port, got {str(url)[:200]!r}"
    if not isinstance(url, str):
        raise InputError(source, field, problem)
    try:
        parsed = urllib.parse.urlsplit(url)
        parsed.port   # noqa: B018 - raises ValueError for a port that is not one
    except ValueError:
        raise InputError(source, field, problem) from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise InputError(source, field, problem)
    return parsed


def _unresolvable(host: str) -> InputError:
    return InputError("--host", None, f"{host!r} is not an address or a host name this machine "
                      "can resolve")


def base_url(host: str, port: int) -> str:
    """http://host:port, with an IPv6 address in brackets and a wildcard as loopback."""
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


# A bearer token as RFC 6750 allows it (b64token characters), long enough not to be guessed.
TOKEN_PATTERN = re.compile(r"[A-Za-z0-9._~+/=-]{16,512}")


MAX_TOKEN_FILE_BYTES = 4096


def read_token_file(path: Path | str | None, option: str = "--token-file") -> str | None:
    """The token a file holds (its first line, stripped), never taken from the command line
    (it would show in `ps`); one-line InputError naming the file and `option` when the file
    cannot be read, is not a regular file, can be read or written by group or others (the
    error says the chmod that fixes it), or its first line is not a token."""
    if path is None:
        return None
    try:
        # O_NONBLOCK: a FIFO named as the token file must not block the start
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        raise InputError(path, None, f"{option}: cannot read the token file "
                         f"({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(path, None, f"{option}: not a regular file (expected a file "
                             "holding the token)")
        if os.name == "posix" and st.st_mode & 0o077:
            raise InputError(path, None, f"{option}: group or others may read or write it "
                             f"(mode {stat.S_IMODE(st.st_mode):04o}); run `chmod 600 {path}`")
        data = os.read(fd, MAX_TOKEN_FILE_BYTES + 1)
    finally:
        os.close(fd)
    try:
        token = data[:MAX_TOKEN_FILE_BYTES].decode("ascii").lstrip("\r\n").split("\n", 1)[0].strip()
    except UnicodeDecodeError:
        token = ""
    if not TOKEN_PATTERN.fullmatch(token):
        raise InputError(path, None, f"{option}: expected one line of 16-512 characters of "
                         "[A-Za-z0-9._~+/=-] as the token (its first line is used)")
    return token


def listen_socket(host: str, port: int, backlog: int = 1024) -> socket.socket:
    """A bound, listening TCP socket; EnvironmentFailure naming host:port when it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Linux copies TCP_NODELAY to accepted sockets; without it Nagle + delayed ACK add ~40 ms
    # to every keep-alive request whose response uvicorn writes in two pieces.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except socket.gaierror:
        sock.close()
        raise _unresolvable(host) from None
    except OSError as exc:
        sock.close()
        raise EnvironmentFailure(f"{host}:{port}", f"cannot listen there ({exc.strerror})") from None
    sock.listen(backlog)
    return sock


def serve_in_thread(server, sock: socket.socket, name: str, what: str,
                    timeout: float = 60.0) -> threading.Thread:
    """Run a uvicorn.Server on `sock` in a daemon thread; return once it answers requests.

    EnvironmentFailure naming `what` when it dies or has not started within `timeout` seconds.
    """
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=name,
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise EnvironmentFailure(what, "did not start")
        time.sleep(0.01)
    return thread


def serve_in_foreground(server, sock: socket.socket) -> None:
    """Run a uvicorn.Server on `sock` until SIGINT or SIGTERM, letting the caller's `finally`
    run (stop threads, close the store) after either.

    uvicorn shuts down gracefully on a signal, then restores the handler it found and raises the
    signal again; for SIGTERM that handler is the default one, which kills the process at once —
    before the caller's cleanup. With this handler in place the signal becomes SystemExit(143).
    """
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        server.run(sockets=[sock])
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum, frame) -> None:
    sys.exit(128 + signal.SIGTERM)


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
    sweep_s: float = 1.0


def uvicorn_server(app, *, max_connections: int, keep_alive_s: float, http: str = "httptools",
                   loop: str = "uvloop", graceful_s: float | None = None,
                   limits: ConnectionLimits | None = None,
                   allowed_hosts: list[str] | tuple[str, ...] | None = None):
    """The uvicorn.Server every service runs: quiet logs, no lifespan, bounded connections.

    httptools + uvloop by default: the C parser and event loop (the pure-Python h11 path is
    ~2x slower). The app runs behind ServiceGuard (Host allow-list, security headers, JSON
    error bodies) and the protocol behind ConnectionLimits (head and body timeouts, a cap per
    client and in all; at the cap an idle connection is closed to admit a new one, so idle
    sockets cannot lock clients out). `allowed_hosts`: Host names accepted besides the
    loopback names (None: any Host when the socket is not a loopback one).
    """
    import uvicorn

    limits = limits or ConnectionLimits(max_connections=max_connections,
                                        per_client=min(256, max_connections))
    config = uvicorn.Config(ServiceGuard(app, allowed_hosts), http=http, loop=loop,
                            log_level="warning", access_log=False, lifespan="off",
                            timeout_keep_alive=keep_alive_s,
                            timeout_graceful_shutdown=graceful_s,
                            # the guard keeps connections <= max_connections by evicting idle
                            # ones; uvicorn's own limit (plain-text 503s) is never reached
                            limit_concurrency=limits.max_connections + 1,
                            server_header=False, date_header=False)
    config.load()
    config.http_protocol_class = guarded_protocol(config.http_protocol_class, limits)
    return _GuardedServer(config)


def _GuardedServer(config):
    """A uvicorn.Server whose ServiceGuard learns the listening socket before serving."""
    import uvicorn

    class GuardedServer(uvicorn.Server):
        def run(self, sockets=None):
            # the Host allow-list follows the socket: loopback names for a loopback socket
            if sockets and isinstance(self.config.app, ServiceGuard):
                self.config.app.bind(sockets[0])
            return super().run(sockets=sockets)

    return GuardedServer(config)


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def host_of(header: str) -> str:
    """The host name of a Host header (port and IPv6 brackets removed), lower case."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def is_loopback_name(host: str) -> bool:
    """localhost, a *.localhost name, or a loopback address (127.0.0.0/8, ::1)."""
    if host in ("localhost",) or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


SECURITY_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"content-security-policy",
     b"default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
     b"img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
     b"form-action 'self'; frame-ancestors 'none'"),
]


class ServiceGuard:
    """ASGI middleware every service runs behind: a Host allow-list (a page of another site
    whose name was rebound to 127.0.0.1 cannot reach a loopback service), security headers on
    every response, and errors in the services' JSON shape — `{"error": "..."}` — for every
    status, including the plain-text ones of the framework (500) and an unhandled exception
    (507 for a full disk, 503 for another OS error, else 500, with one line in the log and no
    traceback in the answer)."""

    def __init__(self, app, allowed_hosts: list[str] | tuple[str, ...] | None = None):
        self.app = app
        self.extra = {h.strip().lower() for h in allowed_hosts or () if h.strip()}
        self.any_host = False
        self.state = getattr(app, "state", None)

    def bind(self, sock: socket.socket) -> None:
        """Decide the allow-list from the listening socket: a loopback socket takes only
        loopback names (and the configured ones); another takes any Host unless configured."""
        try:
            addr = sock.getsockname()[0]
            loop = ipaddress.ip_address(addr.split("%")[0]).is_loopback
        except (OSError, ValueError, IndexError):
            loop = False
        self.any_host = not loop and not self.extra

    def host_allowed(self, header: str | None) -> bool:
        """Whether a request with this Host header is served."""
        if header is None or self.any_host:
            return True   # HTTP/1.0 without Host: no browser sends that
        host = host_of(header)
        return host in self.extra or "*" in self.extra or is_loopback_name(host)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = None
        for k, v in scope.get("headers") or ():
            if k == b"host":
                host = v.decode("latin-1")
                break
        if not self.host_allowed(host):
            await send_json(send, 400, f"request header 'Host': {host[:100]!r} is not a name "
                            "of this service (expected a loopback name, or one configured in "
                            "allowed_hosts)")
            return
        started, held = [False], {}

        async def guarded_send(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or ())
                names = {k.lower() for k, _ in headers}
                headers += [(k, v) for k, v in SECURITY_HEADERS if k not in names]
                message = {**message, "headers": headers}
                ctype = dict((k.lower(), v) for k, v in headers).get(b"content-type", b"")
                if message["status"] >= 400 and not ctype.startswith(b"application/json"):
                    held.update(start=message, text=b"")   # re-worded as JSON once it ends
                    return
                started[0] = True
            elif held and message["type"] == "http.response.body":
                if len(held["text"]) < 300:
                    held["text"] += message.get("body", b"")[:300]
                return
            await send(message)

        try:
            await self.app(scope, receive, guarded_send)
        except Exception as exc:   # noqa: BLE001 - the answer is the point
            status, message = error_status(exc)
            log.error("%s %s: %s", scope.get("method"), scope.get("path"), message,
                      exc_info=status == 500)
            if not started[0]:
                await send_json(send, status, message)
            return
        if held and not started[0]:
            lines = held["text"].decode("utf-8", "replace").strip().splitlines()
            await send_json(send, held["start"]["status"], lines[0][:200] if lines else
                            f"HTTP {held['start']['status']}", held["start"].get("headers"))


def error_status(exc: BaseException) -> tuple[int, str]:
    """(status, one-line message) for an unhandled exception: 507 when the disk is full, 503
    for another OS or database error (retry later), 500 otherwise."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return 507, "the service's disk is full; nothing was stored (retry later)"
    if isinstance(exc, sqlite3.OperationalError) and "full" in str(exc):
        return 507, "the service's disk is full; nothing was stored (retry later)"
    if isinstance(exc, (OSError, sqlite3.OperationalError)):
        return 503, f"the service cannot reach its storage now ({type(exc).__name__}); retry later"
    return 500, f"internal error ({type(exc).__name__}); see the service's log"


async def send_json(send, status: int, message: str, headers=None) -> None:
    """A complete JSON error response `{"error": message}` (security headers included)."""
    body = json.dumps({"error": message}).encode()
    keep = [(k, v) for k, v in headers or () if k.lower() not in
            (b"content-type", b"content-length")]
    names = {k.lower() for k, _ in keep}
    keep += [(k, v) for k, v in SECURITY_HEADERS if k not in names]
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        *keep]})
    await send({"type": "http.response.body", "body": body})


def json_response_bytes(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 response with a JSON error body, closing the connection (written by
    the protocol when there is no app to answer: a timeout, a refused connection)."""
    body = json.dumps({"error": message}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n"
            "x-content-type-options: nosniff\r\n\r\n")
    return head.encode() + body


def guarded_protocol(base: type, limits: ConnectionLimits) -> type:
    """uvicorn's HTTP protocol class `base` with ConnectionLimits enforced (see there)."""
    book = _Connections(limits)

    class Guarded(base):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            now = time.monotonic()
            self._g_phase_at, self._g_phase_cycle, self._g_bytes = now, None, 0
            self._g_phase_bytes, self._g_fresh, self._g_served = 0, True, 0
            self._g_body = None    # (cycle, started_at, bytes then)
            book.admit(self)

        def connection_lost(self, exc) -> None:
            book.forget(self)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            # bytes of the next request's head (not the rest of a body answered before it was
            # read, as a 413 is)
            head = _waiting(self) and not _body_left(self)
            if head and not self._g_phase_bytes:
                self._g_phase_at = time.monotonic()   # the head starts with its first byte
            self._g_bytes += len(data)
            if head:
                self._g_phase_bytes += len(data)
            super().data_received(data)
            if head and self._g_phase_bytes > limits.max_head_bytes and _waiting(self) \
                    and not self.transport.is_closing():
                _close(self, 431, "Request Header Fields Too Large",
                       f"request head: more than {limits.max_head_bytes} bytes")

        def on_response_complete(self) -> None:
            book.fresh.pop(self, None)
            super().on_response_complete()
            self._g_phase_at, self._g_phase_cycle = time.monotonic(), self.cycle
            self._g_phase_bytes, self._g_fresh, self._g_body = 0, False, None
            self._g_served += 1

        def send_400_response(self, msg: str) -> None:
            self.transport.write(json_response_bytes(400, "Bad Request", f"request: {msg}"))
            self.transport.close()

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded


class _Connections:
    """The open connections of one server, swept every `sweep_s` on its event loop."""

    def __init__(self, limits: ConnectionLimits):
        self.limits = limits
        self.open: dict[object, None] = {}     # insertion-ordered
        self.fresh: dict[object, None] = {}    # those that never completed a request, oldest first
        self.by_client: dict[str, int] = {}
        self._timer = None

    def admit(self, conn) -> None:
        client = (conn.client or ("?",))[0]
        self.open[conn] = None
        self.fresh[conn] = None
        self.by_client[client] = self.by_client.get(client, 0) + 1
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.limits.sweep_s,
                                                                self.sweep)
        if self.by_client[client] > self.limits.per_client:
            self._make_room(conn, client)
        if len(self.open) > self.limits.max_connections:
            self._make_room(conn, None)

    def forget(self, conn) -> None:
        self.fresh.pop(conn, None)
        if self.open.pop(conn, 1) is None:
            client = (conn.client or ("?",))[0]
            self.by_client[client] -= 1
            if not self.by_client[client]:
                del self.by_client[client]

    def _make_room(self, new, client: str | None) -> None:
        """Close one connection to make room for `new`: one that never sent a whole request,
        else an idle keep-alive one (oldest first), else the slowest body past its grace;
        when every one is busy, `new` is refused (503, JSON)."""
        now = time.monotonic()
        # the oldest connection that never sent a whole request, found without a scan of all
        for c in self.fresh:
            if c is not new and _waiting(c) and not c.transport.is_closing() and \
                    (client is None or (c.client or ("?",))[0] == client):
                _close(c)
                self.forget(c)
                return
        best, best_key = None, None
        for c in self.open:
            if c is new or (client is not None and (c.client or ("?",))[0] != client) \
                    or c.transport.is_closing():
                continue
            if _waiting(c):
                key = (0 if c._g_fresh else 1, c._g_phase_at)
            elif c._g_body is not None and now - c._g_body[1] >= 1.0:
                key = (2, (c._g_bytes - c._g_body[2]) / max(now - c._g_body[1], 1e-3))
            else:
                continue
            if best_key is None or key < best_key:
                best, best_key = c, key
        if best is None:
            _close(new, 503, "Service Unavailable", "request: too many connections are "
                   "busy (from this client)" if client else "request: too many connections "
                   "are busy; retry later")
        elif _waiting(best):
            _close(best)
        else:
            _close(best, 503, "Service Unavailable", "request body: too slow while the "
                   "service is full of connections; retry later")
        self.forget(best or new)

    def sweep(self) -> None:
        self._timer = None
        now, lim = time.monotonic(), self.limits
        for c in list(self.open):
            if c.transport.is_closing():
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
                               f"within {lim.header_timeout_s:g} s")
                    else:
                        _close(c)
                continue
            cycle = c.cycle
            if cycle is None or not getattr(cycle, "more_body", False) \
                    or cycle.response_complete:
                continue
            if c._g_body is None or c._g_body[0] is not cycle:
                c._g_body = (cycle, now, c._g_bytes)
                continue
            if getattr(c.flow, "read_paused", False):   # the app is not reading: not the client's fault
                c._g_body = (cycle, c._g_body[1] + lim.sweep_s, c._g_body[2])
                continue
            spent = now - c._g_body[1]
            if spent > lim.body_grace_s and \
                    c._g_bytes - c._g_body[2] < lim.body_min_bytes_per_s * spent:
                _close(c, None if getattr(cycle, "response_started", False) else 408,
                       "Request Timeout", f"request body: slower than "
                       f"{lim.body_min_bytes_per_s:g} bytes/s")
        if self.open:
            self._timer = asyncio.get_running_loop().call_later(lim.sweep_s, self.sweep)


def _waiting(conn) -> bool:
    """Whether a connection waits for a request's head (no request in progress)."""
    return conn.cycle is conn._g_phase_cycle


def _body_left(conn) -> bool:
    """Whether the current request's body is still arriving."""
    return conn.cycle is not None and getattr(conn.cycle, "more_body", False)


def _close(conn, status: int | None = None, reason: str = "", message: str = "") -> None:
    try:
        if status is not None:
            conn.transport.write(json_response_bytes(status, reason, message))
        conn.transport.close()
        # gone from uvicorn's count now (its connection_lost comes later): its own limit
        # would otherwise answer the connection admitted in its place with a plain-text 503
        conn.connections.discard(conn)
    except Exception:   # noqa: BLE001 - a transport already gone
        pass
    cycle = getattr(conn, "cycle", None)
    if cycle is not None and not cycle.response_complete:
        cycle.disconnected = True
        cycle.message_event.set()


class BodyRefused(Exception):
    """A request body not read: `kind` is bad_length (Content-Length not a byte count),
    too_large (`declared` bytes announced, or more than `limit` sent) or client_gone (the
    client hung up after `size` bytes); each service words it in its own error format."""

    def __init__(self, kind: str, limit: int, size: int = 0, declared: int | None = None):
        super().__init__(kind)
        self.kind, self.limit, self.size, self.declared = kind, limit, size, declared


def declared_length(request, limit: int) -> int | None:
    """The request's Content-Length (None when chunked); BodyRefused when it is not a byte
    count or is over `limit`, so an oversized body is refused before any of it is read."""
    declared = request.headers.get("content-length")
    if declared is None:
        return None
    if not declared.isdigit() or len(declared) > 18:
        raise BodyRefused("bad_length", limit)
    if int(declared) > limit:
        raise BodyRefused("too_large", limit, declared=int(declared))
    return int(declared)


async def read_bounded(request, limit: int) -> bytes:
    """The request body, BodyRefused once more than `limit` bytes arrive (the rest unread) or
    when the client hangs up (one line for the log, not a traceback: nobody is left to answer).
    Call declared_length first."""
    from starlette.requests import ClientDisconnect

    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyRefused("too_large", limit, size)
            chunks.append(chunk)
    except ClientDisconnect:
        raise BodyRefused("client_gone", limit, size) from None
    return b"".join(chunks)
