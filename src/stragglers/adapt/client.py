"""HTTP client of the shard service and a pull-based batch sampler for torch's DataLoader."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx

from stragglers.adapt.shards import DatasetConfig, LeaseLost
from stragglers.errors import InputError, StragglersError


class ServiceUnavailable(StragglersError):
    """The shard service did not answer within the retry budget."""


class ShardClient:
    """Talks to one data set on the service; retries while the service restarts."""

    def __init__(self, url: str, dataset: str, worker: str, retry_s: float = 60.0,
                 timeout_s: float = 10.0):
        self.url, self.dataset, self.worker = url.rstrip("/"), dataset, worker
        self.retry_s = retry_s
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s)

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def _call(self, method: str, path: str, body: dict | None = None, params=None) -> dict:
        deadline = time.monotonic() + self.retry_s
        delay = 0.05
        while True:
            try:
                resp = self._http.request(method, path, json=body, params=params)
                break
            except httpx.TransportError as exc:
                # The service may be restarting (it resumes from its SQLite file): retry.
                if time.monotonic() > deadline:
                    raise ServiceUnavailable(f"shard service {self.url} unreachable for"
                                             f" {self.retry_s:.0f}s ({exc})") from exc
                time.sleep(delay)
                delay = min(1.0, delay * 2)
        if resp.status_code == 409:
            raise LeaseLost(resp.json().get("error", "lease lost"))
        if resp.status_code >= 400:
            try:
                msg = resp.json().get("error") or resp.text
            except ValueError:
                msg = resp.text
            raise InputError(f"{self.url}{path}", None, msg)
        return resp.json()

    def _ds(self, op: str) -> str:
        return f"/datasets/{self.dataset}/{op}"

    def create_dataset(self, cfg: DatasetConfig) -> dict:
        """Register the data set (idempotent)."""
        return self._call("POST", "/datasets", {**cfg.__dict__, "name": self.dataset})

    def lease(self, count: int = 1) -> dict:
        """Pull the next shard: {"status": "ok"|"wait"|"finished", "lease": {...}, "failed": [...]}.

        With count > 1, up to `count` shards at once under "leases" (a failure of this worker
        then returns all of them to the queue).
        """
        body = {"worker": self.worker} if count == 1 else {"worker": self.worker, "count": count}
        return self._call("POST", self._ds("lease"), body)

    def ack(self, epoch: int, shard: int, consumed: int) -> dict:
        """Report the samples of a shard consumed so far (renews the lease)."""
        return self._call("POST", self._ds("ack"), {"worker": self.worker, "epoch": epoch,
                                                     "shard": shard, "consumed": consumed})

    def release(self, failure: bool = True, error: str | None = None) -> dict:
        """Give back every shard this worker holds (to the front of the queue)."""
        return self._call("POST", self._ds("release"), {"worker": self.worker,
                                                         "failure": failure, "error": error})

    def status(self) -> dict:
        """Counts per epoch and state, and the FAILED-shard report."""
        return self._call("GET", self._ds("status"))

    def snapshot(self) -> dict:
        """The shard state to store inside a model checkpoint."""
        return self._call("GET", self._ds("snapshot"))

    def restore(self, snap: dict) -> dict:
        """Reset the service to a snapshot taken with the model checkpoint being loaded."""
        return self._call("POST", self._ds("restore"), snap)

    def configure_control(self, config: dict) -> dict:
        """Start the controller for this job incarnation."""
        return self._call("POST", "/control/config", config)

    def report_steps(self, rank: int, records: list, device: str, incarnation: int,
                     since: int = 0) -> dict:
        """Send step records [[step, bpt, batch], ...] to the Monitor; get actions >= since back."""
        return self._call("POST", "/control/report", {"rank": rank, "records": records,
                                                      "device": device, "incarnation": incarnation,
                                                      "since": since})

    def actions(self, since: int) -> dict:
        """Controller actions with seq >= since."""
        return self._call("GET", "/control/actions", params={"since": since})

    def control_state(self) -> dict:
        """The controller's current view."""
        return self._call("GET", "/control/state")


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
    batch is requested). With `block=False` (synchronous training) a batch is short or empty when
    the service says "wait", so no rank blocks while a peer holds the last shards; `finished`
    turns True once the service has nothing left. Use DataLoader(num_workers=0): a prefetching
    loader would request batches before the previous one was trained on.
    """

    def __init__(self, client: ShardClient, batch_size: int | Callable[[], int],
                 block: bool = True, poll_s: float = 0.05, release_on_start: bool = True,
                 ack_interval_s: float = 0.0):
        self.client = client
        self.batch_size = batch_size
        self.block, self.poll_s = block, poll_s
        # 0: ack every batch (a failure replays at most one batch). Larger values save a round
        # trip per step; a failure then replays what was taken since the last ack (a shard
        # completion and ack(force=True), e.g. before a checkpoint, always send).
        self.ack_interval_s = ack_interval_s
        self._last_ack = 0.0
        self.release_on_start = release_on_start
        self.finished = False
        self.failed_report: list[dict] = []
        self.lost_samples = 0  # handed out but whose lease was lost before the ack (replayed)
        self._held: list[_Held] = []
        self.last_batch: list[int] = []
        self.last_batch_epochs: list[int] = []

    def _size(self) -> int:
        return int(self.batch_size() if callable(self.batch_size) else self.batch_size)

    def _pull(self) -> bool:
        """Lease one more shard; False when none is available now."""
        reply = self.client.lease()
        self.failed_report = reply.get("failed", [])
        if reply["status"] == "ok":
            lease = reply["lease"]
            self._held.append(_Held(lease["epoch"], lease["shard"], lease["offset"],
                                    lease["indices"]))
            return True
        if reply["status"] == "finished":
            self.finished = True
        return False

    def next_batch(self) -> list[int]:
        """The next batch of sample indices (possibly short at the end or while waiting)."""
        self.ack()
        want, batch, epochs = self._size(), [], []
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
                except LeaseLost:
                    # Our lease expired and the shard went back to TODO: the service will hand
                    # the unacknowledged part out again (at-least-once), so drop our copy.
                    self.lost_samples += h.taken - h.acked
                    continue
            if h.acked < len(h.indices) or h.taken < len(h.indices):
                keep.append(h)
        self._held = keep

    def __iter__(self) -> Iterator[list[int]]:
        if self.release_on_start:
            self.client.release(failure=True, error=f"{self.client.worker} restarted")
            self.release_on_start = False
        while True:
            batch = self.next_batch()
            if not batch and self.finished:
                self.ack(force=True)
                return
            yield batch

    @staticmethod
    def collate(batch: list):
        """DataLoader collate_fn that maps an empty batch (peer holds the last shards) to None."""
        if not batch:
            return None
        from torch.utils.data import default_collate

        return default_collate(batch)
