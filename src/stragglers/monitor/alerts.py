"""Alert rules (YAML), their evaluation per window, and delivery in Alertmanager's webhook format.

An alert is identified by its labels (rule, job and, for rules about a place, the ranks): its
fingerprint is a hash of them. It fires once its condition held for `for_windows` consecutive
windows; while it fires it is sent once, and again every `repeat_s`. It resolves, with a resolve
message, once its clear condition held for `resolve_for_windows` consecutive windows
(default: the condition is false for one window, docs/monitor.md §3). A clear condition
stricter than "not the condition" (`resolve_when`: a lower threshold) is hysteresis: a value
that hovers around the threshold neither fires twice nor resolves in between. Every decision
is a function of the stored windows, so a restart decides the same way. Alert state lives in
the store, so a restart neither forgets a firing alert nor sends it twice. Delivery is
outbox.py's: its own thread, with retries and backoff, so a receiver that is down never holds
up ingest or analysis.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, TypedDict

import msgspec

from stragglers.errors import InputError
from stragglers.monitor.records import Alert, AlertLogEntry, Annotations, Labels, Place, \
    WindowFinding, WindowRow, plain, sorted_json
from stragglers.whatif.config import STRAGGLING_SLOWDOWN

if TYPE_CHECKING:
    from stragglers.monitor.changes import Change
    from stragglers.monitor.store_base import SQLStore

log = logging.getLogger(__name__)

METRICS = ("slowdown", "waste", "m_w", "m_s")
_NUMERIC = re.compile(r"^(slowdown|waste|m_w|m_s)\s*(>=|>|<=|<)\s*([0-9]*\.?[0-9]+)$")
_CAUSE = re.compile(r"^cause\s*==\s*([a-z_]+)(?:\s+and\s+speedup\s*>=\s*([0-9]*\.?[0-9]+))?$")
_STATE = re.compile(r"^state\s*==\s*(stalled|finished)$")
_SPEEDUP_BELOW = re.compile(r"^speedup\s*<\s*([0-9]*\.?[0-9]+)$")
_COMPARE = {">=": float.__ge__, ">": float.__gt__, "<=": float.__le__, "<": float.__lt__}
SEVERITIES = ("info", "warning", "critical")
RULE_KEYS = ("name", "when", "for_windows", "resolve_when", "resolve_for_windows", "severity",
             "summary")

# verdicts of the diagnosis, not causes: `none` (nothing to fix) and `partial` (the window
# holds only some ranks: whatif.diagnosis._partial_verdict says what cannot be told; the
# `ranks_left_out` alert and the window's missing ranks say which). new_cause took `partial`
# for a cause: an info alert firing for as long as windows missed a rank
VERDICTS = frozenset({"none", "partial"})

DEFAULT_RULES = [
    {"name": "straggling", "when": f"slowdown >= {STRAGGLING_SLOWDOWN:g}", "for_windows": 3, "severity": "warning"},
    {"name": "severe", "when": "slowdown >= 1.5", "for_windows": 1, "severity": "critical"},
    {"name": "worker_fault", "when": "cause == worker_fault", "for_windows": 2,
     "severity": "critical"},
    # S leaves launch delays out (whatif/_analyze), so a worker slow between its ops (a host
    # stall: slow launches, a starved data loader) moves no slowdown rule: its own rule, on
    # what fixing it buys, held as long as `straggling` (a 2.35x stall read S 1.005 and left
    # nothing firing). The other causes are slower ops, which S counts (LAUNCH_DELAY_CAUSES)
    {"name": "host_stall", "when": f"cause == host_stall and speedup >= {STRAGGLING_SLOWDOWN:g}",
     "for_windows": 3, "severity": "warning"},
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
    resolve_windows: int = 1     # consecutive clear windows before a firing alert resolves
    resolve_op: str = ""         # metric rules: the clear condition (empty: `not holds`)
    resolve_value: float | None = None  # metric: its threshold; cause: the speedup below which
    #                                     a firing place counts as clear (None: the rule's own)

    def figure(self, window: WindowRow) -> float | None:
        """The window's value of a metric rule's quantity (slowdown, waste, m_w, m_s)."""
        value = getattr(window, self.subject)
        return None if value is None else float(value)

    def holds(self, window: WindowRow) -> bool:
        """Whether a metric rule's condition holds on an analysed window."""
        v = self.figure(window)
        return v is not None and _COMPARE[self.op](v, self.value)

    def clears(self, window: WindowRow) -> bool:
        """Whether a metric rule's clear condition holds on an analysed window."""
        if not self.resolve_op:
            return not self.holds(window)
        v = self.figure(window)
        return v is None or _COMPARE[self.resolve_op](v, float(self.resolve_value or 0.0))


# Built-in alerts, decided outside the windows (their names are reserved in the YAML file):
# the fast detector's per-rank change in step time (changes.py), and a rank that stopped
# sending while the others go on (the job-wide silence is the `stalled` state rule)
FAST_RULE = Rule(name="rank_slowdown", kind="change", severity="warning")
SILENT_RULE = Rule(name="rank_silent", kind="silence", severity="warning")
# held while the windows leave ranks out: one worker's ops differ from its stage peers'
# (whatif/grid.py: its whole DP replica goes), every step of a rank was left out (its clock,
# its ops past the next step), or a replica lacking a worker was dropped (windows.
# whole_replicas): a straggler among them is not seen, so the window must not read as healthy
# (a 3x straggler hid behind its peer's lost collective, then behind the clock check)
LEFT_OUT_RULE = Rule(name="ranks_left_out", kind="left_out", severity="warning")
BUILTIN_RULES = (FAST_RULE, SILENT_RULE, LEFT_OUT_RULE)
# the first words of the window note (windows.analyse_window) that LEFT_OUT_RULE reads
LEFT_OUT_NOTE = "ranks left out of the analysis"
BUILTIN_NAMES = frozenset(r.name for r in BUILTIN_RULES)


class _RuleSpec(msgspec.Struct):
    """One rule as written in the YAML file, before its values are checked."""

    name: Any = None
    when: Any = ""
    for_windows: Any = 1
    resolve_when: Any = None
    resolve_for_windows: Any = 1
    severity: Any = "warning"
    summary: Any = ""


def parse_rules(raw: Any, source: object = "rules") -> list[Rule]:
    """Validate the `rules:` list of the YAML file; errors name the rule and field."""
    if raw is None:
        raw = DEFAULT_RULES
    if not isinstance(raw, list):
        raise InputError(source, "rules", "expected a list of rules")
    rules: list[Rule] = []
    names: set[str] = set()
    for i, r in enumerate(raw):
        where = f"rules[{i}]"
        if not isinstance(r, dict):
            raise InputError(source, where, "expected a mapping with name and when")
        unknown = sorted(set(r) - set(RULE_KEYS))
        if unknown:
            raise InputError(source, f"{where}.{unknown[0]}",
                             f"unknown key; expected one of {', '.join(RULE_KEYS)}")
        spec = msgspec.convert(r, _RuleSpec)
        name = spec.name
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", name):
            raise InputError(source, f"{where}.name", f"expected an identifier, got {name!r}")
        if name in names:
            raise InputError(source, f"{where}.name", f"rule {name!r} is defined twice")
        if name in BUILTIN_NAMES:
            raise InputError(source, f"{where}.name", f"{name!r} is a built-in alert's name "
                             f"(reserved: {', '.join(sorted(BUILTIN_NAMES))})")
        names.add(name)
        k = spec.for_windows
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 10_000:
            raise InputError(source, f"{where}.for_windows", f"expected 1..10000, got {k!r}")
        severity = spec.severity
        if severity not in SEVERITIES:
            raise InputError(source, f"{where}.severity",
                             f"expected one of {', '.join(SEVERITIES)}, got {severity!r}")
        summary = spec.summary
        if not isinstance(summary, str):
            raise InputError(source, f"{where}.summary", "expected text")
        n = spec.resolve_for_windows
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 10_000:
            raise InputError(source, f"{where}.resolve_for_windows",
                             f"expected 1..10000, got {n!r}")
        when = str(spec.when).strip()
        rule = Rule(name=name, kind="", for_windows=k, severity=severity, summary=summary,
                    resolve_windows=n)
        if m := _NUMERIC.match(when):
            rule = replace(rule, kind="metric", subject=m[1], op=m[2], value=float(m[3]))
        elif m := _CAUSE.match(when):
            rule = replace(rule, kind="cause", subject=m[1], value=float(m[2] or 0.0))
        elif when == "new_cause":
            rule = replace(rule, kind="new_cause")
        elif m := _STATE.match(when):
            rule = replace(rule, kind="state", subject=m[1])
        else:
            raise InputError(source, f"{where}.when", f"cannot read {when!r}; expected "
                             f"'{'|'.join(METRICS)} >= NUMBER', 'cause == NAME [and speedup >= "
                             "NUMBER]', 'new_cause' "
                             "or 'state == stalled'")
        if "resolve_when" in r:
            rule = _with_resolve(rule, spec.resolve_when, source, f"{where}.resolve_when")
        elif rule.kind == "state" and n != 1:
            raise InputError(source, f"{where}.resolve_for_windows", "a state rule resolves when "
                             "the state changes; expected 1")
        rules.append(rule)
    return rules


def parse_webhooks(raw: Any, source: object = "webhooks") -> list[str]:
    """Validate the `webhooks:` list of the YAML file: URLs the sender (urllib) can post to."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise InputError(source, "webhooks", "expected a list of http(s):// URLs")
    for i, url in enumerate(raw):
        why = webhook_problem(url)
        if why is not None:
            raise InputError(source, f"webhooks[{i}]", f"{url!r}: {why}; expected an "
                             "http(s)://HOST[:PORT][/PATH] URL")
    return [str(u) for u in raw]


def webhook_problem(url: object) -> str | None:
    """Why `url` cannot be posted to (None when it can): parsed by urllib.parse, as the
    sender's urllib.request parses it. An unusable one was taken at the start, and every
    alert then failed after its retries, said only in INFO log lines (red team round 14 #5)."""
    if not isinstance(url, str):
        return "not text"
    # (http.client refuses spaces and control characters in the request line and Host, and
    # sends only ASCII: percent-encoded or punycode forms are what reach the receiver)
    odd = next((c for c in url if not " " < c < "\x7f"), None)
    if odd is not None:
        return f"character {odd!r} at {url.index(odd)} (no spaces, control or non-ASCII " \
            "characters: percent-encode them)"
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:   # (an open '[': "Invalid IPv6 URL")
        return str(exc)
    try:
        port = parts.port
    except ValueError as exc:   # not a number, or past 65535
        return f"its port: {exc}"
    if parts.scheme not in ("http", "https"):
        return "not an http:// or https:// URL"
    if not parts.hostname:
        return "no host"
    if parts.username is not None:   # (urllib looks 'user@host' up as a host name)
        return "credentials in a URL (user@) are not sent by the sender"
    if port == 0:
        return "its port: 0 is not one to post to (1..65535)"
    return None


def _with_resolve(rule: Rule, raw: Any, source: object, field: str) -> Rule:
    """The rule with its clear condition (`resolve_when`), which must exclude the condition."""
    text = str(raw).strip()
    if rule.kind == "metric":
        m = _NUMERIC.match(text)
        if m is None or m[1] != rule.subject:
            raise InputError(source, field, f"cannot read {text!r}; expected '{rule.subject} "
                             "(<|<=|>|>=) NUMBER' (the same quantity as `when`)")
        op, value = m[2], float(m[3])
        up, resolve_up = rule.op.startswith(">"), op.startswith(">")
        # the two conditions must be disjoint: no value may both fire and clear an alert
        both_inclusive = op.endswith("=") and rule.op.endswith("=")
        beyond = value < rule.value if up else value > rule.value
        disjoint = up != resolve_up and (beyond or (value == rule.value and not both_inclusive))
        if not disjoint:
            raise InputError(source, field, f"{text!r} overlaps `when: {rule.subject} {rule.op} "
                             f"{rule.value:g}`; expected a threshold on the other side of it "
                             f"(e.g. '{rule.subject} {'<' if up else '>'} {rule.value:g}' or "
                             "beyond)")
        return replace(rule, resolve_op=op, resolve_value=value)
    if rule.kind == "cause":
        m = _SPEEDUP_BELOW.match(text)
        if m is None:
            raise InputError(source, field, f"cannot read {text!r}; expected 'speedup < NUMBER'")
        value = float(m[1])
        if value > rule.value:
            raise InputError(source, field, f"speedup < {value:g} overlaps `when` (speedup >= "
                             f"{rule.value:g}); expected a number at most {rule.value:g}")
        return replace(rule, resolve_value=value)
    raise InputError(source, field, f"a {rule.kind} rule has no resolve condition; use "
                     "resolve_for_windows alone")


def fingerprint(labels: Labels) -> str:
    """A stable id of an alert: 16 hex digits of a hash of its sorted labels."""
    return hashlib.sha256(sorted_json(labels).encode()).hexdigest()[:16]


def rfc3339(t: float | None) -> str:
    """A time as Alertmanager writes it; the zero time for 'not ended'."""
    if t is None:
        return "0001-01-01T00:00:00Z"
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


class _Active(msgspec.Struct):
    """An alert whose condition holds now."""

    rule: Rule
    labels: Labels
    annotations: Annotations


# What an alert decision returns: rows to store, transitions to log, webhook messages to send.
class WebhookAlert(TypedDict):
    """One alert of an Alertmanager webhook body (version 4)."""

    status: str
    labels: dict[str, Any]
    annotations: dict[str, Any]
    startsAt: str
    endsAt: str
    generatorURL: str
    fingerprint: str


class WebhookPayload(TypedDict):
    """The Alertmanager webhook body (version 4) the outbox posts: one alert transition."""

    version: str
    groupKey: str
    truncatedAlerts: int
    status: str
    receiver: str
    groupLabels: dict[str, str]
    commonLabels: dict[str, Any]
    commonAnnotations: dict[str, Any]
    externalURL: str
    alerts: list[WebhookAlert]


Changes = tuple[list[Alert], list[AlertLogEntry], list[WebhookPayload]]


class AlertEngine:
    """Decides which alerts fire and resolve; returns store rows and messages to send."""

    def __init__(self, rules: list[Rule], store: SQLStore, repeat_s: float,
                 external_url: str = ""):
        self.rules, self.store, self.repeat_s = rules, store, float(repeat_s)
        self.external_url = external_url.rstrip("/")
        self.max_k = max([max(r.for_windows, r.resolve_windows) for r in rules]
                         + [2, NEW_CAUSE_LOOKBACK + max(r.resolve_windows for r in rules)
                            if rules else 2])

    def on_window(self, job: str, window: WindowRow, now: float | None = None) -> Changes:
        """Alert changes caused by a new analysed window: (alert rows, log rows, messages)."""
        now = time.time() if now is None else now
        history = [window] + [w for w in self.store.recent_windows(job, self.max_k + 1)
                              if w.idx != window.idx]
        active: dict[str, _Active] = {}   # fingerprint -> alert that holds now
        decided: set[str] = set()         # rules (name) evaluated on this window
        if window.error is None:
            firing = self.store.alerts(job=job, status="firing")
            recent = [w for w in history if w.error is None]
            for rule in self.rules:
                if rule.kind == "state":
                    continue
                decided.add(rule.name)
                for labels, notes in self._holding(rule, job, history):
                    active[fingerprint(labels)] = _Active(rule, labels, notes)
                # a firing alert whose clear condition has not held long enough keeps firing
                for a in firing:
                    if a.rule == rule.name and a.fingerprint not in active and \
                            not self._cleared(rule, a.labels, recent):
                        active[a.fingerprint] = _Active(rule, a.labels, a.annotations)
            decided |= self._unconfigured(firing)   # (left firing when the job was taken)
            decided.add(LEFT_OUT_RULE.name)
            said = [n for n in window.notes if n.startswith(LEFT_OUT_NOTE)]
            if said:
                labels = self._labels(LEFT_OUT_RULE, job)
                active[fingerprint(labels)] = _Active(LEFT_OUT_RULE, labels, Annotations(
                    summary=f"job {job}: ranks left out of window {window.idx}, unjudged",
                    description="; ".join(said)))
        return self._apply(job, active, decided, now, window.idx)

    @staticmethod
    def _cleared(rule: Rule, labels: Labels, recent: list[WindowRow]) -> bool:
        """Whether the alert's clear condition held on the last `resolve_windows` windows."""
        n = rule.resolve_windows
        if len(recent) < n:
            return False
        if rule.kind == "metric":
            return all(rule.clears(w) for w in recent[:n])
        if rule.kind == "cause":
            key = _place_key(labels)
            threshold = rule.value if rule.resolve_value is None else rule.resolve_value
            return all(key not in _places(w, rule, threshold) for w in recent[:n])
        if rule.kind == "new_cause":
            # over once the cause is gone for n windows: a cause found in every window is
            # not over after its first (it resolved at the next window while it went on)
            # (a verdict's alert, stored before verdicts were told from causes, resolves)
            return labels.cause in VERDICTS or \
                all(labels.cause not in {f.cause for f in w.diagnosis} for w in recent[:n])
        return True

    def on_state(self, job: str, state: str, now: float | None = None) -> Changes:
        """Alert changes caused by a job's state change (stalled, running again, finished)."""
        now = time.time() if now is None else now
        active: dict[str, _Active] = {}
        decided: set[str] = set()
        for rule in self.rules:
            if rule.kind != "state":
                continue
            decided.add(rule.name)
            if state == rule.subject:
                labels = self._labels(rule, job)
                active[fingerprint(labels)] = _Active(rule, labels, Annotations(
                    summary=rule.summary or f"job {job} is {state}",
                    description=f"no new part of job {job} arrived for the stall limit"))
        if state == "finished":   # the job's built-in alerts end with it
            decided |= BUILTIN_NAMES
        return self._apply(job, active, decided, now, None)

    def on_unconfigured(self, job: str, now: float | None = None) -> Changes:
        """The job's firing alerts of rules no longer configured (taken out of the rules
        file, renamed) resolve: nothing decides them any more, and they fired for good."""
        now = time.time() if now is None else now
        gone = self._unconfigured(self.store.alerts(job=job, status="firing"))
        changes = self._apply(job, {}, gone, now, None)
        for rule in sorted(gone):
            log.warning("alerts: rule %r is not configured any more: job %s's alerts of it "
                        "resolved", rule, job)
        return changes

    def _unconfigured(self, firing: list[Alert]) -> set[str]:
        """The rules of `firing` alerts that are neither configured nor built in."""
        known = {r.name for r in self.rules} | BUILTIN_NAMES
        return {a.rule for a in firing if a.rule not in known}

    def on_reset(self, job: str, now: float | None = None) -> Changes:
        """A new run of the job: every alert of the old one resolves."""
        now = time.time() if now is None else now
        return self._apply(job, {}, {r.name for r in self.rules} | BUILTIN_NAMES, now, None)

    def on_changes(self, job: str, firing: dict[int, Change], judged: set[int],
                   places: dict[int, Place], now: float | None = None) -> Changes:
        """The fast detector's alerts (rank_slowdown): one per rank whose change fires
        (`firing`: rank → changes.Change); a firing alert of a rank the detector `judged` and
        no longer finds changed resolves (a restarted monitor judges a rank again once it
        learnt its baseline)."""
        now = time.time() if now is None else now
        active = {}
        for rank, c in firing.items():
            labels = self._labels(FAST_RULE, job, places.get(rank), rank=str(rank),
                                  detector="fast")
            active[fingerprint(labels)] = _Active(FAST_RULE, labels, Annotations(
                summary=f"job {job}: rank {rank} is {c.ratio:.2f}× slower since step "
                        f"{c.since_step}",
                description=f"fast detector: rank {rank}'s busy time per step (its compute, "
                            f"relative to its peers) rose {c.ratio:.2f}× against its own "
                            f"baseline from step {c.since_step} (CUSUM, decided at step "
                            f"{c.at_step}); the window analysis of these steps follows "
                            "with the what-if attribution"))
        return self._apply(job, active, {FAST_RULE.name}, now, None,
                           settled=lambda labels: rank_of(labels) in judged)

    def on_silence(self, job: str, silent: dict[int, float], places: dict[int, Place],
                   now: float | None = None) -> Changes:
        """rank_silent alerts: one per rank that sent nothing for `silent[rank]` seconds while
        the job's other ranks go on; the others resolve."""
        now = time.time() if now is None else now
        active = {}
        for rank, quiet in silent.items():
            labels = self._labels(SILENT_RULE, job, places.get(rank), rank=str(rank))
            active[fingerprint(labels)] = _Active(SILENT_RULE, labels, Annotations(
                summary=f"job {job}: rank {rank} sent nothing for {quiet:.0f} s",
                description=f"no part of rank {rank} arrived for {quiet:.0f} s while the "
                            "job's other ranks kept sending (a dead recorder or uploader, "
                            "or a rank that left the job); its windows wait for it, then "
                            "close without it"))
        return self._apply(job, active, {SILENT_RULE.name}, now, None)

    @staticmethod
    def _labels(rule: Rule, job: str, place: Place | None = None,
                **extra: str | None) -> Labels:
        """An alert's labels: the rule's, the job's, the place's (where a rank runs)."""
        if place is not None:
            extra = {"dp": place.dp, "pp": place.pp, "host": place.host, **extra}
        return Labels(alertname=rule.name, job=job, severity=rule.severity, **extra)

    def _holding(self, rule: Rule, job: str,
                 history: list[WindowRow]) -> Iterator[tuple[Labels, Annotations]]:
        """(labels, annotations) of every alert of `rule` whose condition holds now."""
        k = rule.for_windows
        recent = [w for w in history if w.error is None][:max(k, 2)]
        current = history[0]
        if rule.kind == "metric":
            value = rule.figure(current)
            if value is not None and len(recent) >= k and all(rule.holds(w) for w in recent[:k]):
                yield self._labels(rule, job), Annotations(
                    summary=rule.summary or f"job {job}: {rule.subject} {value:.3f} "
                                            f"{rule.op} {rule.value:g}",
                    description=f"{rule.subject} = {value:.3f} in window {current.idx} "
                                f"(steps {current.first_step}–{current.last_step})"
                                + (f", {k} windows in a row" if k > 1 else "")
                                + _top_cause(current))
        elif rule.kind == "cause":
            if len(recent) < k:
                return
            held = [_places(w, rule) for w in recent[:k]]
            for place, (labels, f) in held[0].items():
                if all(place in h for h in held[1:]):
                    what = f"{rule.subject.replace('_', ' ')} at rank {labels.rank}" \
                        if labels.rank is not None and "," not in labels.rank else \
                        (f.headline or rule.subject)
                    yield self._labels(rule, job, cause=labels.cause, rank=labels.rank,
                                       dp=labels.dp, pp=labels.pp, host=labels.host), \
                        Annotations(summary=rule.summary or f"job {job}: {what}",
                                    description=f.headline or f.evidence)
        elif rule.kind == "new_cause":
            # new: absent from the previous NEW_CAUSE_LOOKBACK windows (the job's first window
            # has none before it: every cause in it is new); a cause that comes and goes from
            # one window to the next is not new each time it comes back (it fired, resolved
            # and fired again every few seconds)
            recent = [w for w in history if w.error is None][:NEW_CAUSE_LOOKBACK + 1]
            before = _causes_before(recent, 0)
            for f in current.diagnosis:
                if f.cause and f.cause not in VERDICTS and f.cause not in before:
                    yield self._labels(rule, job, cause=f.cause), Annotations(
                        summary=rule.summary or f"job {job}: new cause {f.cause}",
                        description=f.headline or f.evidence)

    def _apply(self, job: str, active: dict[str, _Active], decided: set[str], now: float,
               window_idx: int | None,
               settled: Callable[[Labels], bool] | None = None) -> Changes:
        """Rows and messages for alerts that start or repeat (`active`) and for firing alerts
        of the `decided` rules no longer active (those whose labels `settled` accepts)."""
        alert_rows: list[Alert] = []
        log_rows: list[AlertLogEntry] = []
        current = {a.fingerprint: a for a in self.store.alerts(job=job)}
        for fp, act in active.items():
            old = current.get(fp)
            if old is not None and old.status == "firing":
                if now - old.last_sent < self.repeat_s:
                    continue
                row = msgspec.structs.replace(old, annotations=act.annotations, last_sent=now)
            else:
                row = Alert(fingerprint=fp, rule=act.rule.name, job=job, labels=act.labels,
                            annotations=act.annotations, status="firing", starts_at=now,
                            ends_at=None, last_sent=now)
                log_rows.append(self._log(row, window_idx, now))
            alert_rows.append(row)
        for fp, old in current.items():
            if old.status == "firing" and old.rule in decided and fp not in active \
                    and (settled is None or settled(old.labels)):
                row = msgspec.structs.replace(old, status="resolved", ends_at=now, last_sent=now)
                alert_rows.append(row)
                log_rows.append(self._log(row, window_idx, now))
        # (their log lines are written once they are stored: log_stored; a decision whose
        # write was refused is decided again, and said each time)
        return alert_rows, log_rows, [self.payload(a) for a in alert_rows]

    @staticmethod
    def log_stored(log_rows: list[AlertLogEntry]) -> None:
        """Log the alert transitions just stored (one line each)."""
        for e in log_rows:
            log.warning("alert %s: %s (job %s) %s", e.status, e.rule, e.job, e.summary)

    @staticmethod
    def _log(row: Alert, window_idx: int | None, now: float) -> AlertLogEntry:
        return AlertLogEntry(at=now, fingerprint=row.fingerprint, job=row.job, rule=row.rule,
                             status=row.status, severity=row.labels.severity,
                             summary=row.annotations.summary,
                             description=row.annotations.description, window=window_idx)

    def payload(self, row: Alert, receiver: str = "stragglers") -> WebhookPayload:
        """The Alertmanager webhook body (version 4) of one alert transition."""
        labels, annotations = plain(row.labels), plain(row.annotations)
        group = {"alertname": row.labels.alertname, "job": row.labels.job}
        return {
            "version": "4", "groupKey": "{}:" + json.dumps(group, sort_keys=True),
            "truncatedAlerts": 0, "status": row.status, "receiver": receiver,
            "groupLabels": group, "commonLabels": labels,
            "commonAnnotations": annotations, "externalURL": self.external_url,
            "alerts": [{"status": row.status, "labels": labels,
                        "annotations": annotations, "startsAt": rfc3339(row.starts_at),
                        "endsAt": rfc3339(row.ends_at),
                        "generatorURL": f"{self.external_url}/jobs/{row.labels.job}",
                        "fingerprint": row.fingerprint}]}


NEW_CAUSE_LOOKBACK = 10   # windows a cause must have been absent from to be new again


def _causes_before(recent: list[WindowRow], i: int) -> set[str]:
    """The causes of the NEW_CAUSE_LOOKBACK windows before recent[i] (newest first)."""
    return {f.cause for w in recent[i + 1:i + 1 + NEW_CAUSE_LOOKBACK] for f in w.diagnosis}


def _top_cause(window: WindowRow) -> str:
    causes = [f for f in window.diagnosis if f.cause not in VERDICTS]
    return f"; {causes[0].headline or causes[0].cause}" if causes else ""


def _counts(finding: WindowFinding, rule: Rule, threshold: float) -> bool:
    """A finding of the rule's cause that buys at least `threshold` speedup if fixed."""
    return finding.cause == rule.subject and float(finding.speedup_if_fixed or 0.0) >= threshold


def rank_of(labels: Labels) -> int:
    """The one rank an alert's labels name (-1: none, or several)."""
    try:
        return int(labels.rank) if labels.rank is not None else -1
    except ValueError:
        return -1


# Causes whose fix is a launch delay's (whatif Candidate.delay): S leaves them out, so each has
# a default rule of its own (tests/monitor/test_monitor_alert_defaults.py holds them to it)
LAUNCH_DELAY_CAUSES = ("host_stall",)

# Causes that sit on single workers: one alert per worker, so a second slow worker is its own
# alert and a finding that names {1, 2} one window and {1} the next keeps rank 1's alert.
WORKER_CAUSES = ("worker_fault", "host_stall")
PlaceKey = tuple[str, Any]


def _place_key(labels: Labels) -> PlaceKey:
    """Where an alert of a cause rule points: a worker's rank, or its place labels."""
    if labels.cause in WORKER_CAUSES and labels.rank is not None and "," not in labels.rank:
        return ("rank", int(labels.rank))
    return ("where", (labels.cause, labels.dp, labels.pp, labels.rank))


def _places(window: WindowRow, rule: Rule,
            threshold: float | None = None) -> dict[PlaceKey, tuple[Labels, WindowFinding]]:
    """place → (labels, finding) of the rule's cause in a window (counting findings that buy
    at least `threshold`, by default the rule's own); the labels hold the place only."""
    out = {}
    threshold = rule.value if threshold is None else threshold
    for f in window.diagnosis:
        if not _counts(f, rule, threshold):
            continue
        if f.cause in WORKER_CAUSES and f.ranks:
            workers = {int(w.rank): w for w in f.where.workers if w.rank is not None}
            for r in f.ranks:
                w = workers.get(int(r))
                labels = Labels("", "", "", cause=f.cause, rank=str(r))
                if w is not None:
                    labels.dp, labels.pp = str(w.dp), str(w.pp)
                    labels.host = None if w.host is None else str(w.host)
                out[_place_key(labels)] = (labels, f)
        else:
            labels = Labels("", "", "", cause=f.cause)
            if f.where.dp:
                labels.dp = ",".join(map(str, f.where.dp))
            if f.where.pp:
                labels.pp = ",".join(map(str, f.where.pp))
            if f.ranks:
                labels.rank = ",".join(map(str, f.ranks))
            out[_place_key(labels)] = (labels, f)
    return out
