"""What the HTTP services and their clients share: server, socket, bodies, tokens, URLs."""

from __future__ import annotations

import ipaddress
import re
import signal
import socket
import sys
import threading
import time
import urllib.parse
from pathlib import Path

from stragglers.errors import EnvironmentFailure, InputError


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


def read_token_file(path: Path | str | None, option: str = "--token-file") -> str | None:
    """The token a file holds (first line, stripped), never taken from the command line (it
    would show in `ps`); one-line InputError naming the file and `option` otherwise."""
    if path is None:
        return None
    try:
        token = Path(path).read_bytes().strip().decode("ascii")
    except OSError as exc:
        raise InputError(path, None, f"{option}: cannot read the token file "
                         f"({exc.strerror})") from None
    except UnicodeDecodeError:
        token = ""
    if not TOKEN_PATTERN.fullmatch(token):
        raise InputError(path, None, f"{option}: expected one line of 16-512 characters of "
                         "[A-Za-z0-9._~+/=-] as the token")
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
                   loop: str = "uvloop", graceful_s: float | None = None):
    """The uvicorn.Server every service runs: quiet logs, no lifespan, a connection limit.

    httptools + uvloop by default: the C parser and event loop (the pure-Python h11 path is
    ~2x slower). Beyond `max_connections` open connections uvicorn answers 503 at once.
    """
    import uvicorn

    config = uvicorn.Config(app, http=http, loop=loop, log_level="warning", access_log=False,
                            lifespan="off", timeout_keep_alive=keep_alive_s,
                            timeout_graceful_shutdown=graceful_s,
                            limit_concurrency=max_connections,
                            server_header=False, date_header=False)
    return uvicorn.Server(config)


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
