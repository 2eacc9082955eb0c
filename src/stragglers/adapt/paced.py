"""Heavy writes (restores, deleting what they replaced) on the commit thread in small, paced
steps, so that other jobs' leases run between them."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, TypeVar

from stragglers.adapt.errors import Busy
from stragglers.adapt.replies import Restored
from stragglers.adapt.restores import PreparedRestore
from stragglers.adapt.space import Reserve
from stragglers.adapt.uploads import UploadBytes
from stragglers.serving_quota import KeyedLimits, LimitExceeded, RequestLimits

log = logging.getLogger(__name__)
T = TypeVar("T")


class PacedWriter:
    """Runs heavy store work through the group committer one small step at a time, each
    followed by a pause, so that it takes at most `share` of the commit thread's time.

    A 655,360-row restore written in one transaction held the commit thread ~5.6 s (every other
    job's lease waited); as RESTORE_CHUNK-row steps it takes longer but a lease waits at most one
    step. Restores at once are bounded per token (from the head: its body's upload too) and,
    once their bodies are here, in all (the others: 503 Busy from the head, or, a body here,
    a wait in turn for a slot; see writing); the bytes of bodies held at once by `bodies` (see
    uploads.UploadBytes).

    A restore's reserve is allocated and given back on a thread of its own (`space`): on the
    event loop, 496 MiB took 0.44 s to allocate and 0.26 s to unlink on tmpfs (2.45 s of zeros
    without posix_fallocate), every call of every job waiting; on the commit thread every
    write would wait alike. The thread is the writer's, shut down by close().
    """

    def __init__(self, commit, store, share: float = 0.25, per_token: int = 1,
                 in_all: int = 1, body_bytes: int = 1 << 27):
        self.commit, self.store, self.share = commit, store, share
        self.by_token = KeyedLimits("token", per_token, 1 << 62)
        self.in_all = KeyedLimits("service", in_all, 1 << 62)
        self.bodies = UploadBytes(body_bytes)
        self._waiting: collections.deque[asyncio.Future[RequestLimits]] = collections.deque()
        self._lock: asyncio.Lock | None = None
        self._calls_seen = 0   # the committer's call count after the last step (and its pause)
        self._collector: asyncio.Task | None = None
        self.space = ThreadPoolExecutor(1, thread_name_prefix="shard-restore-space")

    def close(self) -> None:
        """Stop the reserve's thread (a reserve left by a restore cut here is swept at the
        next start)."""
        self.space.shutdown(wait=True, cancel_futures=True)

    def hold(self, token: str | None) -> RequestLimits:
        """A restore's place among its token's (from its head, while its body arrives); Busy
        when taken."""
        return _held([(self.by_token, token)])

    async def writing(self, wait_s: float) -> RequestLimits:
        """A restore's slot among the service's (max_restores), taken once its body is here: a
        body that never comes holds no other token's restores. When all are taken it waits
        its turn (first come, first served: a slot given back goes straight to the restore
        that waited longest) up to `wait_s`, then Busy. (Its head found a slot free; one
        taken before its body came was a 503, the body thrown away, and the client sent it
        all again.)"""
        if not self._waiting:
            try:
                return _Slot(self)
            except LimitExceeded:
                pass
        turn: asyncio.Future[RequestLimits] = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        try:
            return await asyncio.wait_for(asyncio.shield(turn), wait_s)
        except BaseException as exc:
            if turn.done() and not turn.cancelled():
                turn.result().close()   # (handed a slot as it gave up: the next one's)
            else:
                turn.cancel()
                if turn in self._waiting:
                    self._waiting.remove(turn)
            if isinstance(exc, asyncio.TimeoutError):
                raise Busy(f"a restore is under way (all of max_restores); this one waited"
                           f" {wait_s:g} s (restore_wait_s) for its turn; retry when it is"
                           " done") from None
            raise

    def check_writing(self) -> None:
        """Busy when every slot of writing() is taken now (a restore's head: its body is not
        sent only to wait for one; a slot given back goes to a restore waiting, so none is
        free while any waits)."""
        _held([(self.in_all, None)]).close()

    def _give_on(self) -> None:
        """A slot given back: taken for the restore that waited longest, if any."""
        while self._waiting and self._waiting[0].done():
            self._waiting.popleft()   # (gave up)
        if self._waiting:
            try:
                slot = _Slot(self)
            except LimitExceeded:
                return
            self._waiting.popleft().set_result(slot)

    async def step(self, call):
        """Run `call` on the commit thread, then pause (share of the thread's time) when other
        calls were committed since the last step (an idle service is not kept waiting)."""
        if self._lock is None:   # made on the event loop that serves
            self._lock = asyncio.Lock()
        async with self._lock:
            t0 = time.monotonic()
            result = await self.commit.run(call, paced=True)
            others = self.commit.calls - self._calls_seen - 1
            pause = (time.monotonic() - t0) * (1 - self.share) / self.share if others else 0.0
            await asyncio.sleep(pause)
            self._calls_seen = self.commit.calls
        return result

    async def restore(self, prepared: PreparedRestore, token: str | None, may_create: bool,
                      creator: str | None) -> Restored:
        """Write a prepared restore a chunk at a time, then switch to it (store.restore_*)."""
        store = self.store
        # space to take the rows back, set aside first (DiskFull, nothing written, when none)
        reserve = await self._reserve(prepared)
        try:
            key = await self.commit.run(
                lambda: store.restore_begin(prepared, token, may_create, creator))
            try:
                for i in range(len(prepared.chunks)):
                    await self.step(lambda i=i: store.restore_rows(key, prepared.chunk(i)))
                # the kept lease replies the switch drops, read off the commit thread (json_tree
                # over ~12.5 MB of a 1,024-worker history held it 0.32 s in the switch)
                stale = await self._off_loop(lambda: store.stale_replies(prepared))
                reply = await self.commit.run(
                    lambda: store.restore_finish(prepared, key, token, may_create, creator,
                                                 stale))
            except BaseException:
                # (shielded: a client gone mid-way must not leave the rows staged; the reserve
                # is given back first: its space is what the deletion writes)
                await asyncio.shield(self._take_back(key, reserve.release))
                raise
        finally:
            await asyncio.shield(self._off_loop(reserve.release))
        self.collect()
        return reply

    async def _reserve(self, prepared: PreparedRestore) -> Reserve:
        """store.restore_reserve(prepared) on the reserve's thread; given back there when the
        restore is cancelled (its client gone) while it is allocated."""
        fut = self.space.submit(self.store.restore_reserve, prepared)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(_release_when_made)
            raise

    async def _off_loop(self, call: Callable[[], T]) -> T:
        """call() on the reserve's thread; on the loop after close() (the service stopped)."""
        try:
            fut = self.space.submit(call)
        except RuntimeError:   # (shut down)
            return call()
        return await asyncio.wrap_future(fut)

    async def _take_back(self, key: str, release: Callable[[], None]) -> None:
        """Give the reserve back (`release`), then delete the rows of a restore that will not
        finish, in paced steps, before it is answered (was: marked and left to the collector,
        and on a full disk left staged until a restart); what cannot be deleted now is the
        collector's."""
        try:
            await self._off_loop(release)
        except Exception as exc:  # noqa: BLE001 - the deletion is tried all the same
            log.warning("giving back a restore's reserve failed: %s", exc)
        try:
            await self.commit.run(lambda: self.store.restore_abort(key))
            while await self.step(lambda: self.store.collect_garbage(key)):
                pass
        except Exception as exc:  # noqa: BLE001 - left to the collector (retried)
            log.warning("taking back the rows of an unfinished restore failed (the collector"
                        " deletes them later): %s", exc)
        self.collect()

    def collect(self) -> None:
        """Delete the rows restores left behind, in paced steps (at most one task at a time)."""
        if self._collector is None or self._collector.done():
            self._collector = asyncio.get_running_loop().create_task(self._collect())

    async def _collect(self, first_retry_s: float = 1.0, longest_retry_s: float = 30.0) -> None:
        """Delete until none are left; a step refused (a full disk) is tried again later, at
        most every `longest_retry_s` (was: only after the next restore or start, the space
        they held kept while the service ran)."""
        retry_s = first_retry_s
        while True:
            try:
                while await self.step(self.store.collect_garbage):
                    retry_s = first_retry_s
                return
            except Exception as exc:  # noqa: BLE001 - tried again later
                if retry_s == first_retry_s:
                    log.warning("deleting the rows of replaced restores failed (tried again"
                                " at most every %g s until it succeeds): %s",
                                longest_retry_s, exc)
                await asyncio.sleep(retry_s)
                retry_s = min(2 * retry_s, longest_retry_s)


class _Slot(RequestLimits):
    """A slot of PacedWriter.writing(): closing it gives it to the next restore waiting."""

    def __init__(self, writer: PacedWriter):
        self.writer = writer
        super().__init__([(writer.in_all, None)])

    def close(self) -> None:
        held = self.open and bool(self.pairs)   # (not one refused as it was taken)
        super().close()
        if held:
            self.writer._give_on()


def _held(pairs: list) -> RequestLimits:
    try:
        return RequestLimits(pairs)
    except LimitExceeded as exc:
        raise Busy(f"a restore is under way ({exc.what}); retry when it is done") from None


def _release_when_made(fut: Future) -> None:
    """Give back the reserve `fut` made (its restore was cancelled meanwhile)."""
    if not fut.cancelled() and fut.exception() is None:
        fut.result().release()
