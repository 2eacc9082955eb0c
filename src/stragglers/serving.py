"""What the HTTP services and their clients share: server, socket, bodies, tokens, URLs."""

from __future__ import annotations

import asyncio
import dataclasses
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
from contextvars import ContextVar
from pathlib import Path

from stragglers.errors import EnvironmentFailure, InputError
from stragglers.smallfiles import read_small_file
# the connection guard lives in serving_guard; its names stay importable from here
from stragglers.serving_guard import BODY_ADMITTED_KEY, FRAMING_KEY, SECURITY_HEADERS, \
    TARGET_KEY, BodyNotAdmitted, ConnectionLimits, ErrorShape, admit_body, guarded_protocol, \
    json_response_bytes, park, plain_error  # noqa: F401
from stragglers.serving_quota import AnonymousPace, RateLimited

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (only this machine can connect); InputError
    naming --host when it is no address or name this machine can resolve."""
    try:
        infos = socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        raise _unresolvable(host) from None
    return all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)


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


async def pause(seconds: float) -> None:
    """asyncio.sleep(seconds) held on the real clock: a loop's timer may fire early (libuv reads
    its clock once an iteration, stale on a busy host), and a refusal answered early let a
    client loop on refused requests faster than the pause allows."""
    due = time.monotonic() + seconds
    while (left := due - time.monotonic()) > 0:
        await asyncio.sleep(left)


def read_token_file(path: Path | str | None, option: str = "--token-file") -> str | None:
    """The token a file holds (its first line, stripped), never taken from the command line
    (it would show in `ps`); one-line InputError naming the file and `option` when the file
    cannot be read, is not a regular file, is owned by another user than the one running
    this, can be read or written by group or others (the error says the chmod that fixes
    it), or its first line is not a token."""
    if path is None:
        return None

    def owner_only(st: os.stat_result) -> str | None:
        if os.name != "posix":
            return None
        if st.st_uid != os.geteuid():
            # (another local user who planted it, mode 0600, where the job's workdir will be
            # knows the token: it could lease, ack, restore and delete the job's data sets)
            return (f"{option}: owned by uid {st.st_uid}, expected the user running this "
                    f"(uid {os.geteuid()}); make a new one, or run `chown {os.geteuid()} "
                    f"{path}` if its token is yours")
        if st.st_mode & 0o077:
            return (f"{option}: group or others may read or write it (mode "
                    f"{stat.S_IMODE(st.st_mode):04o}); run `chmod 600 {path}`")
        return None

    # regular files only, opened without blocking (a FIFO named as the token file must not
    # block the start), the mode judged on the very file read
    data = read_small_file(path, f"{option}: a file holding the token on its first line",
                           missing=f"{option}: cannot read the token file (No such file or "
                           "directory)", check=owner_only)
    # the first line, not the first non-blank one: the README's rule, and a file whose token
    # sits below a blank line is more likely a mistake (an editor's template) than a token
    first = data[:MAX_TOKEN_FILE_BYTES].split(b"\n", 1)[0]
    try:
        token = first.decode("ascii").strip()
    except UnicodeDecodeError:
        token = None
    if token == "":
        where = "its first line is blank" if data else "the file is empty"
        raise InputError(path, None, f"{option}: {where} (expected the token on the first "
                         "line: 16-512 characters of [A-Za-z0-9._~+/=-])")
    if token is None or not TOKEN_PATTERN.fullmatch(token):
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


def uvicorn_server(app, *, max_connections: int, keep_alive_s: float, http: str = "httptools",
                   loop: str = "uvloop", graceful_s: float | None = None,
                   limits: ConnectionLimits | None = None,
                   allowed_hosts: list[str] | tuple[str, ...] | None = None,
                   error_shape: ErrorShape = plain_error, gate_bodies: bool = False):
    """The uvicorn.Server every service runs: quiet logs, no lifespan, bounded connections;
    the errors of the layers below the app in `error_shape` (the service's JSON error body).

    httptools + uvloop by default: the C parser and event loop (the pure-Python h11 path is
    ~2x slower). The app runs behind ServiceGuard (Host allow-list, security headers, JSON
    error bodies) and the protocol behind ConnectionLimits (head and body timeouts, a cap per
    client and in all; at the cap an idle connection is closed to admit a new one, so idle
    sockets cannot lock clients out). `allowed_hosts`: Host names accepted besides the
    loopback names (None: any Host when the socket is not a loopback one). `gate_bodies`: a
    request's body is read (and 100 Continue sent) only once the app called admit_body. An
    app that sets `state.anonymous_pace` (serving_quota.AnonymousPace) has every request
    without its credential wait its client address's turn before any of it is done, and so
    does every request its HTTP parser refuses (a malformed head answered 400 or 431).
    """
    import uvicorn

    limits = limits or ConnectionLimits(max_connections=max_connections,
                                        per_client=min(256, max_connections))
    # the guard keeps connections <= max_connections by evicting idle ones, and ServiceGuard
    # bounds the requests in progress (those of connections cut for a fairer share may run
    # on a while): uvicorn's own limit answered plain-text 503s, and counted both together
    guard = ServiceGuard(app, allowed_hosts, 2 * limits.max_connections, error_shape,
                         limits.refusal_delay_s, gate_bodies)
    config = uvicorn.Config(guard, http=http, loop=loop,
                            log_level="warning", access_log=False, lifespan="off",
                            # (typed int, used as a float: loop.call_later, asyncio.wait_for)
                            timeout_keep_alive=keep_alive_s,  # type: ignore[arg-type]
                            timeout_graceful_shutdown=graceful_s,  # type: ignore[arg-type]
                            limit_concurrency=None,
                            # h11 refuses a head still incomplete past 16 KB (400): the bound
                            # is max_head_bytes, however the head is cut into reads
                            h11_max_incomplete_event_size=limits.max_head_bytes,
                            server_header=False, date_header=False)
    config.load()
    # (after uvicorn's logging config: its warning goes to the service's log)
    limits = within_open_files(limits)
    quiet_repeats()   # (the parser's refusals and unsupported upgrades: a line per request)
    # (the requests its parser refuses wait their address's turn of the app's anonymous pace)
    config.http_protocol_class = guarded_protocol(config.http_protocol_class, limits,
                                                  error_shape, lambda: guard.anonymous)
    return _GuardedServer(config)


class LogBudget:
    """Log lines per key as a token bucket (`burst` at once, `per_s` after)."""

    def __init__(self, burst: int, per_s: float, max_keys: int = 0):
        self.burst, self.per_s, self.max_keys = burst, per_s, max_keys
        self._left: dict[str, tuple[float, float, int]] = {}   # key → (tokens, at, unlogged)
        self._lock = threading.Lock()

    def take(self, key: str) -> int | None:
        """None when this line is not to be logged; else how many of `key` were not since."""
        now = time.monotonic()
        with self._lock:
            if self.max_keys and key not in self._left and len(self._left) >= self.max_keys:
                self._left.clear()   # (keys are few: a bound, not an eviction policy)
            tokens, at, unlogged = self._left.get(key, (float(self.burst), now, 0))
            tokens = min(float(self.burst), tokens + (now - at) * self.per_s)
            if tokens < 1.0:
                self._left[key] = (tokens, now, unlogged + 1)
                return None
            self._left[key] = (tokens - 1.0, now, 0)
            return unlogged


class RepeatedLines(logging.Filter):
    """Each distinct message of a logger let through once per `every_s`, then once more with
    the count of those held back: a client looping on requests the server's HTTP layer refuses
    (not HTTP, an upgrade to a protocol not served) made uvicorn log a line or two per request,
    thousands a second into the service's log."""

    def __init__(self, every_s: float = 60.0, max_kinds: int = 1024):
        super().__init__()
        self._budget = LogBudget(1, 1.0 / every_s, max_kinds)

    def filter(self, record: logging.LogRecord) -> bool:
        held = self._budget.take(str(record.msg)[:200])
        if held is None:
            return False
        if held:
            record.msg = f"{record.msg} ({held} more like it, not logged)"
        return True


def quiet_repeats(name: str = "uvicorn.error") -> None:
    """Install RepeatedLines on logger `name` (once)."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, RepeatedLines) for f in logger.filters):
        logger.addFilter(RepeatedLines())


# descriptors a service needs besides its connections (databases, logs, pools' pipes, epoll)
FILES_RESERVED = 128


def within_open_files(limits: ConnectionLimits) -> ConnectionLimits:
    """`limits` with max_connections (and per_client) lowered to what this process may open
    (RLIMIT_NOFILE, its soft limit first raised to the hard one): past the descriptor
    limit, accept() failed before the guard could evict an idle connection, so idle sockets
    of one client (a soft limit of 1,024 is common) reset every other client's connection."""
    soft = raise_open_files()
    need = limits.max_connections + FILES_RESERVED
    if soft is None or soft >= need:
        return limits
    most = max(8, soft - FILES_RESERVED)
    # (on uvicorn's logger: the service's own log, which the package's NullHandler is not)
    logging.getLogger("uvicorn.error").warning(
        "this process may open %d files: serving at most %d connections, not %d (raise"
        " `ulimit -n`)", soft, most, limits.max_connections)
    return dataclasses.replace(limits, max_connections=most,
                               per_client=min(limits.per_client, most))


def raise_open_files() -> int | None:
    """This process's soft RLIMIT_NOFILE, raised to its hard one first (the service's files,
    databases and connections all need descriptors, and the hard limit is what the operator
    allows); None when unbounded or not POSIX."""
    try:
        import resource
    except ImportError:   # (not POSIX)
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    if hard == resource.RLIM_INFINITY or hard > soft:
        # (an unbounded hard limit is bounded by the kernel's nr_open: the larger that fits)
        for target in ([hard] if hard != resource.RLIM_INFINITY else []) + [1 << 20, 1 << 16]:
            if target <= soft:
                continue
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                return target
            except (ValueError, OSError):
                continue
    return soft


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


# the address the request being served comes from (set by ServiceGuard for the request's task
# and those it starts): for shares per client deep in an app, without threading the request
REQUEST_CLIENT: ContextVar[str | None] = ContextVar("request_client", default=None)


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


# uri-host [ ":" port ] (RFC 9110 7.2): an IP literal in brackets or a reg-name, a port of
# digits (at most 65535, checked after)
_HOST_VALUE = re.compile(r"(?:\[([0-9a-f:.]+)\]|([a-z0-9._~!$&'()*+,;=%-]*))(?::([0-9]{0,5}))?")


def host_of(header: str) -> str | None:
    """The host name of a Host header (port and IPv6 brackets removed), lower case; None when
    the value is not host[:port] (RFC 9112 3.2: answered 400; `localhost:abc`, a port past
    65535 or `[::1]x` named a loopback host before)."""
    m = _HOST_VALUE.fullmatch(header.strip().lower())
    if m is None or (m.group(3) and int(m.group(3)) > 65535):
        return None
    return m.group(1) if m.group(1) is not None else m.group(2)


def is_loopback_name(host: str) -> bool:
    """localhost, a *.localhost name, or a loopback address (127.0.0.0/8, ::1)."""
    if host in ("localhost",) or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# the answer to a request whose connection closed, or whose client shut its side, while it
# waited its turn (only a half-closed client reads it)
GONE_WHILE_WAITING = ("request: its connection was closed (or its client's side shut) while it"
                      " waited its turn; retry on an open connection")


class ServiceGuard:
    """ASGI middleware every service runs behind: a Host allow-list (a page of another site
    whose name was rebound to 127.0.0.1 cannot reach a loopback service), security headers on
    every response, at most `max_requests` requests in progress (503 past it), with
    `gate_bodies` no body read before the app admits it (admit_body), every request without
    a credential paced per client address before anything else is done of it, whatever its
    route (`anonymous`, or the app's `state.anonymous_pace`: see AnonymousPace), and errors in
    the services' JSON shape — `{"error": "..."}` — for every
    status, including the plain-text ones of the framework (500) and an unhandled exception
    (507 for a full disk, 503 for another OS error, else 500, with one line in the log and no
    traceback in the answer)."""

    def __init__(self, app, allowed_hosts: list[str] | tuple[str, ...] | None = None,
                 max_requests: int | None = None, error_shape: ErrorShape = plain_error,
                 refusal_delay_s: float = 0.25, gate_bodies: bool = False,
                 anonymous: AnonymousPace | None = None):
        self.app, self.shape, self.gate_bodies = app, error_shape, gate_bodies
        # its own refusals (a Host not allowed, a header twice, framing not taken) are answered
        # after a pause (sleeping costs nothing): a client looping on them waits, not spins
        self.refusal_delay_s = refusal_delay_s
        self.max_requests, self.requests = max_requests, 0
        self.extra = {h.strip().lower() for h in allowed_hosts or () if h.strip()}
        self.any_host = False
        self.state = getattr(app, "state", None)
        # the pace of requests without a credential, whatever their route: given here, or
        # offered by the app as `app.state.anonymous_pace` (None: no pace)
        self.anonymous = anonymous if anonymous is not None else \
            getattr(self.state, "anonymous_pace", None)

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
        if host is None:
            return False
        return host in self.extra or "*" in self.extra or is_loopback_name(host)

    def absolute_target(self, scope: dict, target: bytes) -> tuple[dict, str | None]:
        """(scope, None) for a request target in absolute-form (`http://host/path`) whose host
        is allowed, the scope's path made the target's path; (scope, refusal) otherwise: RFC
        9112 makes that authority, not the Host header, name the target, so it passes the same
        allow-list (a loopback service was served `GET http://evil.example/...`)."""
        shown = target[:100].decode("latin-1")
        try:
            parts = urllib.parse.urlsplit(target.decode("latin-1"))
            parts.port   # noqa: B018 - raises ValueError for a port that is not one
        except ValueError:
            parts = None
        if parts is None or parts.scheme.lower() not in ("http", "https") or not parts.hostname:
            return scope, (f"request target {shown!r}: expected a path (/...) or an absolute "
                           "http:// URL")
        if not self.host_allowed(parts.netloc.rpartition("@")[2]):
            return scope, (f"request target {shown!r}: {parts.hostname!r} is not a name of this"
                           " service (expected a loopback name, or one configured in"
                           " allowed_hosts)")
        if TARGET_KEY in scope:
            return scope, None   # httptools put the target's path in the scope already
        path = parts.path or "/"   # h11: the scope's path is the whole target
        return {**scope, "raw_path": path.encode("latin-1"),
                "path": urllib.parse.unquote(path)}, None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        REQUEST_CLIENT.set((scope.get("client") or ("?",))[0])
        pace = self.anonymous
        key = pace.key(scope) if pace is not None else None
        if pace is None or key is None:
            await self._serve(scope, receive, send)
            return
        await self._paced(pace, key, scope, receive, send)

    async def _paced(self, pace: AnonymousPace, key: object, scope, receive, send) -> None:
        """A request without a credential: its address's turn (AnonymousPace), then served."""
        # before anything else is done of it, its own refusals included (each ~0.2 ms of the
        # event loop: a loop of them from one address slowed every other client as well)
        try:
            wait = pace.turn(key)
        except RateLimited as exc:
            # answered after the longest wait (at once, a refusal is an answer a flooding
            # client spins on)
            park_s = exc.park_s or pace.max_wait_s
            if not await park(scope, park_s):
                await send_json(self.shape, send, 503, GONE_WHILE_WAITING)
                return
            after = str(max(1, round(exc.retry_after_s - park_s + 0.5)))
            await send_json(self.shape, send, 429, f"request: {exc.what}",
                            [(b"retry-after", after.encode())])
            return
        served, sent = False, [0]

        async def counted(message) -> None:
            if message["type"] == "http.response.body":
                sent[0] += len(message.get("body") or b"")   # (a big answer: more turns)
            await send(message)
        try:
            if wait and not await park(scope, wait):
                await send_json(self.shape, send, 503, GONE_WHILE_WAITING)
                return
            served = True
            await self._serve(scope, receive, counted)
        finally:
            pace.leave(key, served, sent[0])

    async def _serve(self, scope, receive, send) -> None:
        """A request past its turn: the guard's checks, then the app."""
        version = str(scope.get("http_version") or "")
        if version not in ("1.0", "1.1"):
            # httptools serves a text request line claiming HTTP/2.0 or 0.9 as if it were 1.1
            # (RFC 9110 15.6.6: a major version the server does not take is 505)
            await pause(self.refusal_delay_s)
            await send_json(self.shape, send, 505, f"request line: HTTP/{version[:8]} is not "
                            "served here; expected HTTP/1.1 (or 1.0)")
            return
        headers = scope.get("headers") or ()
        twice = _repeated(headers)
        if twice is not None:
            # RFC 9112 (Host): answered 400; the same for a token or a body's type, where one
            # reader takes the first and another the last (the owner's token then a stranger's)
            await pause(self.refusal_delay_s)
            await send_json(self.shape, send, 400, f"request header '{twice}': given more than once; "
                            "expected once")
            return
        odd = _odd_framing(headers, version)
        if odd is not None:
            await pause(self.refusal_delay_s)
            await send_json(self.shape, send, *odd)
            return
        hosts = [v.decode("latin-1") for k, v in headers if k == b"host"]
        host = hosts[0] if hosts else None
        if host is None and scope.get("http_version") == "1.1":
            # RFC 9112 3.2: an HTTP/1.1 request without Host is answered 400 (HTTP/1.0 ones,
            # which no browser sends, are served)
            await pause(self.refusal_delay_s)
            await send_json(self.shape, send, 400, "request header 'Host': missing (HTTP/1.1"
                            " requires it)")
            return
        if host is not None and host_of(host) is None:
            await pause(self.refusal_delay_s)
            await send_json(self.shape, send, 400, f"request header 'Host': {host[:100]!r} is not"
                            " host[:port] (a name or an address, a port 0-65535)")
            return
        if host is not None and not self.host_allowed(host):
            await pause(self.refusal_delay_s)
            await send_json(self.shape, send, 400, f"request header 'Host': {host[:100]!r} is not a name "
                            "of this service (expected a loopback name, or one configured in "
                            "allowed_hosts)")
            return
        target = scope.get(TARGET_KEY) or scope.get("raw_path") or b"/"
        if not target.startswith(b"/"):
            scope, refusal = self.absolute_target(scope, target)
            if refusal is not None:
                await pause(self.refusal_delay_s)
                await send_json(self.shape, send, 400, refusal)
                return
        if b"%2f" in (scope.get("raw_path") or b"").lower():
            # the path is routed decoded: /datasets/d%2Flease was /datasets/d/lease, one
            # segment to a proxy or a log, two to the service; no name either service takes
            # holds a '/', so an encoded one names nothing
            await pause(self.refusal_delay_s)
            await send_json(self.shape, send, 400, "request target: an encoded '/' (%2F) in the"
                            " path; expected the segments separated by '/' themselves")
            return
        if self.max_requests is not None and self.requests >= self.max_requests:
            await send_json(self.shape, send, 503, f"request: {self.requests} requests are in progress, "
                            "the most this service takes at once; retry later")
            return
        started = [False]
        answered = [False]   # a response has begun (its receive() then waits for a hang-up)
        held: list[_Held] = []   # a plain-text error response, re-worded as JSON once whole
        if self.gate_bodies:
            receive = _gated(scope, receive, answered)

        async def guarded_send(message):
            kind = message["type"]
            if kind == "http.response.start":
                answered[0] = True
                headers = list(message.get("headers") or ())
                names = {k.lower() for k, _ in headers}
                if self.gate_bodies and not scope.get(BODY_ADMITTED_KEY) and \
                        b"connection" not in names and _has_body(scope):
                    # answered from its head, its body unread: the connection ends (a client
                    # told no 100 Continue may send the body or not; read as the next request's
                    # head it would desynchronise the connection)
                    headers.append((b"connection", b"close"))
                headers += [(k, v) for k, v in SECURITY_HEADERS if k not in names]
                message = {**message, "headers": headers}
                ctype = dict((k.lower(), v) for k, v in headers).get(b"content-type", b"")
                status = message["status"]
                if status >= 400 and not ctype.startswith(b"application/json"):
                    held.append(_Held(status, headers))   # re-worded as JSON once it ends
                    return
                started[0] = True
            elif held and kind == "http.response.body":
                if len(held[0].text) < 300:
                    held[0].text += message.get("body", b"")[:300]
                return
            await send(message)

        self.requests += 1
        try:
            await self.app(scope, receive, guarded_send)
        except Exception as exc:   # noqa: BLE001 - the answer is the point
            status, message = error_status(exc)
            log.error("%s %s: %s", scope.get("method"), scope.get("path"), message,
                      exc_info=status == 500)
            if not started[0]:
                await send_json(self.shape, send, status, message)
            return
        finally:
            self.requests -= 1
        if held and not started[0]:
            lines = held[0].text.decode("utf-8", "replace").strip().splitlines()
            await send_json(self.shape, send, held[0].status, lines[0][:200] if lines else
                            f"HTTP {held[0].status}", held[0].headers)


# request headers that carry one value: given twice, which one counts is up to the reader
SINGLE_HEADERS = frozenset((b"host", b"authorization", b"content-type", b"x-service-token",
                            b"content-length"))


def _repeated(headers) -> str | None:
    """The name of a header of SINGLE_HEADERS that `headers` (ASGI pairs) give twice; None."""
    seen: set[bytes] = set()
    for name, _ in headers:
        if name in SINGLE_HEADERS:
            if name in seen:
                return name.decode("latin-1")
            seen.add(name)
    return None


def _odd_framing(headers, version: str = "1.1") -> tuple[int, str] | None:
    """(status, message) for a request whose framing the services do not take: a transfer
    coding other than chunked (its body was handed on still coded: `gzip, chunked` was read
    as plain JSON; RFC 9112 6.1: 501), both a transfer coding and a length (400), a transfer
    coding in an HTTP/1.0 request (400) or an expectation other than 100-continue (RFC 9110
    10.1.1: 417); None for any other request."""
    names = {name for name, _ in headers}
    if b"transfer-encoding" in names and version == "1.0":
        # RFC 9112 6.1: an HTTP/1.0 message with Transfer-Encoding is framed faultily, whatever
        # else it says (HTTP/1.0 has no transfer codings: a 1.0 proxy in front frames it by its
        # Content-Length or its close, and the parsers read it chunked: a smuggling shape, and
        # was served)
        return 400, ("request header 'Transfer-Encoding': not in HTTP/1.0 (RFC 9112 6.1); "
                     "expected HTTP/1.1, or a Content-Length")
    if b"transfer-encoding" in names and b"content-length" in names:
        # RFC 9112 6.3: a request smuggling shape (a proxy in front may frame it by the other
        # header); httptools refused it, h11 took the chunked body and ignored the length
        return 400, ("request headers 'Transfer-Encoding' and 'Content-Length': both given;"
                     " expected one")
    for name, value in headers:
        if name == b"transfer-encoding" and value.strip().lower() != b"chunked":
            return 501, (f"request header 'Transfer-Encoding': {value[:60].decode('latin-1')!r}"
                         " is not supported; expected 'chunked' or a Content-Length")
        if name == b"expect" and value.strip().lower() != b"100-continue":
            return 417, (f"request header 'Expect': {value[:60].decode('latin-1')!r} cannot be"
                         " met; expected '100-continue' or none")
    return None


def _has_body(scope: dict) -> bool:
    """Whether a request declares a body (a Content-Length above 0, or a transfer coding)."""
    for name, value in scope.get("headers") or ():
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip(b" 0")):
            return True
    return False


def _gated(scope: dict, receive, answered: list[bool]):
    """`receive` refusing (BodyNotAdmitted) a read of the body before admit_body: nothing of
    it is read and no 100 Continue is sent to a request its app has not judged."""
    async def gated():
        if not scope.get(BODY_ADMITTED_KEY) and not answered[0]:
            raise BodyNotAdmitted(f"{scope.get('method')} {str(scope.get('path'))[:100]}: the"
                                  " body was read before the request's head was judged")
        return await receive()
    return gated


class _Held:
    """A plain-text error response held back: its status, headers and first body bytes."""

    __slots__ = ("status", "headers", "text")

    def __init__(self, status: int, headers: list):
        self.status, self.headers, self.text = status, headers, b""


SQLITE_CORRUPT, SQLITE_NOTADB = 11, 26


def error_status(exc: BaseException) -> tuple[int, str]:
    """(status, one-line message) for an unhandled exception: 507 when the disk is full, 503
    for another OS or database error (retry later), 500 otherwise."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return 507, "the service's disk is full; nothing was stored (retry later)"
    if isinstance(exc, sqlite3.OperationalError) and "full" in str(exc):
        return 507, "the service's disk is full; nothing was stored (retry later)"
    # PostgreSQL's (psycopg is loaded where a service uses it): its server stopped or
    # restarting (AdminShutdown, a connection lost or refused) was a 500 for every upload
    pg = sys.modules.get("psycopg")
    if pg is not None and isinstance(exc, pg.errors.DiskFull):
        return 507, "the service's disk is full; nothing was stored (retry later)"
    if isinstance(exc, (OSError, sqlite3.OperationalError)) or \
            (pg is not None and isinstance(exc, pg.OperationalError)):
        return 503, f"the service cannot reach its storage now ({type(exc).__name__}); retry later"
    if isinstance(exc, sqlite3.DatabaseError) and \
            (getattr(exc, "sqlite_errorcode", 0) or 0) & 0xFF in (SQLITE_CORRUPT, SQLITE_NOTADB):
        # a damaged page (a torn write, a bad sector): the store's, not the request's (an
        # IntegrityError or a ProgrammingError is a bug: 500, not a retry)
        return 503, ("the service cannot read part of its storage (DatabaseError); its "
                     "operator is told in the service's log")
    return 500, f"internal error ({type(exc).__name__}); see the service's log"


async def send_json(shape: ErrorShape, send, status: int, message: str, headers=None) -> None:
    """A complete JSON error response, `shape(status, message)` (security headers included)."""
    body = json.dumps(shape(status, message)).encode()
    keep = [(k, v) for k, v in headers or () if k.lower() not in
            (b"content-type", b"content-length")]
    names = {k.lower() for k, _ in keep}
    keep += [(k, v) for k, v in SECURITY_HEADERS if k not in names]
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        *keep]})
    await send({"type": "http.response.body", "body": body})



def canonical_decimal(text: str, top: int) -> int | None:
    """The number 0..top that `text` writes in canonical decimal (ASCII digits, no sign, space
    or leading zero), else None: '+0', '00', ' 1' and '\uff11' (int() takes them all) would
    name the same thing as '0' or '1' in a path or query, one stored twice under two keys."""
    if not (text.isascii() and text.isdigit()) or len(text) > len(str(top)):
        return None
    if len(text) > 1 and text[0] == "0":
        return None
    value = int(text)
    return value if value <= top else None


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
    if not (declared.isascii() and declared.isdigit()) or len(declared) > 18:
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
            # (with what the reads carried besides the body: a chunked body's extensions)
            if size + request.scope.get(FRAMING_KEY, 0) > limit:
                raise BodyRefused("too_large", limit, size)
            chunks.append(chunk)
    except ClientDisconnect:
        raise BodyRefused("client_gone", limit, size) from None
    return b"".join(chunks)
