"""Way in #2: uploads over HTTP, for jobs without a shared file system.

    PUT /api/jobs/{job}/meta                     meta.json (JSON; creates or updates the job)
    PUT /api/jobs/{job}/ranks/{rank}/parts/{n}   one part (Parquet bytes)

Every write needs the bearer token when one is set. A part is identified by (job, rank, n):
sending the same bytes again answers `duplicate` and changes nothing, so a client may retry
freely; other bytes under a stored number answer 409 and replace nothing (no silent loss). A part
is checked (Parquet, the op-table schema, its rank) before anything is written; it then lands
in the run format under the monitor's data directory (fsynced) and is stored like a watched
file, so both ways in feed the same analysis. The reply comes once the part is durable. The
checks, writes and commit happen on the monitor's ingest thread for a whole batch of parts at
once (one check per column, one directory fsync and one commit per batch), not per request.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, NotRequired, TypedDict

from fastapi import Depends, FastAPI, Path as PathParam, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stragglers.errors import InputError
from stragglers.monitor.jobmeta import check_meta, declared_world, is_run_token, loads_meta, \
    META_BYTES_PER_RANK, meta_bytes_limit, run_token
from stragglers.monitor.parts import MAX_PART, MAX_RANK, PartConflict, check_job_name, \
    check_same_part, fingerprint
from stragglers.monitor.leases import ForeignJob
from stragglers.monitor.service import ANOTHER_NAME, JobFull, MetaChanged, Monitor, PartIn, \
    RunBusy, Superseded
from stragglers.monitor.windows import JobTracker
from stragglers.serving import BodyRefused, canonical_decimal, declared_length
from stragglers.serving_guard import FRAMING_KEY, admit_body, park
from stragglers.serving_quota import Backpressure, KeyedLimits, LimitExceeded, MintRate, \
    RateLimited, RequestLimits, quota_client
import os
from dataclasses import fields
from pathlib import Path

import msgspec

from stragglers.trace.model import JobMeta
from stragglers.trace.runformat import META_FILE

log = logging.getLogger(__name__)

MAX_COUNT_DIGITS = 12   # X-Stragglers-Dropped: fits SQLite's 64-bit integers with room
# a part body not starting with PAR1 is refused once this many bytes arrived (not read to its
# end: a flood of 16 MiB junk bodies cost a well-behaved upload 4x); smaller ones are refused
# by the Parquet reader, naming what is wrong
MAGIC_AFTER = 1 << 20


class MetaUpload(BaseModel):
    """meta.json as a client sends it (the recorder's JobMeta.to_dict())."""

    model_config = ConfigDict(strict=True, extra="forbid")

    name: str = Field(min_length=1, max_length=200)
    run_id: str = Field("0", max_length=200)
    dp_size: int = Field(ge=1, le=1_000_000)
    pp_size: int = Field(ge=1, le=100_000)
    tp_size: int = Field(1, ge=1, le=100_000)
    dsp_size: int = Field(1, ge=1, le=100_000)
    vpp_size: int = Field(1, ge=1, le=1_000)
    ep_size: int = Field(1, ge=1, le=100_000)
    world_size: int = Field(0, ge=0, le=MAX_RANK + 1)
    extra: dict[str, Any] = Field(default_factory=dict)


class HTTPProblem(Exception):
    """A refused request: status code and a one-line message naming what is wrong; `close`:
    its body may be unread (the connection is closed rather than read to its end)."""

    def __init__(self, status: int, message: str, reason: str, close: bool = False,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.message, self.reason, self.close = status, message, reason, close
        self.retry_after_s = retry_after_s


def plain_number(text: str | None, where: str, top: int) -> int:
    """A number given in a path or query as one writes it (serving.canonical_decimal), else 422
    naming where it was and what was expected (pydantic read '+0', '00' and Unicode digits as
    0)."""
    value = canonical_decimal(text, top) if text is not None else None
    if value is None:
        raise HTTPProblem(422, f"{where}: {str(text)[:40]!r} is not a number as expected: 0.."
                          f"{top} in ASCII digits, without sign, spaces or leading zeros",
                          "bad_request")
    return value


PART_TYPES = ("application/vnd.apache.parquet", "application/x-parquet",
              "application/octet-stream")
META_TYPES = ("application/json",)


def check_media_type(request: Request, accepted: tuple[str, ...], what: str) -> None:
    """415 when a write's body is declared as another type than the route takes (its first
    of `accepted`); a body that declares none is taken as the route's (recorders and scripts
    send parts bare). A form or text body was read as Parquet or JSON: a body is taken only
    as what it says it is. JSON in any charset but UTF-8 is another type too, and a body in
    a content coding (gzip) is not what the route reads: 415 naming Content-Encoding."""
    coding = request.headers.get("content-encoding")
    if coding is not None and coding.strip().lower() not in ("", "identity"):
        raise HTTPProblem(415, f"request header 'Content-Encoding': {coding[:80]!r}; expected "
                          f"none (or identity) for {what}", "bad_request", close=True)
    given = request.headers.get("content-type")
    if given is None:
        return
    media, *params = (p.strip().lower() for p in given.split(";"))
    charsets = [p.partition("=")[2].strip().strip('"') for p in params
                if p.partition("=")[0].strip() == "charset"]
    if media in accepted and (media != "application/json"
                              or all(c in ("utf-8", "utf8") for c in charsets)):
        return
    raise HTTPProblem(415, f"request header 'Content-Type': {given[:80]!r}; expected "
                      f"{accepted[0]}{' (UTF-8)' if accepted == META_TYPES else ''} for "
                      f"{what}, or none", "bad_request", close=True)


class BodyBudget:
    """Bytes of upload bodies held at once, across requests (used on the event loop only).

    A body is counted as its bytes arrive, until its part is stored or refused. A request
    whose Content-Length would take the bytes held past the limit is answered 503 before its
    body is read, and one whose bytes do while it is read is answered 503 then; the uploader
    retries it later. So a flood of uploads holds at most `limit` bytes (plus one part: a body
    alone is always let in, or a part larger than the limit could never be stored), and slow
    clients that declare 64 MiB and send a byte a second hold what they sent, not what they
    declared (four of them once held the whole budget).

    With `writers` (their KeyedLimits), a full budget is shared fairly: a writer holding less
    than limit / (writers holding bytes) is still let in, and one holding more is refused its
    next bytes (its connection closed, its bytes given back) — writers that kept bodies coming
    just fast enough not to be cut for slowness once held the whole budget between them, and
    every other writer's upload was answered 503. So `held` may pass `limit` by a fair share.
    """

    def __init__(self, limit: int, writers: KeyedLimits | None = None):
        self.limit, self.held, self.writers = limit, 0, writers

    def check(self, declared: int, what: str, key: object = None) -> None:
        if self.held and self.held + declared > self.limit and not self._fair(key, declared):
            raise self._busy(what)

    def take(self, n: int, what: str, mine: int = 0, key: object = None) -> None:
        if self.held - mine > 0 and self.held + n > self.limit and not self._fair(key, n):
            raise self._busy(what)
        self.held += n

    def _fair(self, key: object, n: int) -> bool:
        """Whether writer `key`, holding `n` bytes more, stays within its fair share."""
        if self.writers is None or key is None:
            return False
        held = self.writers.held
        return held.get(key, 0) + n <= self.limit / (len(held) + (key not in held))

    def _busy(self, what: str) -> HTTPProblem:
        return HTTPProblem(503, f"request body: the monitor holds {self.held} bytes of "
                           f"uploads (at most {self.limit}); retry {what} later", "busy",
                           close=True)

    def give(self, n: int) -> None:
        self.held -= n


class DiskRoom:
    """Whether the uploads folder's file system has room for one more body: an upload is taken
    only while the disk keeps, besides it, room for every body the monitor may hold at once
    (max_upload_bytes_held, all of which it has acknowledged or may yet) and `floor` more for
    the database; past that, 507 before its body is read. Without it a client needing no
    token (a loopback monitor) filled the disk at the new-job rate, and every write of the
    service then failed, the store's included."""

    def __init__(self, path: Path, held: int, floor: int = 64 * 2**20, every_s: float = 1.0):
        self.path, self.reserve, self.every_s = path, held + floor, every_s
        self._free, self._at = 0, -1e9

    def free(self) -> int:
        """Free bytes now (a statvfs at most every `every_s`: a remote file system may be slow)."""
        now = time.monotonic()
        if now - self._at >= self.every_s:
            try:
                self._free = shutil.disk_usage(self.path).free
            except OSError:   # the folder is gone: the write will say what is wrong
                self._free = 1 << 62
            self._at = now
        return self._free

    def check(self, declared: int, what: str) -> None:
        """HTTPProblem 507 when `declared` more bytes would leave less than the reserve."""
        free = self.free()
        if free - declared < self.reserve:
            raise HTTPProblem(507, f"the monitor's disk has {free} bytes free, and keeps "
                              f"{self.reserve} for uploads under way and its database; "
                              f"{what} was not stored (retry later)", "disk_full", close=True)
        self._free -= declared   # (until the next statvfs: a burst cannot pass it at once)


async def read_body(request: Request, limit: int, what: str,
                    budget: BodyBudget | None = None, share: RequestLimits | None = None,
                    magic: bytes = b"") -> bytes:
    """The request body, refusing more than `limit` bytes before reading them all; with a
    budget (and the writer's share), its bytes are taken from it as they arrive (the caller
    gives back len(body) once done); a body that does not start with `magic` is refused at its
    first bytes (a Parquet part starts with PAR1: a junk flood is not read to its end).
    The caller judged the rest of the head (token, job) first: the body is admitted here."""
    from starlette.requests import ClientDisconnect

    try:
        declared = declared_length(request, limit)
    except BodyRefused as refused:
        raise _problem(refused, what) from None
    key = share.pairs[0][1] if share is not None and share.pairs else None
    if budget is not None:
        budget.check(declared or 0, what, key)
    if share is not None and not share.fits(declared or 0):
        raise HTTPProblem(429, f"request body: {declared} bytes would take this writer past "
                          f"its max_upload_bytes_per_writer; retry {what} later", "busy",
                          close=True)
    # the head passed every check: only now is 100 Continue sent and the body read
    admit_body(request.scope)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            # (with what the reads carried besides the body: a chunked body's extensions)
            if size + len(chunk) + request.scope.get(FRAMING_KEY, 0) > limit:
                raise _problem(BodyRefused("too_large", limit, size + len(chunk)), what)
            if budget is not None:
                budget.take(len(chunk), what, size, key)
            if share is not None:
                try:
                    share.take(len(chunk), size)
                except LimitExceeded as exc:
                    if budget is not None:
                        budget.give(len(chunk))
                    raise HTTPProblem(429, f"request body: {exc.what} (max_upload_bytes_per_"
                                      f"writer); retry {what} later", "busy",
                                      close=True) from None
            size += len(chunk)
            if magic and size - len(chunk) < MAGIC_AFTER <= size and \
                    b"".join((chunks + [chunk])[:len(magic)])[:len(magic)] != magic:
                raise HTTPProblem(422, f"request body: not a readable Parquet file (it does "
                                  f"not start with {magic.decode()}; the rest of {what} was "
                                  "not read)", "bad_part", close=True)
            chunks.append(chunk)
    except ClientDisconnect:
        _give(budget, share, size)
        raise _problem(BodyRefused("client_gone", limit, size), what) from None
    except BaseException:
        _give(budget, share, size)
        raise
    return b"".join(chunks)


def _declared(request: Request, limit: int) -> int:
    """The body's declared length for the disk check (`limit` when chunked or not a number:
    read_body refuses a bad one)."""
    declared = request.headers.get("content-length", "")
    return min(int(declared), limit) if declared.isascii() and declared.isdigit() and \
        len(declared) <= 18 else limit


def _give(budget: BodyBudget | None, share: RequestLimits | None, n: int) -> None:
    """Give `n` body bytes back to the service's budget and the writer's share."""
    if budget is not None:
        budget.give(n)
    if share is not None:
        share.give(n)


# a writer's changed meta.json bodies while another job uploads: this many at once, then
# meta_changes_per_minute; a change whose turn is further off than META_CHANGE_MAX_WAIT_S is
# answered 429 (after that wait: a refusal is an answer a loop spins on); another job counts
# as uploading for META_ACTIVE_S after its latest part
META_CHANGE_BURST, META_CHANGE_MAX_WAIT_S, META_ACTIVE_S = 4.0, 8.0, 1.0


def writer_limits(cfg) -> KeyedLimits:
    """Uploads in progress and bytes held per writer (see writer_key)."""
    return KeyedLimits("writer", cfg.max_uploads_per_writer, cfg.max_upload_bytes_per_writer)


def writer_key(request: Request, job: str) -> tuple:
    """Who a writer is: its bearer token and client address, or from loopback its token and
    job (every local process is 127.0.0.0/8, any address of it: keyed by address, one local
    process holding its share left every other local job's uploads 429)."""
    auth = request.headers.get("authorization", "")
    digest = hashlib.sha256(auth.encode("latin-1", "replace")).hexdigest()[:16]
    client = quota_client(request.client.host if request.client else None)
    return (digest, client) if client is not None else (digest, "loopback", job)


def writer_share(request: Request, limits: KeyedLimits, job: str) -> RequestLimits:
    """This request's share of its writer's limits; 429 when the writer is at one of them."""
    try:
        return RequestLimits([(limits, writer_key(request, job))])
    except LimitExceeded as exc:
        raise HTTPProblem(429, f"request: {exc.what} (max_uploads_per_writer); retry later",
                          "busy", close=True) from None


def _problem(refused: BodyRefused, what: str) -> HTTPProblem:
    """A body refused while reading, in the API's error format."""
    if refused.kind == "bad_length":
        return HTTPProblem(400, "request header 'Content-Length': expected a number",
                           "bad_request", close=True)
    if refused.kind == "client_gone":
        return HTTPProblem(400, f"request body: the client hung up after {refused.size} bytes "
                           f"of {what}", "client_gone")
    if refused.declared is not None:
        return HTTPProblem(413, f"request body: {refused.declared} bytes is more than the "
                           f"{refused.limit} bytes allowed for {what}", "too_large", close=True)
    return HTTPProblem(413, f"request body: more than the {refused.limit} bytes allowed for "
                       f"{what}", "too_large", close=True)


def add_upload_routes(app: FastAPI, monitor: Monitor, require_write):
    """The two upload endpoints, on `app`; returns the part upload's own coroutine
    `store_part(request, job, rank, part)` (what the route runs once its parameters are
    checked), for the fast path in front of the app (app.py, UploadFastPath)."""
    cfg = monitor.config
    # job → (its run's token, its tracker, rank → drop count stored by this process): a count
    # is written only when it grew. Per run, not per job: a new run's reset deletes the job's
    # counts, and a cache by job hid the new run's up to the old run's (round 14 #7). A run
    # without a token is known by its tracker (a new run gets a new one; held weakly)
    reported: dict[str, tuple[str | None, weakref.ref[Any], dict[int, int]]] = {}
    writers = writer_limits(cfg)
    budget = BodyBudget(cfg.max_upload_bytes_held, writers)
    # new jobs per minute, per client address and in all: one writer creating jobs in a loop
    # would take every one of max_jobs (the jobs tracked already are no new ones)
    new_jobs = MintRate("job", cfg.new_jobs_per_client_per_minute, cfg.new_jobs_per_minute)
    # one meta.json of a job registered and written at a time: two at once shared a temp file
    # (503 for one), and the file could end up the older one while the store held the newer
    meta_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
    room = DiskRoom(monitor.data_dir, cfg.max_upload_bytes_held)
    # the largest meta.json body: max_meta_bytes besides the per-rank lists, which grow with
    # the world (a real 65,536-rank job's is 22 MB); a body is held to its own world's bound
    meta_limit = meta_bytes_limit(cfg.max_meta_bytes, cfg.max_world_size)
    # job → (digest of the meta.json body last registered, the JobMeta it became): the same
    # body again, while the job's tracker still holds that JobMeta, changes nothing and is
    # answered without being parsed, checked, written or stored again (two writers re-sending
    # a 1 MiB meta.json in a loop made another job's uploads 11.7x slower); held weakly (a
    # forgotten job's JobMeta, 22 MB for 65,536 ranks, is not kept alive by this)
    registered_meta: dict[str, tuple[bytes, weakref.ref[JobMeta], int]] = {}
    # a changed meta.json costs a check of every value, a rewrite and fsync of the file, the
    # store's row and the monitor's lock (2 clients each changing their job's 48 KB meta.json
    # before every part made another job's uploads 3.9x slower): while another job uploads,
    # a writer's changes are paced (a recorder changes its job's a few times a run)
    meta_pace = Backpressure("writer's meta.json changes", free=0,
                             rate=cfg.meta_changes_per_minute / 60.0,
                             burst=META_CHANGE_BURST - 1, max_wait_s=META_CHANGE_MAX_WAIT_S)
    uploading: OrderedDict[str, float] = OrderedDict()   # job → its latest part (monotonic)

    def others_uploading(job: str) -> bool:
        """Whether a job other than `job` sent a part within META_ACTIVE_S."""
        since = time.monotonic() - META_ACTIVE_S
        while uploading and next(iter(uploading.values())) < since:
            uploading.popitem(last=False)
        return len(uploading) > (job in uploading)

    async def paced_change(request: Request, job: str) -> None:
        """Wait the writer's turn for a changed meta.json while another job uploads; 429
        (after META_CHANGE_MAX_WAIT_S) when it is further off, 503 when the client left."""
        if not others_uploading(job):
            return
        key = writer_key(request, job)
        try:
            wait = meta_pace.turn(key)
        except RateLimited as exc:
            await park(request.scope, exc.park_s or 0.0)   # type: ignore[arg-type]
            raise HTTPProblem(429, f"path 'job': {job!r}: its meta.json changes faster than "
                              f"{cfg.meta_changes_per_minute:g} a minute (after "
                              f"{META_CHANGE_BURST:g}) while other jobs upload "
                              "(meta_changes_per_minute); retry later", "busy",
                              retry_after_s=exc.retry_after_s) from None
        meta_pace.leave(key)   # (its turn is taken: a pace, not a count in progress)
        if wait > 0 and not await park(request.scope, wait):   # type: ignore[arg-type]
            raise HTTPProblem(503, "request: its connection was closed while it waited its "
                              "turn; retry on an open connection", "client_gone")

    @app.put("/api/jobs/{job}/meta", dependencies=[Depends(require_write)])
    async def put_meta(request: Request, job: str = PathParam(max_length=128)):
        """Create or update a job from its meta.json (JSON body)."""
        check_job_name(job, "path")
        refuse_unshared(monitor)
        check_media_type(request, META_TYPES, "meta.json")
        new, client = False, quota_client(request.client.host if request.client else None)
        if job not in monitor.directories:
            try:
                new = new_jobs.admit(job, client)
            except RateLimited as exc:
                raise HTTPProblem(429, f"path 'job': {exc.what} (new_jobs_per_minute); "
                                  f"retry {job!r} later", "busy", close=True,
                                  retry_after_s=exc.retry_after_s) from None
        try:
            return await _put_meta(request, job)
        except BaseException:
            # a job refused after it was counted (a bad or too large body, a conflict, the
            # monitor full) gives its place back: bad meta.json bodies used up the minute's
            # new jobs, and the next valid one was 429
            if new:
                new_jobs.refund(job, client)
            raise

    async def _put_meta(request: Request, job: str) -> dict[str, Any]:
        """put_meta once the job was counted as new (or known)."""
        room.check(_declared(request, meta_limit), "meta.json")
        share = writer_share(request, writers, job)
        try:
            body = await read_body(request, meta_limit, "meta.json", budget, share)
            digest = hashlib.sha256(body).digest()
            tracker = monitor.trackers.get(job)
            seen = registered_meta.get(job)
            was: JobMeta | None = seen[1]() if seen is not None and seen[0] == digest else None
            if seen is not None and was is not None and getattr(tracker, "meta", None) is was and \
                    monitor.directories.get(job) == monitor.data_dir / job and \
                    job not in monitor.quarantined:
                _give(budget, share, len(body))
                return {"job": job, "status": "ok", "world_size": seen[2]}
            # (a body that declares no world, or none this monitor takes, gets no allowance
            # for per-rank lists: its own refusal follows if it is small enough to be read)
            world = declared_world(body) or 0
            world = world if world <= cfg.max_world_size else 0
            if len(body) > meta_bytes_limit(cfg.max_meta_bytes, world):
                _give(budget, share, len(body))
                raise HTTPProblem(413, f"request body: {len(body)} bytes is more than the "
                                  f"{meta_bytes_limit(cfg.max_meta_bytes, world)} bytes allowed "
                                  f"for the meta.json of {world} ranks (max_meta_bytes, "
                                  f"{cfg.max_meta_bytes}, and {META_BYTES_PER_RANK} per rank)",
                                  "too_large")
            try:
                meta = MetaUpload.model_validate_json(body)
            except ValidationError as exc:
                raise HTTPProblem(422, validation_message(exc, "request body"),
                                  "bad_meta") from None
            try:
                loads_meta(body, "request body")
            except InputError as exc:
                raise HTTPProblem(422, str(exc), "bad_meta") from None
            finally:
                _give(budget, share, len(body))   # (meta bodies count while parsed)
        finally:
            share.close()
        directory = monitor.data_dir / job
        known = monitor.directories.get(job)
        if known is not None and known != directory:
            raise HTTPProblem(409, f"path 'job': {job!r} is a watched run ({known}); uploads "
                              "cannot write into it", "conflict")
        if known is not None and (directory / META_FILE).is_file():
            # (a job's first meta.json is its creation, paced by new_jobs_per_minute: paced
            # as a change too, a host starting 8 jobs with one token had 4, then one per 10 s)
            await paced_change(request, job)
        raw = meta.model_dump()
        lock = meta_locks.get(job)
        if lock is None:
            lock = meta_locks[job] = asyncio.Lock()
        async with lock:
            try:
                checked = await run_in_threadpool(check_meta, raw, directory / META_FILE,
                                                  cfg.max_meta_bytes)
                # written first, registered after: a write that fails (a full disk: 507) left
                # the job's row stored; a registration refused puts the folder back as it was
                undo = await run_in_threadpool(write_meta_undoably, directory, checked)
                try:
                    registered = await run_in_threadpool(monitor.register_job, job,
                                                         directory, "http", raw)
                except BaseException:
                    await run_in_threadpool(undo)
                    raise
            except RunBusy as exc:
                raise HTTPProblem(503, f"path 'job': {exc.problem}", "busy",
                                  retry_after_s=1.0) from None
            except Superseded as exc:
                raise HTTPProblem(409, f"path 'job': {exc.problem}", "superseded_run") from None
            except InputError as exc:
                if exc.source.endswith("meta.json"):   # the body's sizes disagree: name the
                    field = f": field '{exc.field}'" if exc.field else ""   # body's field,
                    raise HTTPProblem(422, f"request body{field}: {exc.problem}",   # not the
                                      "bad_meta") from None                # server's file
                # the name is taken by another run, or the monitor is full: it cannot be made
                raise HTTPProblem(409, f"path 'job': {exc.problem}", "conflict") from None
        tracker = monitor.trackers.get(job)
        if getattr(tracker, "meta", None) is registered:
            if len(registered_meta) >= 2 * cfg.max_jobs:   # (the forgotten jobs' go)
                for gone in [k for k, (_, ref, _) in registered_meta.items() if ref() is None]:
                    del registered_meta[gone]
            registered_meta[job] = (digest, weakref.ref(registered), registered.world_size)
        else:
            registered_meta.pop(job, None)
        return {"job": job, "status": "ok", "world_size": registered.world_size}

    async def check_run(request: Request, job: str, meta: object) -> None:
        """Whether a part is of the job's current run (its X-Stragglers-Run is the run's
        token): else 409 superseded_run only for a run the job's row lists as replaced (a
        definite answer: its uploader stops), and 503 with Retry-After for a token the monitor
        does not know yet — a new run whose rank 0 meta.json has not come (was told
        'superseded' and stopped for good; stored under a tokenless run, it was deleted by its
        own run's reset). A part without the header (a writer that does not send it) is taken
        as the job's current run's."""
        sent = request.headers.get("x-stragglers-run")
        if sent is None:
            return
        if not is_run_token(sent):
            raise HTTPProblem(422, "request header 'X-Stragglers-Run': expected a run token "
                              "(1-64 letters, digits, '-' or '_')", "bad_request")
        current = run_token(meta)
        if sent == current:
            return
        if await run_in_threadpool(monitor.store.was_replaced, job, sent):
            raise HTTPProblem(409, f"path 'job': this part is of run {sent}, which a newer run "
                              f"of job {job!r} replaced (run {current}); give each run its own "
                              "job name (monitor_job)", "superseded_run")
        raise HTTPProblem(503, f"path 'job': this part is of run {sent}, which job {job!r} "
                          f"does not know yet (its run is {current or 'one without a token'}); "
                          "it is taken once its run's meta.json is (try again)", "busy",
                          retry_after_s=1.0)

    async def store_part(request: Request, job: str, rank: int, part: int) -> PartReply:
        """Store one part (Parquet bytes); idempotent by (job, rank, part)."""
        check_job_name(job, "path")
        refuse_unshared(monitor)
        # a job held here is a dict read; any other is looked up (the store, a rebuild) under
        # the monitor's lock, which the ingest holds while it takes a batch: off the event
        # loop, or an upload for a made-up job name held every request, /health included
        tracker: JobTracker | ForeignJob | None = monitor.trackers.get(job)
        if tracker is None:
            tracker = await run_in_threadpool(monitor.tracker, job)
        known = monitor.directories.get(job)
        if tracker is None and job in monitor.quarantined and known is not None and \
                known != monitor.data_dir / job:   # (its remedies are not an uploader's)
            raise HTTPProblem(409, f"path 'job': {job!r} is a watched run (set aside); uploads "
                              "cannot write into it", "conflict")
        if tracker is None and job in monitor.quarantined:
            raise HTTPProblem(409, f"path 'job': job {job!r} is set aside (its stored rows "
                              f"cannot be used: {monitor.quarantined[job][:200]}); "
                              f"{monitor.remedies.get(job, ANOTHER_NAME)}", "quarantined")
        if tracker is None:
            raise HTTPProblem(404, f"path 'job': unknown job {job!r}; PUT /api/jobs/{job}/meta "
                              "first", "unknown_job")
        if monitor.directories.get(job) != monitor.data_dir / job:
            raise HTTPProblem(409, f"path 'job': {job!r} is a watched run; uploads cannot "
                              "write into it", "conflict")
        world = tracker.meta.world_size if isinstance(tracker.meta, JobMeta) else 0
        if rank >= world:
            raise HTTPProblem(422, f"path 'rank': {rank} is not a rank of job {job!r} (world "
                              f"size {world})", "bad_rank")
        await check_run(request, job, tracker.meta)
        uploading[job] = time.monotonic()   # (a changed meta.json is paced meanwhile)
        uploading.move_to_end(job)
        dropped = request.headers.get("x-stragglers-dropped")
        if dropped is not None and not (dropped.isascii() and dropped.isdigit()
                                        and len(dropped) <= MAX_COUNT_DIGITS):
            raise HTTPProblem(422, "request header 'X-Stragglers-Dropped': expected a count "
                              f"of 0 to {MAX_COUNT_DIGITS} digits", "bad_request")
        check_media_type(request, PART_TYPES, "a part")
        try:   # a body over max_part_bytes is 413 whatever the job holds or the disk has
            declared_length(request, cfg.max_part_bytes)   # (it was answered 507 "job full")
        except BodyRefused as refused:
            raise _problem(refused, "a part") from None
        room.check(_declared(request, cfg.max_part_bytes), "the part")
        # a part that cannot fit the job's max_job_bytes is refused before its body is read
        # (the ingest thread checks again with the bytes that arrived: a chunked body, or
        # uploads of the job stored meanwhile)
        length = request.headers.get("content-length", "")
        declared = int(length) if length.isascii() and length.isdigit() and \
            len(length) <= 18 else 0   # chunked: checked by the ingest thread alone
        stored = monitor.job_bytes(job, read=False)
        if stored is None:   # not counted yet here: one read of the store, off the loop (the
            stored = await run_in_threadpool(monitor.store.job_bytes, job)   # count is the
            # ingest thread's to keep: a read here could overwrite it with an older value
        if declared and stored + declared > cfg.max_job_bytes and \
                not tracker.knows(rank, part):   # (a retry of a stored part: a duplicate)
            raise job_full(JobFull(_source(job, rank, part), None, f"job {job!r} stores "
                                   f"{stored} bytes of parts; {declared} more would pass its "
                                   f"max_job_bytes ({cfg.max_job_bytes})"), close=True)
        share = writer_share(request, writers, job)
        try:
            body = await read_body(request, cfg.max_part_bytes, "a part", budget, share,
                                   b"PAR1")
            held = [len(body)]   # given back here, or by the ingest thread once done with body
            try:
                return await _store(job, rank, part, tracker, body, dropped, held, share)
            finally:
                _give(budget, share, held[0])
        finally:
            share.close()

    async def _store(job: str, rank: int, part: int, tracker, body: bytes, dropped: str | None,
                     held: list[int], share: RequestLimits) -> PartReply:
        """store_part once the body is read and counted in the budget."""
        # (hashing a large body off the event loop; hashlib drops the GIL for it)
        digest = fingerprint(body) if len(body) < 1 << 20 else \
            await run_in_threadpool(fingerprint, body)
        if tracker.knows(rank, part):
            # a retry (same bytes) is a duplicate; other bytes under a stored number: 409
            stored = await run_in_threadpool(monitor.store.part_digest, job, rank, part)
            try:
                check_same_part(stored, digest, job, rank, part)
            except PartConflict as exc:
                raise HTTPProblem(409, str(exc), "conflict") from None
            # (a retry carries the uploader's count as it is now: its first answer lost, the
            # buffer dropped more meanwhile, and no later part may follow; round 14 #8)
            await note_dropped(job, rank, tracker, dropped)
            return {"status": "duplicate"}
        # the ingest thread checks the bytes (with the other parts of its batch), writes them
        # into the run format and stores the part; the reply waits until it is durable
        done: Future = Future()
        item = PartIn(job, rank, part, "http", body=body, digest=digest, done=done)
        # the body is held until the ingest thread answers (written or refused), even if this
        # request is gone by then (a client that hangs up does not free the budget early)
        loop, n = asyncio.get_running_loop(), held[0]

        def give_back(_):
            try:
                loop.call_soon_threadsafe(_give, budget, share, n)
            except RuntimeError:   # the service is shutting down: its loop is closed
                pass

        done.add_done_callback(give_back)
        held[0] = 0
        monitor.submit(item)
        try:
            status = await asyncio.wrap_future(done)
        except PartConflict as exc:    # another upload of this number was stored first
            raise HTTPProblem(409, str(exc), "conflict") from None
        except JobFull as exc:
            raise job_full(exc) from None
        except MetaChanged as exc:   # (another instance rewrote the job's meta meanwhile)
            raise HTTPProblem(503, f"path 'job': {exc.problem}", "busy",
                              retry_after_s=1.0) from None
        except InputError as exc:
            if exc.field == "job":   # forgotten while queued (expire_empty_jobs)
                raise HTTPProblem(404, f"path 'job': unknown job {job!r}; PUT /api/jobs/{job}/"
                                  "meta first", "unknown_job") from None
            raise HTTPProblem(422, str(exc), "bad_part") from None
        await note_dropped(job, rank, tracker, dropped)
        return {"status": status, "records": item.records}

    async def note_dropped(job: str, rank: int, tracker, dropped: str | None) -> None:
        """Store the drop count a stored (or duplicate) part carried, when it grew in its run."""
        # the uploader sends its drop count with every part: it is stored when it grew, not
        # with a durable commit (and a dashboard refresh) per upload
        if dropped is None:
            return
        run = run_token(tracker.meta)
        seen = reported.get(job)
        if seen is None or seen[0] != run or (run is None and seen[1]() is not tracker):
            if len(reported) >= 2 * cfg.max_jobs:   # (the forgotten jobs' go)
                for gone in [k for k in reported if k not in monitor.directories]:
                    del reported[gone]
            seen = reported[job] = (run, weakref.ref(tracker), {})
        if int(dropped) > seen[2].get(rank, -1):
            # (in the run the part was accepted for, or nowhere: a new run committed while
            # the part was in flight wrote the old run's count into the new run's rows)
            if await run_in_threadpool(monitor.note_dropped, job, rank, int(dropped),
                                       getattr(tracker, "run", None)):
                seen[2][rank] = int(dropped)

    @app.put("/api/jobs/{job}/ranks/{rank}/parts/{part}",
             dependencies=[Depends(require_write)])
    async def put_part(request: Request, job: str = PathParam(max_length=128),
                       rank: str = PathParam(max_length=64),
                       part: str = PathParam(max_length=64)):
        """Store one part (Parquet bytes); idempotent by (job, rank, part)."""
        return await store_part(request, job, plain_number(rank, "path 'rank'", MAX_RANK),
                                plain_number(part, "path 'part'", MAX_PART))

    return store_part


class PartReply(TypedDict):
    """A stored part's reply: `ok` (with the records stored) or `duplicate` (a retry)."""

    status: str
    records: NotRequired[int]


def refuse_unshared(monitor: Monitor) -> None:
    """503 while this instance's uploads folder is not the other live instances' (a part
    acknowledged here could not be read by the one analysing its job)."""
    problem = monitor.unshared
    if problem is not None:
        raise HTTPProblem(503, f"uploads refused: {problem}", "unshared_uploads", close=True,
                          retry_after_s=30.0)


def job_full(exc: JobFull, close: bool = False) -> HTTPProblem:
    """A part refused for its job's max_job_bytes: 507, which the uploader does not retry."""
    return HTTPProblem(507, f"{exc.source}: {exc.problem}; nothing was stored", "job_full",
                       close=close)


def _source(job: str, rank: int, part: int) -> str:
    """How an uploaded part is named in its refusal (as the ingest thread names it)."""
    return f"part {job}/{rank}/{part}"


def write_meta_file(directory: Path, meta: JobMeta) -> Path:
    """meta.json of an uploaded job, atomically (temp file, fsync, rename); a full disk leaves
    no temp file behind and the error goes to the client as a 507 (serving.ServiceGuard)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / META_FILE
    # the C encoder over the fields as they are (json.dumps(indent=2) runs in Python and
    # asdict copies every value: 5.3 s for the 22 MB meta.json of 65,536 ranks, now 0.07 s)
    top = {f.name: getattr(meta, f.name) for f in fields(meta)}
    _replace_file(path, msgspec.json.format(msgspec.json.encode(top, order="sorted"), indent=2))
    return path


def write_meta_undoably(directory: Path, meta: JobMeta) -> Callable[[], None]:
    """write_meta_file, and what puts the folder back as it was before (the registration that
    follows may be refused); a write that fails leaves no folder it created."""
    created = not directory.exists()
    path = directory / META_FILE
    try:
        previous: bytes | None = path.read_bytes()
    except FileNotFoundError:
        previous = None
    try:
        write_meta_file(directory, meta)
    except BaseException:
        if created:
            _remove_dir(directory)
        raise

    def undo() -> None:
        try:
            if previous is not None:
                _replace_file(path, previous)
                return
            path.unlink(missing_ok=True)
            if created:
                _remove_dir(directory)
        except OSError as exc:
            log.warning("meta.json of %s not put back: %s", directory, exc.strerror or exc)

    return undo


def _replace_file(path: Path, data: bytes) -> None:
    """`path` holds `data`, atomically (temp file, fsync, rename; no temp file left)."""
    tmp = path.with_name(f"{META_FILE}.{os.getpid()}.{threading.get_ident():x}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _remove_dir(directory: Path) -> None:
    """A folder this request created, if it is empty (another request may have filled it)."""
    try:
        directory.rmdir()
    except OSError:
        pass


def validation_message(exc: ValidationError, where: str) -> str:
    """pydantic's first error as one line naming the field."""
    err = exc.errors()[0]
    loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "(root)"
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"{where}: field '{loc}': {err.get('msg', 'invalid')}{more}"
