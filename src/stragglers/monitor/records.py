"""The monitor's typed records: window rows, alerts, job rows and the store's replies.

A window row carries the analysis result's own types (`whatif.result.Finding`, `WorkerScore`)
with what the monitor adds (global ranks, hosts, a headline). The store returns these at its
boundary, SQLite and PostgreSQL alike; their JSON form (`plain`) is what the store keeps in its
JSON columns and what `/api` serves, unchanged from when they were dicts.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from stragglers.whatif.result import Finding, WorkerScore, plain

__all__ = ["Alert", "AlertLogEntry", "Annotations", "ClaimedMessage", "JobMark", "JobRecord",
           "JobSummary", "Labels", "LayoutEntry", "Lease", "LeaseRow", "OutboxRow", "PartCount",
           "PartIndex", "PartRow", "Place", "Refusal", "WindowFinding", "WindowRow", "WindowScore",
           "WindowSummary", "plain", "sorted_json"]

Lease = tuple[str, int]     # (instance, epoch) a job's lease was taken under (leases.py)
Refusal = tuple[str, str]   # (part file, problem) of a part refused when its window read it


class WindowScore(WorkerScore):
    """S_w of one worker in a window, with its global rank and host; `decomposed` is False
    when S was below the attribution threshold (every score 1.0: no worker to blame)."""

    decomposed: bool = False


class WindowFinding(Finding):
    """A finding of a window's diagnosis with the global ranks and hosts it points at."""

    ranks: list[int] = []
    hosts: list[str] = []
    headline: str = ""


class WindowRow(msgspec.Struct):
    """One analysed window as the store keeps it (an `error` row when it could not be)."""

    job: str
    idx: int
    first_step: int
    last_step: int
    steps: list[int]
    slowdown: float | None = None
    waste: float | None = None
    t_base: float | None = None
    t_ideal: float | None = None
    sim_error: float | None = None
    m_w: float | None = None
    m_s: float | None = None
    scores: list[WindowScore] = []
    diagnosis: list[WindowFinding] = []
    missing_ranks: list[int] = []
    error: str | None = None
    reason: str = "complete"      # complete | stalled | finished
    closed_at: float = 0.0
    analysed_at: float = 0.0
    analysis_s: float = 0.0
    # what the window's analysis changed of its rows, one line each (a rank's clock moved onto
    # the others' for some steps): a user sees why; at most windows.MAX_NOTES lines
    notes: list[str] = []


class WindowSummary(msgspec.Struct):
    """A window in a job's history: its figures and each cause once (no scores, no findings)."""

    idx: int
    first_step: int
    last_step: int
    slowdown: float | None
    waste: float | None
    m_w: float | None
    m_s: float | None
    error: str | None
    reason: str
    closed_at: float
    analysed_at: float
    analysis_s: float
    causes: list[str] = []


class JobRecord(msgspec.Struct):
    """A job's row; `meta` is its meta.json decoded (its text when it does not decode: the job
    is then set aside, not every read failed)."""

    job: str
    directory: str
    way: str
    meta: Any
    state: str
    created_at: float
    last_part_at: float | None = None
    finished_at: float | None = None
    closed: int = 0
    part_seq: int = 0
    run: int = 0
    meta_seq: int = 0   # one more at every change of `meta` (a part's commit is fenced by it)
    superseded: str | None = None   # run tokens newer runs replaced (replaced.py)


class JobSummary(msgspec.Struct):
    """A job in the job list: its state, latest window's S and open alerts."""

    job: str
    directory: str
    way: str
    state: str
    created_at: float
    last_part_at: float | None
    finished_at: float | None
    window: int | None
    slowdown: float | None
    analysed_at: float | None
    open_alerts: int
    upload_dropped: int
    world_size: int | None = None
    dp: int | None = None
    pp: int | None = None


class JobMark(msgspec.Struct):
    """What an owner compares to learn of another instance's writes to a job."""

    job: str
    part_seq: int
    run: int
    meta: str | None
    state: str
    meta_seq: int = 0


class PartRow(msgspec.Struct):
    """A stored part (for rebuilding after a restart)."""

    rank: int
    part: int
    records: int
    first_step: int
    last_step: int
    ingested_at: float
    way: str


class PartIndex(msgspec.Struct):
    """Where a stored part sits in its rank and in its job's part sequence."""

    rank: int
    part: int
    last_step: int
    ingested_at: float
    seq: int


class PartCount(msgspec.Struct):
    """Parts and op records stored."""

    parts: int
    records: int


class Labels(msgspec.Struct, omit_defaults=True):
    """An alert's labels (Alertmanager's identity of an alert); those unset are not written."""

    alertname: str
    job: str
    severity: str
    cause: str | None = None
    rank: str | None = None       # one rank, or several joined by ","
    dp: str | None = None
    pp: str | None = None
    host: str | None = None
    detector: str | None = None


class Annotations(msgspec.Struct):
    """What an alert says: one line, and the details."""

    summary: str = ""
    description: str = ""


class Alert(msgspec.Struct):
    """An alert's current state (its row in the store and its outbox message)."""

    fingerprint: str
    rule: str
    job: str
    labels: Labels
    annotations: Annotations
    status: str                  # firing | resolved
    starts_at: float
    ends_at: float | None
    last_sent: float


class AlertLogEntry(msgspec.Struct):
    """One alert transition (firing or resolved); `id` is the store's, once stored."""

    at: float
    fingerprint: str
    job: str
    rule: str
    status: str
    severity: str
    summary: str
    description: str
    window: int | None
    id: int | None = None


class ClaimedMessage(msgspec.Struct):
    """An outbox message claimed for sending, with the alert change it tells."""

    id: int
    job: str
    fingerprint: str
    status: str
    alert: Alert
    attempts: int


class OutboxRow(msgspec.Struct):
    """A queued alert message and its delivery."""

    id: int
    job: str
    fingerprint: str
    status: str
    sent_at: float
    attempts: int
    claimed_by: str | None
    delivered_by: str | None
    delivered_at: float | None
    failed_at: float | None


class IngestMark(msgspec.Struct):
    """Another instance's ingest, as it last said: every part it heard before `as_of` is
    stored or refused, except those in flight, the oldest heard at `oldest` (None: none)."""

    instance: str
    as_of: float
    oldest: float | None


class LeaseRow(msgspec.Struct):
    """A job's lease: which instance analyses it, under which epoch, until when."""

    job: str
    owner: str | None
    epoch: int
    expires_at: float | None
    taken_at: float | None


def sorted_json(value: Any) -> str:
    """A record's JSON text with sorted keys (stored labels and outbox messages: stable text)."""
    return json.dumps(plain(value), sort_keys=True)


class LayoutEntry(msgspec.Struct):
    """Where one rank runs, from meta.json's `extra.layout` (jobmeta.check_meta checks it)."""

    rank: int
    dp_rank: int | None = None
    stage: int | None = None
    host: str | None = None


class Place(msgspec.Struct):
    """Where a rank runs, as alert labels (those unknown are None)."""

    dp: str | None = None
    pp: str | None = None
    host: str | None = None
