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

import json
import logging
import queue
import threading
import urllib.error
import urllib.request
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

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
        for url in self.webhooks:
            if url not in done and self._post(url, payload):
                done.add(url)
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

    def _post(self, url: str, payload: WebhookPayload) -> bool:
        req = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return 200 <= resp.status < 300
        except (urllib.error.URLError, OSError, ValueError) as exc:
            log.info("webhook %s: %s (will retry)", url, exc)
            return False
