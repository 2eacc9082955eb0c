"""The live monitor's windows into the act loop: publish a job's step timings, follow its windows.

Every rank uploads its own rows of the all-gathered step timings (`window_trace`, the same op
table `advise` replays) as parts of one monitor job (`stragglers.record.upload.PartUploader`,
never blocking training); the monitor cuts windows of steps every rank finished and analyses
them. Rank 0 follows the job's analysed windows over the monitor's HTTP API
(`MonitorWindows.poll`) and feeds each to `AdvisePolicy.observe_window` as the op table of
exactly that window's steps; its decisions are broadcast so every rank switches at the same
step. Each window comes back typed, as the monitor's own `WindowSummary` (the JSON it serves,
decoded). No torch, no monitor extra on a training node: the standard library and msgspec.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping

import msgspec

from stragglers.advice.window import StepTiming, window_trace
from stragglers.errors import InputError
from stragglers.monitor.records import WindowSummary
from stragglers.serving import check_url
from stragglers.trace.model import JobMeta, Trace

log = logging.getLogger(__name__)


def part_bytes(trace: Trace) -> bytes:
    """One part's Parquet bytes (the run format's columns), as the monitor accepts them."""
    from stragglers.trace.runformat import table_bytes

    return table_bytes(trace.ops)


def job_meta(name: str, world_size: int, global_batch: int,
             calibration: Mapping[str, object] | None) -> JobMeta:
    """The meta of a DDP job of `world_size` ranks, with its layout (so windows wait for all)."""
    extra: dict[str, object] = {
        "global_batch": int(global_batch),
        "layout": [{"rank": r, "dp_rank": r, "stage": 0} for r in range(world_size)]}
    if calibration:
        extra["calibration"] = dict(calibration)
    return JobMeta(name=name, dp_size=world_size, pp_size=1, world_size=world_size, extra=extra)


class TimingPublisher:
    """One rank's rows of the step timings, uploaded as monitor parts every `every` steps."""

    def __init__(self, url: str, job: str, rank: int, world_size: int, global_batch: int,
                 token: str | None = None, every: int = 1,
                 calibration: Mapping[str, object] | None = None):
        from stragglers.monitor.parts import check_job_name
        from stragglers.record.upload import PartUploader

        if every < 1:
            raise InputError("TimingPublisher", "every", f"expected >= 1 step per part, got {every}")
        self.job = check_job_name(job, "TimingPublisher")
        self.rank, self.every, self.global_batch = int(rank), int(every), int(global_batch)
        check_url(url, "TimingPublisher")
        self.uploader = PartUploader(url, token, job, rank)
        if self.rank == 0:
            meta = job_meta(job, world_size, global_batch, calibration)
            self.uploader.submit_meta(meta.to_dict())
        self.pending: list[list[StepTiming]] = []
        self.parts = 0

    def add(self, timings: list[StepTiming]) -> None:
        """One step's timings of every rank (the all-gather); a part goes out every `every` steps."""
        self.pending.append(timings)
        if len(self.pending) >= self.every:
            self.flush()

    def flush(self) -> None:
        """Upload this rank's rows of the pending steps as the next part."""
        if not self.pending:
            return
        trace = window_trace(self.pending, name=self.job, global_batch=self.global_batch)
        mine = trace.select(trace.ops["rank"] == self.rank)
        self.uploader.submit(self.parts, part_bytes(mine))
        self.parts += 1
        self.pending = []

    def close(self, timeout: float = 10.0) -> bool:
        """Send what is left; True when everything was delivered."""
        self.flush()
        return self.uploader.close(timeout)


class MonitorWindows:
    """The analysed windows of one job on a monitor, each returned once, oldest first."""

    def __init__(self, url: str, job: str, token: str | None = None, timeout_s: float = 2.0):
        check_url(url, "MonitorWindows")
        self.url = f"{url.rstrip('/')}/api/jobs/{urllib.parse.quote(job, safe='')}"
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout_s = timeout_s
        self.seen = -1
        self.failures = 0

    def poll(self) -> list[WindowSummary]:
        """Windows analysed since the last poll, oldest first (the monitor's window summaries).

        A monitor that is down, slow or does not know the job yet gives no windows (it must
        never stop training); the failure is counted and logged. A window that is not a
        window summary (another monitor version, a proxy's page) is skipped and counted too.
        """
        request = urllib.request.Request(self.url, headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = msgspec.json.decode(response.read(), type=_JobWindows)
        except urllib.error.HTTPError as exc:
            if exc.code != 404:  # 404: the job's meta has not arrived yet
                self.failures += 1
                log.warning("monitor %s: HTTP %d", self.url, exc.code)
            return []
        except (OSError, ValueError) as exc:   # msgspec's DecodeError is a ValueError
            self.failures += 1
            log.warning("monitor %s unreachable or not a monitor: %s", self.url, exc)
            return []
        new: list[WindowSummary] = []
        for raw in body.windows or []:
            try:
                window = msgspec.convert(raw, WindowSummary)
            except msgspec.ValidationError as exc:
                self.failures += 1
                log.warning("monitor %s: skipped a window: %s", self.url, exc)
                continue
            if window.idx > self.seen:
                new.append(window)
        new.sort(key=lambda w: w.idx)
        if new:
            self.seen = new[-1].idx
        return new


class _JobWindows(msgspec.Struct):
    """The part of GET /api/jobs/{job} that is read here: its windows, each checked apart."""

    windows: list[object] | None = None


def window_of(summary: WindowSummary, timings_by_step: dict[int, list[StepTiming]], name: str,
              global_batch: int,
              calibration: Mapping[str, object] | None = None) -> Trace | None:
    """The op table of a monitor window's steps from the job's own timings (None if not all held)."""
    steps = range(summary.first_step, summary.last_step + 1)
    if not all(s in timings_by_step for s in steps):
        return None
    return window_trace([timings_by_step[s] for s in steps], name=name,
                        global_batch=global_batch, calibration=calibration)
