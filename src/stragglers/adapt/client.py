"""HTTP client of the shard service and a pull-based batch sampler for torch's DataLoader."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import httpx
import msgspec

from stragglers.adapt import head_deadline
from stragglers.adapt.controller import Actions, ControlConfig, ControllerView
from stragglers.adapt.dataset import DatasetConfig, check_name
from stragglers.adapt.errors import (Conflict, Fenced, Forbidden, LeaseLost, NotFound,
                                     Quarantined, QuotaExceeded)
from stragglers.adapt.replies import (Acked, Configured, ControlDeleted, Created, Deleted,
                                      FailedShard, Joined, LeaseReply, Released, Requeued,
                                      Restored, Snapshot, Status)
from stragglers.errors import EnvironmentFailure, InputError, StragglersError
from stragglers.serving import canonical_decimal, check_url
from stragglers.wording import printable

_CONFLICTS: dict[str, type[StragglersError]] = {"Fenced": Fenced, "LeaseLost": LeaseLost}
R = TypeVar("R", bound=msgspec.Struct)


# A restore of 655,360 rows is written in paced steps (other jobs' calls run between them):
# tens of seconds on a loaded machine.
RESTORE_TIMEOUT_S = 600.0
# a reply slower than this over a read timeout is cut (each read's own bound is httpx's)
REPLY_MIN_BYTES_PER_S = 1024
# The most bytes of a reply read (past it: EnvironmentFailure, the rest unread). A snapshot, a
# status (a count per epoch: 2^20 epochs) and the lists of shards or ranks (join, release,
# retry-failed, the controller's state) up to max_reply_bytes: the service's max_restore_bytes
# (64 MiB by default: a bigger snapshot cannot be restored there) and 1 MiB; the rest (lease:
# 262,144 indices of 8 digits, ~2.4 MB; ack, create, delete, restore, configure) SMALL_REPLY_BYTES.
REPLY_BYTES = (1 << 26) + (1 << 20)
SMALL_REPLY_BYTES = 1 << 22


class ServiceUnavailable(EnvironmentFailure):
    """The shard service did not answer (or answered 5xx) within the retry budget."""


class ShardClient:
    """Talks to one data set (and its job's controller) on the service.

    Every call is retried while the service is unreachable or answers 5xx, for up to `retry_s`:
    a restarted service resumes from its SQLite file. Retries are safe: a lease retry carries
    the first attempt's request id (the same shards come back), acks are idempotent.
    `token` is the job's bearer token (it owns the data set and the controller it creates).
    Replies are read plain (no content coding) and bounded: `max_reply_bytes` (REPLY_BYTES;
    raise it with the service's max_restore_bytes) or SMALL_REPLY_BYTES.
    """

    def __init__(self, url: str, dataset: str, worker: str, token: str | None = None,
                 retry_s: float = 60.0, timeout_s: float = 10.0, job: str | None = None,
                 service_token: str | None = None, max_reply_bytes: int = REPLY_BYTES):
        check_url(url, "shard service")
        check_name(dataset, "dataset")
        self.url, self.dataset, self.worker = url.rstrip("/"), dataset, worker
        self.job = job or dataset
        self.retry_s = retry_s
        self.max_reply_bytes = max_reply_bytes
        self.fence: int | None = None
        # httpx asks for gzip by default and decodes it whole: 1 MB of gzip was 1 GiB in memory
        headers: dict[str, str] = {"Accept-Encoding": "identity"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if service_token:
            headers["X-Service-Token"] = service_token
        self.timeout_s = timeout_s
        # (its transport bounds a reply's head to one timeout in all: head_deadline.py)
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, headers=headers,
                                  transport=head_deadline.transport())

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def _call(self, method: str, path: str, body: Mapping[str, Any] | msgspec.Struct | None = None,
              params: dict[str, int] | None = None, timeout: float | None = None,
              limit: int | None = None) -> bytes:
        """The JSON answer of one call (its bytes, at most `limit`: max_reply_bytes by
        default), retried while the service is unavailable."""
        # a reply Struct (a snapshot: up to 655,360 rows) goes out encoded by msgspec at once
        content = msgspec.json.encode(body) if isinstance(body, msgspec.Struct) else None
        json_body = None if content is not None else body
        headers = {"Content-Type": "application/json"} if content is not None else None
        deadline = time.monotonic() + self.retry_s
        delay = 0.05
        while True:
            try:
                resp = self._whole_reply(method, path, json_body, content, headers, params,
                                         timeout, limit or self.max_reply_bytes)
                if resp.status_code == 429 and _kind(resp) == "RateLimited" and \
                        time.monotonic() + _retry_after(resp) < deadline:
                    time.sleep(_retry_after(resp))   # new tokens are rate-limited: wait a turn
                    continue
                if resp.status_code < 500:
                    break
                if _kind(resp) == "Quarantined":   # a damaged stored row: waiting won't help
                    raise Quarantined(_message(resp))
                problem = f"answered {resp.status_code}: {_message(resp)}"
            except httpx.TransportError as exc:
                problem = f"unreachable ({type(exc).__name__}: {exc})"
            # The service may be restarting (it resumes from its SQLite file): retry.
            if time.monotonic() > deadline:
                raise ServiceUnavailable(f"shard service {self.url}{path}",
                                         f"{problem}; gave up after {self.retry_s:.0f}s")
            time.sleep(delay)
            delay = min(1.0, delay * 2)
        if 300 <= resp.status_code < 400:   # (was read as a reply: "Input data was truncated")
            where = printable(resp.headers.get("location", "")[:200])
            raise EnvironmentFailure(f"shard service {self.url}{path}",
                                     f"answered {resp.status_code} (Location {where!r}); the"
                                     " service never redirects (a proxy or not the service?):"
                                     " not followed")
        if resp.status_code >= 400:
            msg, kind, field = _message(resp), _kind(resp), _field(resp)
            if resp.status_code == 409:
                raise _CONFLICTS.get(kind, Conflict)(msg)
            if resp.status_code in (401, 403):
                raise Forbidden(msg)
            if resp.status_code == 404:
                raise NotFound(msg)
            if resp.status_code == 429:
                raise QuotaExceeded(msg)
            raise InputError(f"{self.url}{path}", field, msg)
        return resp.content

    def _whole_reply(self, method: str, path: str, json_body, content, headers, params,
                     timeout: float | None, limit: int) -> httpx.Response:
        """One request's reply read whole at REPLY_MIN_BYTES_PER_S or more over each read
        timeout (httpx's timeout bounds each read: a reply trickled a byte a second never
        ended, and a worker's call or `stragglers adapt status` waited for ever; a rate, not a
        total: a big snapshot on a slow link takes long and is no trickle); httpx.ReadTimeout
        below it, which the caller retries as any unreachable service; its head within one
        read timeout in all (head_deadline: trickled a byte a read, it never ended).
        EnvironmentFailure
        (not retried) for a reply in a content coding or over `limit` bytes: not the
        service's (it sends neither), and reading it cost the worker its memory."""
        request = self._http.build_request(method, path, json=json_body, content=content,
                                           headers=headers, params=params,
                                           timeout=timeout or httpx.USE_CLIENT_DEFAULT)
        span = timeout or self.timeout_s
        with head_deadline.head_within(span):
            resp = self._http.send(request, stream=True)
        try:
            self._check_head(resp, path, limit)
            raw = bytearray()
            since, got = time.monotonic(), 0
            for chunk in resp.iter_raw():
                raw += chunk
                if len(raw) > limit:
                    raise self._too_big(path, limit, f"more than {limit:,} bytes came")
                got += len(chunk)
                now = time.monotonic()
                if now - since >= span:
                    if got < REPLY_MIN_BYTES_PER_S * (now - since):
                        raise httpx.ReadTimeout(f"the reply came at {got / (now - since):.0f} "
                                                f"bytes/s over {span:.0f} s (a trickle)",
                                                request=request)
                    since, got = now, 0
        finally:
            resp.close()
        return httpx.Response(resp.status_code, headers=resp.headers, content=bytes(raw),
                              request=request)

    def _check_head(self, resp: httpx.Response, path: str, limit: int) -> None:
        """Refuse a reply before its body: one in a content coding, one announcing more than
        `limit` bytes."""
        coding = resp.headers.get("content-encoding", "identity")
        if coding.strip().lower() != "identity":
            raise EnvironmentFailure(f"shard service {self.url}{path}", f"the reply is in"
                                     f" Content-Encoding {printable(coding[:40])!r}; expected"
                                     " none (it asked for identity: a proxy or not the service?)")
        declared = resp.headers.get("content-length", "")   # (h11 refused one not digits)
        if declared.isascii() and declared.isdigit() and int(declared) > limit:
            raise self._too_big(path, limit, f"Content-Length {declared[:40]}")

    def _too_big(self, path: str, limit: int, got: str) -> EnvironmentFailure:
        return EnvironmentFailure(f"shard service {self.url}{path}", f"reply too large ({got});"
                                  f" at most {limit:,} bytes are read (max_reply_bytes for a"
                                  " snapshot, status or list; a proxy or not the service?)")

    def _typed(self, kind: type[R], method: str, path: str,
               body: Mapping[str, Any] | msgspec.Struct | None = None,
               params: dict[str, int] | None = None, timeout: float | None = None,
               limit: int | None = None) -> R:
        """_call's answer read as a `kind` reply (EnvironmentFailure: the service sent another)."""
        raw = self._call(method, path, body, params, timeout, limit)
        try:
            return msgspec.json.decode(raw, type=kind)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise EnvironmentFailure(f"shard service {self.url}{path}",
                                     f"not a {kind.__name__} reply: {exc}") from None

    def _ds(self, op: str) -> str:
        return f"/datasets/{self.dataset}/{op}"

    def _job(self, op: str) -> str:
        return f"/jobs/{self.job}/control/{op}"

    def create_dataset(self, cfg: DatasetConfig) -> Created:
        """Register the data set (idempotent for the same config and token)."""
        return self._typed(Created, "POST", "/datasets", {**asdict(cfg), "name": self.dataset},
                           limit=SMALL_REPLY_BYTES)

    def join(self) -> int:
        """Start this worker's incarnation: fences off earlier ones (their shards go back)."""
        self.fence = self._typed(Joined, "POST", self._ds("join"), {"worker": self.worker}).fence
        return self.fence

    def _need_fence(self) -> int:
        return self.join() if self.fence is None else self.fence

    def lease(self, count: int = 1) -> LeaseReply:
        """Pull up to `count` shards (status "ok"), or none ("wait", "finished"); `.lease` is the
        first. A failure of this worker returns all of them to the queue."""
        body = {"worker": self.worker, "fence": self._need_fence(), "count": count,
                "request_id": uuid.uuid4().hex}
        return self._typed(LeaseReply, "POST", self._ds("lease"), body,
                           limit=SMALL_REPLY_BYTES)

    def ack(self, epoch: int, shard: int, consumed: int) -> Acked:
        """Report the samples of a shard consumed so far (renews the lease)."""
        return self._typed(Acked, "POST", self._ds("ack"), {
            "worker": self.worker, "fence": self._need_fence(), "epoch": epoch, "shard": shard,
            "consumed": consumed}, limit=SMALL_REPLY_BYTES)

    def release(self, failure: bool = True, error: str | None = None,
                all_incarnations: bool = False) -> Released:
        """Give back this incarnation's shards; `all_incarnations`: fence off every one (a launcher)."""
        # without a fence the service fences off every incarnation (the launcher's call)
        fence = {} if all_incarnations else {"fence": self._need_fence()}
        body = {"worker": self.worker, "failure": failure, "error": error, **fence}
        return self._typed(Released, "POST", self._ds("release"), body)

    def delete_dataset(self) -> Deleted:
        """Delete the data set (its owner's token): its places of the service's quotas are
        given back (NotFound when a retry finds it deleted by the first try)."""
        return self._typed(Deleted, "DELETE", f"/datasets/{self.dataset}",
                           limit=SMALL_REPLY_BYTES)

    def retry_failed(self) -> Requeued:
        """Put the FAILED shards back in the queue."""
        return self._typed(Requeued, "POST", self._ds("retry-failed"), {})

    def status(self) -> Status:
        """Counts per epoch and state, and the FAILED-shard report."""
        return self._typed(Status, "GET", self._ds("status"))

    def snapshot(self) -> Snapshot:
        """The shard state to store inside a model checkpoint (which holds its plain form)."""
        return self._typed(Snapshot, "GET", self._ds("snapshot"))

    def restore(self, snap: Snapshot) -> Restored:
        """Reset the service to a snapshot taken with the model checkpoint being loaded (a big
        one is written in paced steps: up to RESTORE_TIMEOUT_S)."""
        return self._typed(Restored, "POST", self._ds("restore"), snap,
                           timeout=RESTORE_TIMEOUT_S, limit=SMALL_REPLY_BYTES)

    def configure_control(self, config: ControlConfig | Mapping[str, Any]) -> Configured:
        """Start the job's controller for this incarnation (a ControlConfig or its dict)."""
        body = config.to_dict() if isinstance(config, ControlConfig) else dict(config)
        return self._typed(Configured, "POST", self._job("config"), body,
                           limit=SMALL_REPLY_BYTES)

    def delete_control(self) -> ControlDeleted:
        """Drop the job's controller (its owner's token; NotFound when there is none): its
        places of the service's limits are free at once."""
        return self._typed(ControlDeleted, "DELETE", f"/jobs/{self.job}/control",
                           limit=SMALL_REPLY_BYTES)

    def report_steps(self, rank: int, records: Sequence[Sequence[float]], device: str,
                     incarnation: int, since: int = 0) -> Actions:
        """Send step records [[step, bpt, batch], ...] to the Monitor; get actions >= since back."""
        return self._typed(Actions, "POST", self._job("report"), {
            "rank": rank, "records": records, "device": device, "incarnation": incarnation,
            "since": since})

    def actions(self, since: int) -> Actions:
        """Controller actions with seq >= since."""
        return self._typed(Actions, "GET", self._job("actions"), params={"since": since})

    def control_state(self) -> ControllerView:
        """The controller's current view."""
        return self._typed(ControllerView, "GET", self._job("state"))


class _ErrorBody(msgspec.Struct):
    """The service's error answer (every status): {"error", "kind", "field"}."""

    error: str = ""
    kind: str = ""
    field: str | None = None


def _error_body(resp: httpx.Response) -> _ErrorBody:
    """The error answer, or an empty one when the body is not one (e.g. a proxy's page)."""
    try:
        return msgspec.json.decode(resp.content, type=_ErrorBody)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _ErrorBody()


def _message(resp: httpx.Response) -> str:
    """The error a reply gives, its control characters escaped: shown in the operator's
    terminal, a service (or whatever answers at the URL) wrote escapes there (clear the
    screen, set the title)."""
    return printable(_error_body(resp).error or resp.text[:500])


def _kind(resp: httpx.Response) -> str:
    return _error_body(resp).kind


def _retry_after(resp: httpx.Response) -> float:
    """The seconds a 429's Retry-After asks for (1 when absent or not a plain number of ASCII
    digits: '²' passed isdigit() and float() refused it; at most 60)."""
    seconds = canonical_decimal(resp.headers.get("retry-after", "1"), 1 << 31)
    return 1.0 if seconds is None else min(60.0, float(seconds))


def _field(resp: httpx.Response) -> str | None:
    return _error_body(resp).field


@dataclass
class _Held:
    epoch: int
    shard: int
    base: int  # consumed offset of the shard when it was leased
    indices: list[int]
    taken: int = 0  # handed out in batches
    acked: int = 0  # acknowledged to the service


class ShardBatchSampler:
    """A DataLoader batch_sampler that pulls shards; each batch may span shard boundaries.

    Call `ack()` after the optimizer step that used a batch (also done implicitly when the next
    batch is requested). Iterating first joins the service as a new incarnation of the worker
    (fencing off a predecessor of the same name); if this incarnation is fenced off in turn,
    iteration raises Fenced and it must stop. With `block=False` (synchronous training) a
    batch is short or empty when the service says "wait", so no rank blocks while a peer holds
    the last shards; `finished` turns True once the service has nothing left. Use DataLoader(num_workers=0): a prefetching
    loader would request batches before the previous one was trained on.
    """

    def __init__(self, client: ShardClient, batch_size: int | Callable[[], int],
                 block: bool = True, poll_s: float = 0.05, join_on_start: bool = True,
                 ack_interval_s: float = 0.0):
        self.client = client
        self.batch_size = batch_size
        self.block, self.poll_s = block, poll_s
        # 0: ack every batch (a failure replays at most one batch). Larger values save a round
        # trip per step; a failure then replays what was taken since the last ack (a shard
        # completion and ack(force=True), e.g. before a checkpoint, always send).
        self.ack_interval_s = ack_interval_s
        self._last_ack = 0.0
        self.join_on_start = join_on_start
        self.finished = False
        self.failed_report: list[FailedShard] = []
        self.lost_samples = 0  # handed out but whose lease was lost before the ack (replayed)
        self._held: list[_Held] = []
        self.last_batch: list[int] = []
        self.last_batch_epochs: list[int] = []

    def _size(self) -> int:
        return int(self.batch_size() if callable(self.batch_size) else self.batch_size)

    def _pull(self) -> bool:
        """Lease one more shard; False when none is available now."""
        reply = self.client.lease()
        self.failed_report = reply.failed
        lease = reply.lease
        if reply.status == "ok" and lease is not None:
            self._held.append(_Held(lease.epoch, lease.shard, lease.offset,
                                    lease.sample_indices()))
            return True
        if reply.status == "finished":
            self.finished = True
        return False

    def next_batch(self) -> list[int]:
        """The next batch of sample indices (possibly short at the end or while waiting)."""
        self.ack()
        want = self._size()
        batch: list[int] = []
        epochs: list[int] = []
        while len(batch) < want:
            head = next((h for h in self._held if h.taken < len(h.indices)), None)
            if head is None:
                if self.finished:
                    break
                if self._pull():
                    continue
                if self.finished or not self.block or batch:
                    break
                time.sleep(self.poll_s)
                continue
            take = head.indices[head.taken: head.taken + want - len(batch)]
            head.taken += len(take)
            batch.extend(take)
            epochs.extend([head.epoch] * len(take))
        self.last_batch, self.last_batch_epochs = batch, epochs
        return batch

    def ack(self, force: bool = False) -> None:
        """Acknowledge everything handed out so far (call after the optimizer step)."""
        now = time.monotonic()
        if not (force or now - self._last_ack >= self.ack_interval_s
                or any(h.taken == len(h.indices) > h.acked for h in self._held)):
            return
        self._last_ack = now
        keep = []
        for h in self._held:
            if h.taken > h.acked:
                try:
                    self.client.ack(h.epoch, h.shard, h.base + h.taken)
                    h.acked = h.taken
                except Fenced:
                    self._held = []
                    raise
                except LeaseLost:
                    # Our lease expired and the shard went back to TODO: the service will hand
                    # the unacknowledged part out again (at-least-once), so drop our copy.
                    self.lost_samples += h.taken - h.acked
                    continue
            if h.acked < len(h.indices) or h.taken < len(h.indices):
                keep.append(h)
        self._held = keep

    def __iter__(self) -> Iterator[list[int]]:
        if self.join_on_start:
            self.client.join()
            self.join_on_start = False
        while True:
            batch = self.next_batch()
            if not batch and self.finished:
                self.ack(force=True)
                return
            yield batch

    @staticmethod
    def collate(batch: list[Any]) -> object:
        """DataLoader collate_fn that maps an empty batch (peer holds the last shards) to None;
        else default_collate's batch (tensors in the samples' structure)."""
        if not batch:
            return None
        from torch.utils.data import default_collate

        return default_collate(batch)
