"""The recorder's uploader reads at most MAX_REPLY_BYTES of a reply: a monitor URL answering a
large body (a file server, a proxy, a hostile host) had the training process read and hold
all of it, on every retry (1 GiB in 1.2 s grew the process by 1,050 MB)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from conftest import eventually
from stragglers.record.upload import MAX_REPLY_BYTES, PartUploader

ANNOUNCED = 64 << 20   # the reply's Content-Length: far past every socket buffer of loopback


class BigReplies:
    """A server on loopback that answers every PUT 429 with a body of ANNOUNCED bytes, sent
    until the client stops reading (the bytes it got out are counted)."""

    def __init__(self):
        self.sent: list[int] = []
        lock, sent = threading.Lock(), self.sent

        class Handler(BaseHTTPRequestHandler):
            def do_PUT(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.send_response(429)
                self.send_header("Content-Length", str(ANNOUNCED))
                self.end_headers()
                chunk, n = b"x" * (1 << 16), 0
                try:
                    while n < ANNOUNCED:
                        self.wfile.write(chunk)
                        n += len(chunk)
                except OSError:
                    pass   # the client hung up: what it took is counted
                with lock:
                    sent.append(n)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_a_huge_reply_is_not_read_whole_and_the_request_is_tried_again():
    server = BigReplies()
    uploader = PartUploader(server.url, "tok", "j", 0, backoff_s=0.05, max_backoff_s=0.1,
                            timeout_s=30.0)
    try:
        uploader.submit(0, b"part")
        eventually(lambda: len(server.sent) >= 2, timeout=60, what="two replies answered")
        stats = uploader.stats()
        assert stats.sent == 0 and stats.retries >= 1, stats
        assert f"a reply over {MAX_REPLY_BYTES:,} bytes" in (stats.last_error or ""), stats
        # the rest of each reply was left unread: the server's writes stopped at what the
        # sockets' buffers hold, not at the 64 MiB it announced
        assert max(server.sent[:2]) < ANNOUNCED // 2, server.sent
    finally:
        uploader.close(timeout=1)
        server.close()
