"""Alert delivery from the store's outbox: any instance sends, each message is claimed once.

An alert change and its outbox message are written in one transaction (store_base
`_alert_changes`): the decision to send is the row. A sender thread on every instance claims due
messages (`FOR UPDATE SKIP LOCKED`, for `claim_s`), posts them in Alertmanager's webhook format
to every configured receiver, and marks them delivered; a failure is retried with backoff (by
any instance), and a claim whose holder died runs out and is taken by another instance. A
message is therefore delivered once, except when its sender dies between the receiver's answer
and the mark (then it is sent again after `claim_s`, with the same fingerprint and startsAt,
which Alertmanager deduplicates).
"""

from __future__ import annotations

import http.client
import json
import logging
import queue
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterable
from http.client import HTTPMessage
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stragglers.monitor.alerts import AlertEngine, WebhookPayload
    from stragglers.monitor.records import ClaimedMessage
    from stragglers.monitor.store_base import SQLStore

log = logging.getLogger(__name__)


class OutboxSender:
    """Claims and posts the outbox's messages from a thread."""

    def __init__(self, store: SQLStore, instance: str, engine: AlertEngine, receiver: str,
                 webhooks: Iterable[str], claim_s: float,
                 poll_s: float = 0.25, max_attempts: int = 8, backoff_s: float = 0.5,
                 max_backoff_s: float = 60.0, timeout_s: float = 5.0):
        self.store, self.instance, self.engine, self.receiver = store, instance, engine, receiver
        self.webhooks, self.claim_s, self.poll_s = list(webhooks), float(claim_s), poll_s
        self.max_attempts, self.backoff_s, self.max_backoff_s = max_attempts, backoff_s, \
            max_backoff_s
        self.timeout_s = timeout_s
        self.sent = self.failed = 0
        self._done: dict[int, set[str]] = {}   # message id → receivers that took it (retries)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # messages claimed when they were decided (the dead-man's, store.add_dead_man): sent
        # on a thread of their own, not after the poller's claim or behind its slow posts
        self._urgent: queue.Queue = queue.Queue()
        self._urgent_thread: threading.Thread | None = None
        self._counts = threading.Lock()
        self._unavailable: str | None = None   # why the last poll failed (said once)
        self._redirected: set[str] = set()   # receivers whose redirect was said

    def start(self) -> None:
        """Send on a thread until close()."""
        self._thread = threading.Thread(target=self._run, name="stragglers-webhook",
                                        daemon=True)
        self._thread.start()
        self._urgent_thread = threading.Thread(target=self._run_urgent,
                                               name="stragglers-webhook-now", daemon=True)
        self._urgent_thread.start()

    def send_now(self, claimed: list[ClaimedMessage]) -> None:
        """Send messages already claimed by this instance at once (on the urgent thread; a
        failure is retried by the outbox like any other)."""
        for m in claimed:
            self._urgent.put(m)

    def wake(self) -> None:
        """Messages were queued: look now rather than at the next poll."""
        self._wake.set()

    def close(self) -> None:
        """Stop sending (claimed messages not yet sent are sent by an instance once the claim
        runs out)."""
        self._stop.set()
        self._wake.set()
        self._urgent.put(None)
        for thread in (self._thread, self._urgent_thread):
            if thread is not None:
                thread.join(timeout=10)

    def _run_urgent(self) -> None:
        while True:
            m = self._urgent.get()
            if m is None:
                return
            try:
                self._send(m)
            except Exception as exc:  # noqa: BLE001 - its claim runs out: the poller sends it
                log.warning("alerts: message not sent now (%s); the outbox retries it",
                            str(exc).splitlines()[0] if str(exc) else exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.poll_s)
            self._wake.clear()
            self.poll()

    def poll(self) -> None:
        """Send what is due; a store that refuses (away, a full disk) is tried again at the
        next poll, and said once while it lasts (it was a line every 0.25 s)."""
        try:
            while not self._stop.is_set() and self.send_due():
                pass
        except Exception as exc:  # noqa: BLE001 - the store away: try at the next poll
            said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if said != self._unavailable:
                log.warning("alerts: outbox unavailable (%s); tried again at each poll", said)
            self._unavailable = said
            return
        if self._unavailable is not None:
            log.warning("alerts: outbox available again")
            self._unavailable = None

    def send_due(self) -> int:
        """Claim and send what is due; how many were claimed."""
        claimed = self.store.claim_messages(self.instance, 32, self.claim_s)
        for m in claimed:
            self._send(m)
        return len(claimed)

    def _send(self, m: ClaimedMessage) -> None:
        """Post one claimed message to every receiver that has not taken it; mark it."""
        payload = self.engine.payload(m.alert, self.receiver)
        done = self._done.setdefault(m.id, set())
        todo = [url for url in dict.fromkeys(self.webhooks) if url not in done]
        # each receiver on its own thread: a slow one (up to its deadline) does not hold the
        # others' posts behind it
        posts = [threading.Thread(target=self._post_into, args=(url, payload, done),
                                  name="stragglers-webhook-post", daemon=True)
                 for url in todo[1:]]
        for post in posts:
            post.start()
        if todo:
            self._post_into(todo[0], payload, done)
        for post in posts:
            post.join()
        if len(done) == len(set(self.webhooks)):
            self.store.message_sent(m.id, self.instance)
            self._done.pop(m.id, None)
            with self._counts:
                self.sent += 1
        elif m.attempts >= self.max_attempts:
            self.store.message_failed(m.id, None)
            self._done.pop(m.id, None)
            with self._counts:
                self.failed += 1
            log.warning("alerts: gave up on a %s message of %s after %d attempts",
                        m.status, m.job, m.attempts)
        else:
            delay = min(self.backoff_s * 2 ** (m.attempts - 1), self.max_backoff_s)
            self.store.message_failed(m.id, delay)

    def _post_into(self, url: str, payload: WebhookPayload, done: set[str]) -> None:
        if self._post(url, payload):
            with self._counts:
                done.add(url)

    def _post(self, url: str, payload: WebhookPayload) -> bool:
        """POST `payload` to `url`, answered within timeout_s as a whole: past it the post's
        sockets are shut down under it (urlopen's timeout bounds each read only: a receiver
        or proxy trickling its answer a byte a second held the sender, and every alert, for
        good); a failed attempt either way, retried with backoff."""
        req = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        cut = _Deadline()
        timer = threading.Timer(self.timeout_s, cut.shut)
        timer.daemon = True
        timer.start()
        try:
            # the status is the answer: its body is not read
            with cut.opener().open(req, timeout=self.timeout_s) as resp:
                status = resp.status
            if cut.fired.is_set():   # a head cut short at the deadline can read as whole
                raise TimeoutError("past the deadline")
            return 200 <= status < 300
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
            why = f"no whole answer within {self.timeout_s:g} s" if cut.fired.is_set() else exc
            if isinstance(exc, urllib.error.HTTPError) and 300 <= exc.code < 400:
                to = exc.headers.get("Location", "?")
                if url not in self._redirected:   # (said once a receiver; retried anyway)
                    self._redirected.add(url)
                    log.warning("webhook %s redirects (%d) to %s: not followed (the alert "
                                "would be lost); configure that address", url, exc.code, to)
            log.info("webhook %s: %s (will retry)", url, why)
            return False
        finally:
            timer.cancel()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A 3xx is not followed (urllib's HTTPError: a failed attempt): urllib followed a
    301/302/303 as a GET without the alert, and that GET's 200 (Alertmanager's alert list)
    marked the alert delivered, lost."""

    def redirect_request(self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str,
                         headers: HTTPMessage, newurl: str) -> urllib.request.Request | None:
        return None


class _Deadline:
    """The connections of one post (redirects, proxies: urllib's own handling), shut down
    together when its deadline passes: their blocked reads end."""

    def __init__(self) -> None:
        self.fired = threading.Event()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []

    def opener(self) -> urllib.request.OpenerDirector:
        """urllib's opener, its http(s) connections registered here once connected."""
        deadline = self

        class Plain(http.client.HTTPConnection):
            def connect(self) -> None:
                super().connect()
                deadline.opened(self.sock)

        class Tls(http.client.HTTPSConnection):
            def connect(self) -> None:
                super().connect()
                deadline.opened(self.sock)

        class PlainHandler(urllib.request.HTTPHandler):
            def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
                return self.do_open(Plain, req)

        class TlsHandler(urllib.request.HTTPSHandler):
            def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
                return self.do_open(Tls, req, context=self._context)  # type: ignore[attr-defined]

        return urllib.request.build_opener(PlainHandler, TlsHandler, _NoRedirect)

    def opened(self, sock: socket.socket) -> None:
        """A connection of the post is open (shut at once if the deadline passed already)."""
        with self._lock:
            self._socks.append(sock)
            if self.fired.is_set():
                _shut(sock)

    def shut(self) -> None:
        """The deadline: shut every connection of the post down."""
        with self._lock:
            self.fired.set()
            for sock in self._socks:
                _shut(sock)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
