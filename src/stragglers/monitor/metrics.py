"""Prometheus metrics of the monitor (names are the contract of docs/monitor.md §5)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from stragglers.monitor.alerts import VERDICTS
from stragglers.monitor.records import Alert, WindowRow

if TYPE_CHECKING:
    from stragglers.monitor.service import Monitor

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class MonitorMetrics:
    """One registry per monitor (so several can live in one process, as tests do)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.slowdown = Gauge("stragglers_slowdown", "S of the latest window", ["job"], registry=r)
        self.waste = Gauge("stragglers_waste", "1 - 1/S of the latest window", ["job"], registry=r)
        self.worker_score = Gauge("stragglers_worker_score", "S_w of the latest window",
                                  ["job", "dp", "pp", "rank", "host"], registry=r)
        self.diagnosis = Gauge("stragglers_diagnosis", "predicted speedup if the cause were "
                               "fixed (0 when absent) in the latest window", ["job", "cause"],
                               registry=r)
        self.windows = Counter("stragglers_windows", "windows analysed", ["job"], registry=r)
        self.window_failed = Gauge("stragglers_window_failed", "1 when the job's latest window "
                                   "could not be analysed (its S, waste, scores and diagnosis "
                                   "series are then absent), else 0", ["job"], registry=r)
        self.parts = Counter("stragglers_parts_ingested", "parts stored (each once)", ["way"],
                             registry=r)
        self.records = Counter("stragglers_records_ingested", "op records stored", ["way"],
                               registry=r)
        self.rejected = Counter("stragglers_ingest_rejected", "parts or requests refused",
                                ["reason"], registry=r)
        self.analysis_seconds = Histogram(
            "stragglers_window_analysis_seconds", "what-if analysis time of one window",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60), registry=r)
        self.publish_latency = Histogram(
            "stragglers_window_publish_seconds", "from a window closing to its result being "
            "served (dashboard and /metrics)",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30), registry=r)
        self.ingest_seconds = Histogram(
            "stragglers_ingest_seconds", "from a part being queued to it being durable", ["way"],
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5), registry=r)
        self.upload_dropped = Gauge("stragglers_upload_dropped", "parts a rank's uploader "
                                    "dropped (full buffer), as it reported", ["job", "rank"],
                                    registry=r)
        self.job_state = Gauge("stragglers_job_state", "1 for the job's current state",
                               ["job", "state"], registry=r)
        self.open_alerts = Gauge("stragglers_alerts_firing", "alerts firing", ["job"], registry=r)
        # the monitor's own health
        self.silent_ranks = Gauge("stragglers_silent_ranks", "ranks of a running job that sent "
                                  "nothing for stall_after_s while the others did", ["job"],
                                  registry=r)
        self.alert_changes = Counter("stragglers_alert_changes", "alerts that started "
                                     "(firing) or ended (resolved)", ["alertname", "status"],
                                     registry=r)
        self.store_errors = Counter("stragglers_store_errors", "store operations that failed "
                                    "(ingest: a batch not taken; window: a window retried; "
                                    "alerts: alert changes not stored)", ["operation"],
                                    registry=r)
        self.last_analysis = Gauge("stragglers_last_analysis_timestamp_seconds", "when a "
                                   "window was last analysed without error (Unix time)",
                                   registry=r)
        for operation in ("ingest", "window", "alerts"):
            self.store_errors.labels(operation)
        for way in ("files", "http"):  # present from the start, so rates begin at 0
            self.parts.labels(way)
            self.records.labels(way)
        self._workers: dict[str, set[tuple[str, str, str, str, str]]] = {}
        self._causes: dict[str, set[str]] = {}
        self._states: dict[str, str] = {}   # job → the state last exposed
        self._lock = threading.Lock()
        # the families with a series per job, and of those the ones with one per rank or
        # worker (thousands a job): a job's series went only with its state's, and /metrics
        # grew with every job and rank the process ever saw (229 KB for one job of 4,096 ranks)
        self._per_job = (self.slowdown, self.waste, self.worker_score, self.diagnosis,
                         self.windows, self.window_failed, self.upload_dropped, self.job_state, self.open_alerts,
                         self.silent_ranks)
        self._per_rank = (self.worker_score, self.upload_dropped)
        self._per_window = (self.slowdown, self.waste, self.worker_score, self.diagnosis)

    def publish_window(self, row: WindowRow) -> None:
        """Expose a job's latest window, just analysed (counted and its time observed)."""
        self.windows.labels(row.job).inc()
        self.analysis_seconds.observe(row.analysis_s)
        if row.error is None:
            self.last_analysis.set(row.analysed_at or time.time())
        self.show_window(row)

    def show_window(self, row: WindowRow) -> None:
        """Expose a job's latest window's figures (S, waste, scores, causes, failed) without
        counting it: at a start, the stored latest window of each job is shown again (a
        restart otherwise dropped them until the job's next window, which may never come)."""
        job = row.job
        self.window_failed.labels(job).set(0.0 if row.slowdown is not None else 1.0)
        if row.slowdown is None:
            self.clear_window(job)
            return
        with self._lock:
            self.slowdown.labels(job).set(row.slowdown)
            self.waste.labels(job).set(row.waste if row.waste is not None else float("nan"))
            seen = set()
            for s in row.scores:
                key = (job, str(s.dp), str(s.pp), str(s.rank), s.host or "")
                self.worker_score.labels(*key).set(s.score)
                seen.add(key)
            for key in self._workers.get(job, set()) - seen:  # a worker that left the job
                self.worker_score.remove(*key)
            self._workers[job] = seen
            causes: dict[str, float] = {}
            for f in row.diagnosis:
                if f.cause and f.cause not in VERDICTS:
                    causes[f.cause] = max(causes.get(f.cause, 0.0),
                                          float(f.speedup_if_fixed or 0.0))
            for cause in self._causes.get(job, set()) | set(causes):
                self.diagnosis.labels(job, cause).set(causes.get(cause, 0.0))
            self._causes[job] = self._causes.get(job, set()) | set(causes)

    def clear_window(self, job: str) -> None:
        """The job's latest window has no figures (its analysis failed or was stopped): its
        per-window series go, so no scrape shows the window before's S, waste, scores and
        causes as current (an unknown value is not exported: prometheus_client's remove(),
        which Prometheus marks stale); stragglers_window_failed says why they are gone."""
        with self._lock:
            for family in self._per_window:
                _drop(family, job)
            self._workers.pop(job, None)
            self._causes.pop(job, None)

    def set_state(self, job: str, state: str) -> None:
        """Expose a job's state (running, stalled, finished) as a one-hot gauge; a job that
        finishes keeps its per-job series, its per-rank and per-worker ones go (the dashboard
        and /api keep its windows; they come back with its next window if it runs again)."""
        for s in ("running", "stalled", "finished"):
            self.job_state.labels(job, s).set(1.0 if s == state else 0.0)
        with self._lock:
            before = self._states.get(job)
            self._states[job] = state
            if state == "finished" and before != "finished":
                for family in self._per_rank:
                    _drop(family, job)
                self._workers.pop(job, None)

    def new_run(self, job: str) -> None:
        """A new run of the job: the old run's window figures and per-rank series go (its
        uploaders' drop counts were shown until the new run's first part said otherwise)."""
        self.window_failed.labels(job).set(0.0)
        with self._lock:
            for family in set(self._per_window) | set(self._per_rank):
                _drop(family, job)
            self._workers.pop(job, None)
            self._causes.pop(job, None)

    def forget(self, job: str) -> None:
        """A job that is gone (expired, deleted): every series of it goes."""
        with self._lock:
            for family in self._per_job:
                _drop(family, job)
            self._workers.pop(job, None)
            self._causes.pop(job, None)
            self._states.pop(job, None)

    def count_alerts(self, changes: list[Alert]) -> None:
        """Count alert changes by alert name and status."""
        for a in changes:
            self.alert_changes.labels(a.labels.alertname, a.status).inc()

    def watch(self, monitor: Monitor) -> None:
        """Expose the monitor's queues, ingest lag, deliveries and per-job silence, read from
        it at every scrape."""
        self.registry.register(HealthCollector(monitor))

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)


def _drop(family: Gauge | Counter, job: str) -> None:
    """Remove every series of `family` whose `job` label is `job` (its first label)."""
    gone = {tuple(sample.labels.values()) for metric in family.collect()
            for sample in metric.samples if sample.labels.get("job") == job}
    for labels in gone:
        try:
            family.remove(*labels)
        except KeyError:   # removed meanwhile (a scrape does not hold the lock)
            pass


class HealthCollector:
    """Gauges and counters read from a running monitor when /metrics is scraped."""

    def __init__(self, monitor: Monitor):
        self.monitor = monitor

    def collect(self) -> Iterator[Metric]:
        """The families (prometheus_client's custom collector protocol)."""
        m, now = self.monitor.watchdog, time.time()
        lag = GaugeMetricFamily("stragglers_ingest_lag_seconds", "how long the oldest part "
                                "queued or being stored has waited (0: none)")
        lag.add_metric([], m.ingest_lag())
        yield lag
        depth = GaugeMetricFamily("stragglers_queue_depth", "items waiting: parts to ingest, "
                                  "windows and state changes to analyse, change-detector "
                                  "wake-ups", labels=["queue"])
        for name, size in m.queue_depths().items():
            depth.add_metric([name], size)
        yield depth
        sent = CounterMetricFamily("stragglers_alert_notifications", "alert messages "
                                   "delivered to every receiver (sent), given up after "
                                   "retries (failed), dropped (a full queue) or set aside "
                                   "unsent (damaged: their stored row does not read)",
                                   labels=["outcome"])
        for outcome, count in m.delivery_counts().items():
            sent.add_metric([outcome], count)
        # messages set aside unsent, their stored row damaged (store_base.claim_messages)
        sent.add_metric(["damaged"], self.monitor.store.damaged_messages)
        yield sent
        last = GaugeMetricFamily("stragglers_job_last_part_timestamp_seconds", "when the job's "
                                 "latest part arrived (Unix time)", labels=["job"])
        age = GaugeMetricFamily("stragglers_job_silence_seconds", "seconds since the job's "
                                "latest part arrived", labels=["job"])
        for job, at in m.last_parts().items():
            last.add_metric([job], at)
            age.add_metric([job], max(0.0, now - at))
        yield last
        yield age
