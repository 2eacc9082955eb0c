"""A webhook post is answered within its deadline as a whole, or fails (a retried attempt)."""

from __future__ import annotations

import socket
import threading

from stragglers.monitor.outbox import OutboxSender


def test_a_webhook_post_whose_answer_trickles_for_ever_fails_at_its_deadline():
    """The receiver sends its status line, then a header byte every 0.3 s for ever: a socket
    timeout (per read) never ends it; the post's deadline does, as a failed attempt."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    done = threading.Event()

    def trickle() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\n")
            try:
                while not done.wait(0.3):
                    conn.sendall(b"X")
            except OSError:
                pass

    threading.Thread(target=trickle, daemon=True).start()
    sender = OutboxSender(None, "i", None, "r", [], claim_s=30, timeout_s=1.0)  # type: ignore[arg-type]
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/hook"
        assert sender._post(url, {}) is False  # type: ignore[typeddict-item]
    finally:
        done.set()
        listener.close()


def test_a_webhook_that_redirects_is_a_failed_attempt_not_a_delivery():
    """301 to a page that answers GET 200 (Alertmanager's alert list): urllib followed it as a
    GET without the alert, and its 200 counted delivered. Not followed now: a failed attempt."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen: list[str] = []

    class Moved(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen.append("POST " + self.path)
            self.send_response(301)
            self.send_header("Location", "/api/v2/alerts")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self) -> None:
            seen.append("GET " + self.path)
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"[]")

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Moved)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sender = OutboxSender(None, "i", None, "r", [], claim_s=30)  # type: ignore[arg-type]
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/old"
        assert sender._post(url, {}) is False  # type: ignore[typeddict-item]
    finally:
        server.shutdown()
        server.server_close()
    assert seen == ["POST /old"]
