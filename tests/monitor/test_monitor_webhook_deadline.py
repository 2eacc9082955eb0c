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
