"""Alert rules (YAML), their evaluation per window, and delivery in Alertmanager's webhook format.

An alert is identified by its labels (rule, job and, for rules about a place, the ranks): its
fingerprint is a hash of them. While it fires it is sent once, and again every `repeat_s`;
when its condition is false for one window it resolves and a resolve is sent
(specs/monitor.md §3). Alert state lives in the store, so a restart neither forgets a firing
alert nor sends it twice. Delivery runs on its own thread per receiver, with retries and
backoff: a receiver that is down never holds up ingest or analysis.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from stragglers.errors import InputError
from stragglers.whatif.config import STRAGGLING_SLOWDOWN

log = logging.getLogger(__name__)

METRICS = ("slowdown", "waste", "m_w", "m_s")
_NUMERIC = re.compile(r"^(slowdown|waste|m_w|m_s)\s*(>=|>|<=|<)\s*([0-9]*\.?[0-9]+)$")
_CAUSE = re.compile(r"^cause\s*==\s*([a-z_]+)(?:\s+and\s+speedup\s*>=\s*([0-9]*\.?[0-9]+))?$")
_STATE = re.compile(r"^state\s*==\s*(stalled|finished)$")
_COMPARE = {">=": float.__ge__, ">": float.__gt__, "<=": float.__le__, "<": float.__lt__}
SEVERITIES = ("info", "warning", "critical")
RULE_KEYS = ("name", "when", "for_windows", "severity", "summary")

DEFAULT_RULES = [
    {"name": "straggling", "when": f"slowdown >= {STRAGGLING_SLOWDOWN:g}", "for_windows": 3, "severity": "warning"},
    {"name": "severe", "when": "slowdown >= 1.5", "for_windows": 1, "severity": "critical"},
    {"name": "worker_fault", "when": "cause == worker_fault", "for_windows": 2,
     "severity": "critical"},
    {"name": "new_cause", "when": "new_cause", "severity": "info"},
    {"name": "stalled", "when": "state == stalled", "severity": "warning"},
]


@dataclass(frozen=True)
class Rule:
    """One alert rule: a condition on a window (or the job state) that must hold k windows."""

    name: str
    kind: str            # metric | cause | new_cause | state
    subject: str = ""    # the metric, cause or state named
    op: str = ""
    value: float = 0.0   # the threshold; for a cause, the least speedup_if_fixed that counts
    for_windows: int = 1
    severity: str = "warning"
    summary: str = ""

    def holds(self, window: dict) -> bool:
        """Whether a metric rule's condition holds on an analysed window."""
        v = window.get(self.subject)
        return v is not None and _COMPARE[self.op](float(v), self.value)


def parse_rules(raw: Any, source: object = "rules") -> list[Rule]:
    """Validate the `rules:` list of the YAML file; errors name the rule and field."""
    if raw is None:
        raw = DEFAULT_RULES
    if not isinstance(raw, list):
        raise InputError(source, "rules", "expected a list of rules")
    rules, names = [], set()
    for i, r in enumerate(raw):
        where = f"rules[{i}]"
        if not isinstance(r, dict):
            raise InputError(source, where, "expected a mapping with name and when")
        unknown = sorted(set(r) - set(RULE_KEYS))
        if unknown:
            raise InputError(source, f"{where}.{unknown[0]}",
                             f"unknown key; expected one of {', '.join(RULE_KEYS)}")
        name = r.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", name):
            raise InputError(source, f"{where}.name", f"expected an identifier, got {name!r}")
        if name in names:
            raise InputError(source, f"{where}.name", f"rule {name!r} is defined twice")
        names.add(name)
        k = r.get("for_windows", 1)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 10_000:
            raise InputError(source, f"{where}.for_windows", f"expected 1..10000, got {k!r}")
        severity = r.get("severity", "warning")
        if severity not in SEVERITIES:
            raise InputError(source, f"{where}.severity",
                             f"expected one of {', '.join(SEVERITIES)}, got {severity!r}")
        summary = r.get("summary", "")
        if not isinstance(summary, str):
            raise InputError(source, f"{where}.summary", "expected text")
        when = str(r.get("when", "")).strip()
        common = {"name": name, "for_windows": k, "severity": severity, "summary": summary}
        if m := _NUMERIC.match(when):
            rules.append(Rule(kind="metric", subject=m[1], op=m[2], value=float(m[3]), **common))
        elif m := _CAUSE.match(when):
            rules.append(Rule(kind="cause", subject=m[1], value=float(m[2] or 0.0), **common))
        elif when == "new_cause":
            rules.append(Rule(kind="new_cause", **common))
        elif m := _STATE.match(when):
            rules.append(Rule(kind="state", subject=m[1], **common))
        else:
            raise InputError(source, f"{where}.when", f"cannot read {when!r}; expected "
                             f"'{'|'.join(METRICS)} >= NUMBER', 'cause == NAME [and speedup >= "
                             "NUMBER]', 'new_cause' "
                             "or 'state == stalled'")
    return rules


def fingerprint(labels: dict) -> str:
    """A stable id of an alert: 16 hex digits of a hash of its sorted labels."""
    return hashlib.sha256(json.dumps(labels, sort_keys=True).encode()).hexdigest()[:16]


def rfc3339(t: float | None) -> str:
    """A time as Alertmanager writes it; the zero time for 'not ended'."""
    if t is None:
        return "0001-01-01T00:00:00Z"
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


class AlertEngine:
    """Decides which alerts fire and resolve; returns store rows and messages to send."""

    def __init__(self, rules: list[Rule], store, repeat_s: float, external_url: str = ""):
        self.rules, self.store, self.repeat_s = rules, store, float(repeat_s)
        self.external_url = external_url.rstrip("/")
        self.max_k = max([r.for_windows for r in rules] + [2])

    def on_window(self, job: str, window: dict, now: float | None = None):
        """Alert changes caused by a new analysed window: (alert rows, log rows, messages)."""
        now = time.time() if now is None else now
        history = [window] + [w for w in self.store.recent_windows(job, self.max_k + 1)
                              if w["idx"] != window["idx"]]
        active: dict[str, dict] = {}   # fingerprint -> alert that holds now
        decided: set[str] = set()      # rules (name) evaluated on this window
        if window.get("error") is None:
            for rule in self.rules:
                if rule.kind == "state":
                    continue
                decided.add(rule.name)
                for labels, annotations in self._holding(rule, job, history):
                    active[fingerprint(labels)] = {"rule": rule, "labels": labels,
                                                   "annotations": annotations}
        return self._apply(job, active, decided, now, window["idx"])

    def on_state(self, job: str, state: str, now: float | None = None):
        """Alert changes caused by a job's state change (stalled, running again, finished)."""
        now = time.time() if now is None else now
        active, decided = {}, set()
        for rule in self.rules:
            if rule.kind != "state":
                continue
            decided.add(rule.name)
            if state == rule.subject:
                labels = self._labels(rule, job)
                active[fingerprint(labels)] = {"rule": rule, "labels": labels, "annotations": {
                    "summary": rule.summary or f"job {job} is {state}",
                    "description": f"no new part of job {job} arrived for the stall limit"}}
        return self._apply(job, active, decided, now, None)

    def _labels(self, rule: Rule, job: str, **extra) -> dict:
        return {"alertname": rule.name, "job": job, "severity": rule.severity,
                **{k: str(v) for k, v in extra.items()}}

    def _holding(self, rule: Rule, job: str, history: list[dict]):
        """(labels, annotations) of every alert of `rule` whose condition holds now."""
        k = rule.for_windows
        recent = [w for w in history if w.get("error") is None][:max(k, 2)]
        current = history[0]
        if rule.kind == "metric":
            if len(recent) >= k and all(rule.holds(w) for w in recent[:k]):
                value = current[rule.subject]
                yield self._labels(rule, job), {
                    "summary": rule.summary or f"job {job}: {rule.subject} {value:.3f} "
                                               f"{rule.op} {rule.value:g}",
                    "description": f"{rule.subject} = {value:.3f} in window {current['idx']} "
                                   f"(steps {current['first_step']}–{current['last_step']})"
                                   + (f", {k} windows in a row" if k > 1 else "")
                                   + _top_cause(current)}
        elif rule.kind == "cause":
            if len(recent) < k:
                return
            held = [_places(w, rule) for w in recent[:k]]
            for place, (labels, f) in held[0].items():
                if all(place in h for h in held[1:]):
                    what = f"{rule.subject.replace('_', ' ')} at rank {labels['rank']}" \
                        if "rank" in labels and "," not in labels["rank"] else \
                        (f.get("headline") or rule.subject)
                    yield self._labels(rule, job, **labels), {
                        "summary": rule.summary or f"job {job}: {what}",
                        "description": str(f.get("headline") or f.get("evidence", ""))}
        elif rule.kind == "new_cause":
            # the job's first window has no previous one: every cause in it is new
            before = {f.get("cause") for f in recent[1].get("diagnosis") or []} \
                if len(recent) >= 2 else set()
            for f in current.get("diagnosis") or []:
                cause = f.get("cause")
                if cause and cause != "none" and cause not in before:
                    yield self._labels(rule, job, cause=cause), {
                        "summary": rule.summary or f"job {job}: new cause {cause}",
                        "description": str(f.get("headline") or f.get("evidence", ""))}

    def _apply(self, job: str, active: dict, decided: set, now: float, window_idx):
        alert_rows, log_rows, messages = [], [], []
        current = {a["fingerprint"]: a for a in self.store.alerts(job=job)}
        for fp, a in active.items():
            old = current.get(fp)
            if old is not None and old["status"] == "firing":
                if now - old["last_sent"] < self.repeat_s:
                    continue
                row = {**old, "annotations": a["annotations"], "last_sent": now}
            else:
                row = {"fingerprint": fp, "rule": a["rule"].name, "job": job,
                       "labels": a["labels"], "annotations": a["annotations"],
                       "status": "firing", "starts_at": now, "ends_at": None, "last_sent": now}
                log_rows.append(self._log(row, window_idx, now))
            alert_rows.append(row)
            messages.append(row)
        for fp, old in current.items():
            if old["status"] == "firing" and old["rule"] in decided and fp not in active:
                row = {**old, "status": "resolved", "ends_at": now, "last_sent": now}
                alert_rows.append(row)
                log_rows.append(self._log(row, window_idx, now))
                messages.append(row)
        for e in log_rows:
            log.warning("alert %s: %s (job %s) %s", e["status"], e["rule"], job, e["summary"])
        return alert_rows, log_rows, [self.payload(m) for m in messages]

    @staticmethod
    def _log(row: dict, window_idx, now: float) -> dict:
        return {"at": now, "fingerprint": row["fingerprint"], "job": row["job"],
                "rule": row["rule"], "status": row["status"],
                "severity": row["labels"].get("severity", ""),
                "summary": row["annotations"].get("summary", ""),
                "description": row["annotations"].get("description", ""), "window": window_idx}

    def payload(self, row: dict, receiver: str = "stragglers") -> dict:
        """The Alertmanager webhook body (version 4) of one alert transition."""
        labels = row["labels"]
        group = {"alertname": labels["alertname"], "job": labels["job"]}
        return {
            "version": "4", "groupKey": "{}:" + json.dumps(group, sort_keys=True),
            "truncatedAlerts": 0, "status": row["status"], "receiver": receiver,
            "groupLabels": group, "commonLabels": labels,
            "commonAnnotations": row["annotations"], "externalURL": self.external_url,
            "alerts": [{"status": row["status"], "labels": labels,
                        "annotations": row["annotations"], "startsAt": rfc3339(row["starts_at"]),
                        "endsAt": rfc3339(row["ends_at"]),
                        "generatorURL": f"{self.external_url}/jobs/{labels['job']}",
                        "fingerprint": row["fingerprint"]}]}


def _top_cause(window: dict) -> str:
    causes = [f for f in window.get("diagnosis") or [] if f.get("cause") != "none"]
    return f"; {causes[0].get('headline') or causes[0]['cause']}" if causes else ""


def _counts(finding: dict, rule: Rule) -> bool:
    """A finding of the rule's cause that buys at least the rule's speedup if fixed."""
    return finding.get("cause") == rule.subject and \
        float(finding.get("speedup_if_fixed") or 0.0) >= rule.value


# Causes that sit on single workers: one alert per worker, so a second slow worker is its own
# alert and a finding that names {1, 2} one window and {1} the next keeps rank 1's alert.
WORKER_CAUSES = ("worker_fault", "host_stall")


def _places(window: dict, rule: Rule) -> dict:
    """place → (labels, finding) of the rule's cause in a window."""
    out = {}
    for f in window.get("diagnosis") or []:
        if not _counts(f, rule):
            continue
        if f.get("cause") in WORKER_CAUSES and f.get("ranks"):
            workers = {}
            for w in (f.get("where") or {}).get("workers") or []:
                if isinstance(w, dict) and "rank" in w:
                    workers[int(w["rank"])] = w
            for r in f["ranks"]:
                w = workers.get(int(r), {})
                labels = {"cause": f["cause"], "rank": str(r)}
                labels.update({k: str(w[k]) for k in ("dp", "pp", "host") if w.get(k) is not None})
                out[("rank", int(r))] = (labels, f)
        else:
            loc = f.get("where") or {}
            labels = {"cause": str(f.get("cause", ""))}
            for key in ("dp", "pp"):
                if isinstance(loc.get(key), list):
                    labels[key] = ",".join(map(str, loc[key]))
            if f.get("ranks"):
                labels["rank"] = ",".join(map(str, f["ranks"]))
            out[("where", json.dumps(labels, sort_keys=True))] = (labels, f)
    return out


class WebhookSender:
    """Posts alert messages to one receiver URL from a thread, retrying with backoff."""

    def __init__(self, url: str, max_queue: int = 10_000, max_attempts: int = 8,
                 backoff_s: float = 0.5, max_backoff_s: float = 60.0, timeout_s: float = 5.0):
        self.url, self.max_attempts = url, max_attempts
        self.backoff_s, self.max_backoff_s, self.timeout_s = backoff_s, max_backoff_s, timeout_s
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self.sent = self.failed = self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stragglers-webhook", daemon=True)
        self._thread.start()

    def send(self, payload: dict) -> None:
        """Queue a message (never blocks; a full queue drops it and counts)."""
        try:
            self._queue.put_nowait(payload)
        except queue.Full:
            self.dropped += 1

    def close(self) -> None:
        """Stop the thread (queued messages not yet delivered are abandoned)."""
        self._stop.set()
        self._queue.put(None)

    def _run(self) -> None:
        while not self._stop.is_set():
            payload = self._queue.get()
            if payload is None:
                return
            delay = self.backoff_s
            for attempt in range(self.max_attempts):
                if self._post(payload):
                    self.sent += 1
                    break
                if self._stop.wait(delay):
                    return
                delay = min(delay * 2, self.max_backoff_s)
            else:
                self.failed += 1
                log.warning("webhook %s: gave up on a %s message after %d attempts", self.url,
                            payload.get("status"), self.max_attempts)

    def _post(self, payload: dict) -> bool:
        req = urllib.request.Request(self.url, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return 200 <= resp.status < 300
        except (urllib.error.URLError, OSError, ValueError) as exc:
            log.info("webhook %s: %s (will retry)", self.url, exc)
            return False
