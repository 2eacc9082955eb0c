"""ShardClient reads what answers at its URL (a proxy, a misconfigured address, a hostile
server) within bounds: no content coding (a gzip reply was decoded whole: 1 MB became 1 GiB in
the worker), at most a bounded number of bytes, a Retry-After of ASCII digits only. A real HTTP
server on loopback sends each bad reply."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import pytest

from stragglers.adapt.client import REPLY_BYTES, SMALL_REPLY_BYTES, ShardClient
from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.replies import LeaseReply, Status
from stragglers.adapt.service import ServiceConfig
from stragglers.errors import EnvironmentFailure

TOKEN = "owner-token-0123456789"
STATUS = msgspec.json.encode(Status(DatasetConfig("d", 100, 10), 1,
                                    {"0": {"TODO": 10, "DOING": 0, "DONE": 0, "FAILED": 0}},
                                    [], 0))
LEASE = msgspec.json.encode(LeaseReply("wait", [], [], 0))


class Reply(msgspec.Struct):
    """One answer of the server: status, headers, body; `chunked`: no Content-Length."""

    status: int
    body: bytes
    headers: dict[str, str] = {}
    chunked: bool = False


class Server:
    """A loopback HTTP server answering request i with replies[i] (the last one again past
    the end); it keeps each request's headers."""

    def __init__(self, replies: list[Reply]):
        self.replies, self.seen = replies, []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                owner.seen.append(dict(self.headers))
                r = owner.replies[min(len(owner.seen), len(owner.replies)) - 1]
                self.send_response(r.status)
                for k, v in {"Content-Type": "application/json", **r.headers}.items():
                    self.send_header(k, v)   # (latin-1: '²' is the byte 0xB2)
                self.send_header("Connection", "close")
                if r.chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                else:
                    self.send_header("Content-Length", str(len(r.body)))
                self.end_headers()
                try:
                    if not r.chunked:
                        self.wfile.write(r.body)
                        return
                    for i in range(0, len(r.body), 1 << 16):
                        piece = r.body[i:i + (1 << 16)]
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    self.wfile.write(b"0\r\n\r\n")
                except OSError:
                    pass   # the client hung up before the end: what a bound does

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="reply-server")

    def __enter__(self) -> Server:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@pytest.fixture
def serve() -> Iterator:
    servers: list[Server] = []

    def start(*replies: Reply) -> Server:
        servers.append(Server(list(replies)).__enter__())
        return servers[-1]

    yield start
    for s in servers:
        s.__exit__()


def client(url: str, **kw) -> ShardClient:
    return ShardClient(url, "d", "w", token=TOKEN, retry_s=5, **kw)


def test_a_gzip_reply_is_refused_not_decoded(serve):
    # a valid Status then 64 MiB of spaces, gzipped (~65 KB): httpx asked for gzip and decoded
    # all of it (fails before: the Status came back, 64 MiB decoded; a 1 GiB one took 2.1 GB)
    bomb = gzip.compress(STATUS + b" " * (64 << 20), compresslevel=9)
    assert len(bomb) < 1 << 17
    srv = serve(Reply(200, bomb, {"Content-Encoding": "gzip"}))
    c = client(srv.url)
    with pytest.raises(EnvironmentFailure, match="Content-Encoding 'gzip'; expected none"):
        c.status()
    c.close()
    assert srv.seen[0]["Accept-Encoding"] == "identity"


@pytest.mark.parametrize("chunked", [False, True])
def test_a_lease_reply_past_its_bound_is_refused(serve, chunked):
    # a valid LeaseReply padded past SMALL_REPLY_BYTES (a lease's longest, 262,144 indices of
    # 2^26 samples, is 2.3 MB); fails before: read whole and returned, whatever its size
    big = LEASE + b" " * SMALL_REPLY_BYTES
    srv = serve(Reply(200, b'{"fence": 1, "released": []}'), Reply(200, big, chunked=chunked))
    c = client(srv.url)
    got = "more than 4,194,304 bytes came" if chunked else f"Content-Length {len(big)}"
    with pytest.raises(EnvironmentFailure, match=f"reply too large \\({got}\\); at most"
                                                 " 4,194,304 bytes"):
        c.lease()
    c.close()


def test_a_reply_of_its_bound_is_read(serve):
    # the bound is the reply's size, not one byte less: a LeaseReply of exactly 4 MiB
    srv = serve(Reply(200, b'{"fence": 1, "released": []}'),
                Reply(200, LEASE + b" " * (SMALL_REPLY_BYTES - len(LEASE)), chunked=True))
    c = client(srv.url)
    assert c.lease().status == "wait"
    c.close()


def test_a_snapshot_or_status_is_bounded_by_max_reply_bytes(serve):
    # fails before: no bound (a 2 MiB status read whole into a client told 1 MiB)
    srv = serve(Reply(200, STATUS + b" " * (2 << 20), chunked=True))
    c = client(srv.url, max_reply_bytes=1 << 20)
    with pytest.raises(EnvironmentFailure, match="more than 1,048,576 bytes came"):
        c.status()
    c.close()
    # the default: the service's largest restore body (a snapshot) and a margin
    assert REPLY_BYTES == ServiceConfig().max_restore_bytes + (1 << 20)


def test_a_retry_after_of_non_ascii_digits_waits_a_second(serve):
    # '²'.isdigit() is True and float('²') raised ValueError: a traceback out of every call
    # (fails before); now it counts as no number: the default wait of 1 s, then the retry
    srv = serve(Reply(429, b'{"error": "slow down", "kind": "RateLimited", "field": null}',
                      {"Retry-After": "\u00b2"}),
                Reply(200, STATUS))
    c = client(srv.url)
    assert c.status().epochs_created == 1
    c.close()
    assert len(srv.seen) == 2
