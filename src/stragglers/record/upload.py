"""Stream a rank's flushed parts to the live monitor over HTTP, off the training thread.

`PartUploader.submit()` only appends to a bounded buffer and returns: a monitor that is down,
slow or refusing never stalls or crashes training. A background thread sends the parts in
order (`PUT /api/jobs/{job}/ranks/{rank}/parts/{n}`, idempotent on the monitor, so a retry
after a lost reply is harmless), retrying with exponential backoff; while the monitor is away
the buffer holds the parts, and when it is full the oldest part is dropped and counted (the
count travels with every upload, so the dashboard shows it). Uses only the standard library
and msgspec (a core dependency): a training node needs nothing of the monitor's extra.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from collections import deque

import msgspec

from stragglers.serving import check_url

log = logging.getLogger(__name__)

# Statuses after which sending the same request again can succeed.
RETRY_STATUSES = {404, 408, 425, 429, 500, 502, 503, 504}
# A request (body sent, reply read) is given up past timeout_s plus its body at this rate: the
# socket's timeout bounds each read and write, and a stalled proxy trickling its reply a byte a
# second held the uploader for good (the buffer then dropped every part, silently).
MIN_BYTES_PER_S = 64 * 1024
# the most of a reply read: the monitor answers a few hundred bytes of JSON
MAX_REPLY_BYTES = 64 * 1024


class UploadStats(msgspec.Struct, frozen=True):
    """An uploader's counts at one moment (`PartUploader.stats`)."""

    submitted: int            # parts handed to submit()
    sent: int                 # parts the monitor stored (new to it)
    duplicates: int           # parts it already held (a retry after a lost reply)
    dropped: int              # parts dropped from a full buffer, or submitted after close
    rejected: int             # parts the monitor refused for good (e.g. 401)
    retries: int              # requests sent again after a failure
    pending: int              # parts queued and not yet delivered
    last_error: str | None    # the last failure, for the log


class PartUploader:
    """Uploads one rank's parts (and rank 0's meta.json) to a monitor from a daemon thread."""

    def __init__(self, url: str, token: str | None, job: str, rank: int, *,
                 max_buffer: int = 256, max_buffer_bytes: int = 256 * 2**20,
                 timeout_s: float = 10.0, backoff_s: float = 0.2, max_backoff_s: float = 10.0,
                 run: str | None = None):
        parsed = check_url(url, "monitor URL")
        self.url, self.job, self.rank = url.rstrip("/"), job, int(rank)
        # check_url refused a URL without a host
        self._scheme, self._host = parsed.scheme, parsed.hostname or ""
        self._port = parsed.port or (443 if parsed.scheme == "https" else 80)
        self._base = parsed.path.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        if run:   # the run's token, on every request: a newer run of the job name refuses ours
            self._headers["X-Stragglers-Run"] = run
        # a newer run of the same job name replaced this one at the monitor: nothing more is sent
        self.superseded = False
        self.max_buffer, self.max_buffer_bytes = max(1, int(max_buffer)), int(max_buffer_bytes)
        self.timeout_s, self.backoff_s, self.max_backoff_s = timeout_s, backoff_s, max_backoff_s
        self._buf: deque[tuple[int, bytes]] = deque()
        self._buf_bytes = 0
        self._meta: dict | None = None
        # the meta.json this rank sent last: sent again when the monitor no longer knows the
        # job (it expires jobs that got no part for a while: a slow first step)
        self._sent_meta: dict | None = None
        self._cv = threading.Condition()
        self._closing = self._stopped = False
        self._conn: http.client.HTTPConnection | None = None
        self.submitted = self.sent = self.duplicates = self.dropped = self.rejected = 0
        self.retries = 0
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"stragglers-upload-{rank}",
                                        daemon=True)
        self._thread.start()

    # ---- the training side (never blocks) -----------------------------------------------

    def submit(self, part_number: int, data: bytes) -> None:
        """Queue one part's Parquet bytes; when the buffer is full the oldest part is dropped."""
        with self._cv:
            if self._closing or self.superseded:
                self.dropped += 1
                return
            self._buf.append((int(part_number), bytes(data)))
            self._buf_bytes += len(data)
            self.submitted += 1
            while len(self._buf) > self.max_buffer or (
                    self._buf_bytes > self.max_buffer_bytes and len(self._buf) > 1):
                _, old = self._buf.popleft()
                self._buf_bytes -= len(old)
                self.dropped += 1
            self._cv.notify()

    def submit_meta(self, meta: dict) -> None:
        """Queue the job's meta.json (rank 0); it goes before any part still queued."""
        with self._cv:
            if not self.superseded:
                self._meta = dict(meta)
                self._cv.notify()

    @property
    def pending(self) -> int:
        """Parts queued and not yet delivered."""
        with self._cv:
            return len(self._buf)

    def stats(self) -> UploadStats:
        """Counts of submitted, sent, duplicate, dropped and rejected parts, and retries."""
        with self._cv:
            return UploadStats(self.submitted, self.sent, self.duplicates, self.dropped,
                               self.rejected, self.retries, len(self._buf), self.last_error)

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait at most `timeout` s for what is queued to go out; True if it all did."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cv:
            self._cv.notify_all()  # a thread backing off after a failure tries again now
            while (self._buf or self._meta is not None) and time.monotonic() < deadline \
                    and self._thread.is_alive():
                self._cv.wait(min(0.05, max(0.0, deadline - time.monotonic())))
            return not self._buf and self._meta is None

    def close(self, timeout: float = 10.0) -> bool:
        """Deliver what is queued for at most `timeout` s, then stop; True if all went out."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cv:
            self._closing = True
            done = self.drain(timeout)
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout=max(0.1, deadline - time.monotonic()) + self.timeout_s)
        if not done:
            log.warning("stragglers upload to %s: %d part(s) of rank %d not delivered (%s)",
                        self.url, self.pending, self.rank, self.last_error)
        return done

    # ---- the background side ------------------------------------------------------------

    def _run(self) -> None:
        delay = self.backoff_s
        while True:
            with self._cv:
                while not self._stopped and not self._buf and self._meta is None:
                    self._cv.wait()
                if self._stopped:
                    break
                # rank 0's meta.json first, then the oldest part
                job: dict | tuple[int, bytes] = \
                    self._meta if self._meta is not None else self._buf[0]
            try:
                outcome = self._send_meta(job) if isinstance(job, dict) else \
                    self._send_part(*job)
            except Exception as exc:  # never let the thread die: training relies on it
                outcome = "retry"
                self.last_error = f"{type(exc).__name__}: {exc}"
                self._drop_connection()
            with self._cv:
                if outcome == "retry":
                    self.retries += 1
                    self._cv.wait(delay)  # close() wakes this up
                    delay = min(delay * 2, self.max_backoff_s)
                    continue
                delay = self.backoff_s
                if isinstance(job, dict):
                    self._sent_meta = job
                    if self._meta is job:
                        self._meta = None
                elif self._buf and self._buf[0] is job:
                    self._buf.popleft()
                    self._buf_bytes -= len(job[1])
                self._cv.notify_all()
        self._drop_connection()

    def _send_meta(self, meta: dict) -> str:
        body = json.dumps(meta).encode()
        return self._outcome(self._request("PUT", f"/api/jobs/{self.job}/meta", body,
                                           "application/json"), "meta")

    def _send_part(self, part: int, data: bytes) -> str:
        path = f"/api/jobs/{self.job}/ranks/{self.rank}/parts/{part}"
        status, reply = self._request("PUT", path, data, "application/vnd.apache.parquet",
                                      {"X-Stragglers-Dropped": str(self.dropped)})
        outcome = self._outcome((status, reply), f"part {part}")
        if status == 404:
            with self._cv:  # the job is unknown there (expired, or a new monitor): announce it
                if self._meta is None and self._sent_meta is not None:
                    self._meta = self._sent_meta
        if outcome == "done":
            with self._cv:
                if b'"duplicate"' in reply:
                    self.duplicates += 1
                else:
                    self.sent += 1
        elif outcome == "drop":
            with self._cv:
                self.rejected += 1
        return outcome

    def _outcome(self, response: tuple[int, bytes], what: str) -> str:
        status, reply = response
        if 200 <= status < 300:
            return "done"
        self.last_error = f"HTTP {status}: {reply[:300].decode(errors='replace')}"
        if status in RETRY_STATUSES:
            return "retry"
        if status == 409 and b'"superseded_run"' in reply:
            # two trainings under one job name: the newer one has it; ours goes unmonitored
            # (said once) rather than be stored as the other's
            log.warning("stragglers upload to %s: a newer run of job %r replaced this one; "
                        "its parts are no longer sent (give each run its own monitor_job): %s",
                        self.url, self.job, self.last_error)
            with self._cv:
                self.superseded = True
                self.dropped += len(self._buf)
                self._buf.clear()
                self._buf_bytes = 0
                self._meta = None
                self._cv.notify_all()
            return "drop"
        # The monitor refuses this request for good (bad token, bad part): retrying cannot help.
        log.warning("stragglers upload of %s to %s refused: %s", what, self.url, self.last_error)
        return "drop"

    def _request(self, method: str, path: str, body: bytes, ctype: str,
                 extra: dict | None = None) -> tuple[int, bytes]:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._scheme == "https" else \
                http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=self.timeout_s)
        conn = self._conn
        headers = {**self._headers, "Content-Type": ctype, **(extra or {})}
        budget = self.timeout_s + len(body) / MIN_BYTES_PER_S
        # past the budget the socket is shut down under the request, which then fails as any
        # lost connection does (and is sent again on a new one)
        fired = threading.Event()
        cut = threading.Timer(budget, _shut, args=(conn, fired))
        cut.daemon = True
        cut.start()
        try:
            conn.request(method, self._base + path, body=body, headers=headers)
            resp = conn.getresponse()
            # the monitor's replies are a few hundred bytes: a URL answering a large body (a
            # file server, a proxy) had the training process hold all of it, on every retry
            reply = resp.read(MAX_REPLY_BYTES + 1)
            if len(reply) > MAX_REPLY_BYTES:
                self._drop_connection()   # (the rest is never read: a new connection next)
                raise http.client.HTTPException(f"a reply over {MAX_REPLY_BYTES:,} bytes; "
                                                "expected a stragglers monitor's")
        except (OSError, http.client.HTTPException) as exc:
            self._drop_connection()
            if fired.is_set():
                raise TimeoutError(f"no whole reply within {budget:.0f} s (a stalled "
                                   "connection)") from exc
            raise
        finally:
            cut.cancel()
        if resp.getheader("connection", "").lower() == "close" or not resp.isclosed():
            self._drop_connection()
        return resp.status, reply

    def _drop_connection(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:
                pass
            self._conn = None


def _shut(conn: http.client.HTTPConnection, fired: threading.Event) -> None:
    """Shut the connection's socket down (a request past its budget: its blocked read ends)."""
    fired.set()
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
