"""A transport for ShardClient whose reply heads must arrive within one timeout in all."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import httpcore
import httpx

_local = threading.local()   # this thread's request: [deadline or None, span s]


@contextlib.contextmanager
def head_within(span_s: float) -> Iterator[None]:
    """The reads of this thread's request inside get `span_s` seconds in all from the first
    (httpx bounds each read alone: a head trickled a byte at a time under the read timeout
    never ended, and a worker hung for hours on a hostile or broken server)."""
    _local.head = [None, span_s]
    try:
        yield
    finally:
        _local.head = None


class _Stream(httpcore.NetworkStream):
    """A socket stream whose reads end at the running request's head deadline."""

    def __init__(self, inner: httpcore.NetworkStream):
        self.inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        head = getattr(_local, "head", None)
        if head is not None:
            now = time.monotonic()
            if head[0] is None:
                head[0] = now + head[1]
            left = head[0] - now
            if left <= 0:
                raise httpcore.ReadTimeout(f"the reply's head took over {head[1]:g} s")
            timeout = left if timeout is None else min(timeout, left)
        return self.inner.read(max_bytes, timeout)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.inner.write(buffer, timeout)

    def close(self) -> None:
        self.inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _Stream(self.inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self.inner.get_extra_info(info)


class _Backend(httpcore.NetworkBackend):
    """httpcore's sync sockets, each wrapped in _Stream."""

    def __init__(self) -> None:
        self.inner = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return _Stream(self.inner.connect_tcp(host, port, timeout, local_address,
                                              socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None
                            ) -> httpcore.NetworkStream:
        return _Stream(self.inner.connect_unix_socket(path, timeout, socket_options))

    def sleep(self, seconds: float) -> None:
        self.inner.sleep(seconds)


# httpcore's errors as httpx's (what httpx's own transport raises; the most specific first,
# by the error's own class order): the client's retries catch httpx's
_ERRORS: dict[type[Exception], type[httpx.HTTPError]] = {
    httpcore.TimeoutException: httpx.TimeoutException,
    httpcore.ConnectTimeout: httpx.ConnectTimeout,
    httpcore.ReadTimeout: httpx.ReadTimeout,
    httpcore.WriteTimeout: httpx.WriteTimeout,
    httpcore.PoolTimeout: httpx.PoolTimeout,
    httpcore.NetworkError: httpx.NetworkError,
    httpcore.ConnectError: httpx.ConnectError,
    httpcore.ReadError: httpx.ReadError,
    httpcore.WriteError: httpx.WriteError,
    httpcore.ProxyError: httpx.ProxyError,
    httpcore.UnsupportedProtocol: httpx.UnsupportedProtocol,
    httpcore.ProtocolError: httpx.ProtocolError,
    httpcore.LocalProtocolError: httpx.LocalProtocolError,
    httpcore.RemoteProtocolError: httpx.RemoteProtocolError,
}


@contextlib.contextmanager
def _as_httpx() -> Iterator[None]:
    """An httpcore error raised inside as the httpx error it stands for."""
    try:
        yield
    except Exception as exc:
        for kind in type(exc).__mro__:
            if kind in _ERRORS:
                raise _ERRORS[kind](str(exc)) from exc
        raise


class _Body(httpx.SyncByteStream):
    """A reply body read from the pool, its errors httpx's."""

    def __init__(self, inner: Iterable[bytes]):
        self.inner = inner

    def __iter__(self) -> Iterator[bytes]:
        with _as_httpx():
            yield from self.inner

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


class Transport(httpx.BaseTransport):
    """What httpx.HTTPTransport does (its defaults: 100 connections, 20 kept alive 5 s), on
    _Backend's sockets, with public API only: httpx takes no network backend, and replacing
    its transport's private pool broke with any httpx that renamed it. It connects directly:
    no HTTP(S)_PROXY (the service is on the job's network, see the README)."""

    def __init__(self, limits: httpx.Limits | None = None) -> None:
        limits = limits or httpx.Limits()
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(), max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry, network_backend=_Backend())

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.SyncByteStream)
        url = request.url
        core = httpcore.Request(request.method, httpcore.URL(
            scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path),
            headers=request.headers.raw, content=request.stream,
            extensions=request.extensions)
        with _as_httpx():
            reply = self._pool.handle_request(core)
        assert isinstance(reply.stream, Iterable)
        return httpx.Response(reply.status, headers=reply.headers, stream=_Body(reply.stream),
                              extensions=reply.extensions)

    def close(self) -> None:
        with _as_httpx():
            self._pool.close()


def transport() -> Transport:
    """ShardClient's transport: reply heads within one timeout in all (head_within)."""
    return Transport()
