"""Alerts that do not wait for a window: a rank whose step time changed (the fast detector,
changes.py) and a rank gone silent while the job goes on.

The detector runs on its own thread, fed by the job trackers' new parts (whatever way they
came: watched, uploaded, or taken from a shared store), so neither the ingest nor the window
analysis waits on it, and it never waits on a window being analysed. Silence is checked by the
tick thread. Their alert changes go through the alert engine and the store like every other
(stable fingerprints, resolve messages, the outbox)."""

from __future__ import annotations

import logging
import queue
import time

from stragglers.monitor import fast_state
from stragglers.monitor.alerts import FAST_RULE, rank_of
from stragglers.monitor.changes import GC_CODE, ChangeSettings, PartBusy, RankChangeDetector, \
    is_compute, part_busy, read_part_busy
from stragglers.monitor.parts import PartFile
from stragglers.monitor.records import Place
from stragglers.monitor.windows import JobTracker, stuck_window_reads

log = logging.getLogger(__name__)


class Watchdog:
    """Per-job change detectors and silent ranks of one monitor."""

    def __init__(self, monitor):
        self.monitor = monitor
        cfg = monitor.config
        self.enabled = bool(cfg.change_detector)
        self.settings = ChangeSettings(min_ratio=cfg.change_min_ratio,
                                       threshold=cfg.change_threshold,
                                       baseline_steps=cfg.change_baseline_steps,
                                       warmup_steps=cfg.change_warmup_steps)
        self.detectors: dict[str, tuple[JobTracker, tuple, RankChangeDetector]] = {}
        self.judged: dict[str, set[int]] = {}      # job → ranks whose alerts were decided
        self.kept: dict[str, set[int]] = {}        # job → firing ranks whose state is stored
        self.silent: dict[str, dict[int, float]] = {}   # job → silent ranks last decided
        # jobs with a rank quiet past its deadline but not behind the others (at the last
        # check): silent once a part takes the others past its steps, which the ingest tells
        # the tick at once (no deadline is due for it any more: it was decided a tick late)
        self.overdue: set[str] = set()
        # jobs whose fast alerts' write was refused (a full disk): decided and written again
        # at the detector's next pass, new parts or not
        self.unstored: set[str] = set()
        self.queue: queue.Queue = queue.Queue()

    # ---- the change detector's thread --------------------------------------------------------

    def wake(self) -> None:
        """New parts were added to trackers: look at them now (counted until looked at)."""
        self.monitor._count(1)
        self.queue.put(True)

    def stop(self) -> None:
        """End run()."""
        self.queue.put(None)

    def run(self) -> None:
        """Take the trackers' new parts whenever woken (or every tick: parts a shared store
        brought in), until stop()."""
        while True:
            try:
                items = [self.queue.get(timeout=self.monitor.config.tick_s)]
            except queue.Empty:
                items = []
            while True:   # every wake-up queued meanwhile is answered by this one pass
                try:
                    items.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            try:
                if None not in items:
                    self.detect()
            except Exception:
                log.exception("change detection failed")
            finally:
                self.monitor._count(-sum(1 for i in items if i is True))
            if None in items:
                return

    def detect(self) -> None:
        """Feed every job's new parts to its detector; store and send the alert changes."""
        m = self.monitor
        with m._lock:
            work = [(job, tr, tr.arrived) for job, tr in m.trackers.items()
                    if isinstance(tr, JobTracker) and (tr.arrived or job in self.unstored
                                                       or self._closed(job, tr))]
            for _, tr, _ in work:
                tr.arrived = []
        for job in [j for j in self.detectors if j not in m.trackers]:
            self.detectors.pop(job, None)   # finished or held elsewhere: its memory goes
            self.unstored.discard(job)
            self.kept.pop(job, None)
        if not self.enabled:
            return
        for job, tr, arrived in work:
            detector = self._detector(job, tr)
            if detector is None:   # (these parts' values are not kept: warm-up is 20 steps)
                self.unstored.discard(job)
                continue
            sources = [src for _, src in arrived]
            # the files on the bounded file readers (a file stuck since its footer was read
            # is left out, as an unreadable one: None), the uploads' rows here
            files = [s for s in sources if isinstance(s, PartFile)]
            busy_of = dict(zip(map(id, files), m.file_readers.map(_busy, files)))
            read = [busy_of[id(s)] if isinstance(s, PartFile) else _busy(s) for s in sources]
            for (rank, _), busy in zip(arrived, read):
                if isinstance(busy, PartBusy):
                    detector.add(rank, busy.steps, busy.busy, busy.first_start, busy.last)
            # a window cut: its steps get no later part, their carried computes count now
            detector.close_through(tr.consumed_step)
            changes = detector.settle()
            judged = detector.warm()
            if changes or judged != self.judged.get(job) or job in self.unstored:
                # (decided from the detector's state, `firing`: a refused write is decided
                # again whole at the next pass; what was judged counts once it is stored)
                what = f"job {job}'s fast alerts"
                try:
                    firing = set(detector.firing)
                    if firing != self.kept.get(job) and m.leases.lease(job) is not None:
                        # what each fired against, before its alert is stored: a restart (kill
                        # -9 included) resumes a rank whose alert it finds firing from it
                        fast_state.save(m.store, job, {r: detector.fired_state(r)
                                                       for r in firing})
                        self.kept[job] = firing
                    m.store_alerts(job, m.alerts.on_changes(job, dict(detector.firing), judged,
                                                            _places(tr)))
                except Exception as exc:   # noqa: BLE001 - kept for the next pass
                    self.unstored.add(job)
                    m.trouble.refused(what, exc)
                else:
                    self.judged[job] = judged
                    self.unstored.discard(job)
                    m.trouble.stored(what)
            for c in changes:
                log.warning("job %s: rank %d %s (%.2f× since step %d, step %d)", job, c.rank,
                            "slowed down" if c.status == "firing" else "recovered", c.ratio,
                            c.since_step, c.at_step)

    def _closed(self, job: str, tr: JobTracker) -> bool:
        """Whether a window cut the step of a compute the job's detector carries (judged now,
        not at the job's next part: a job's last steps had none)."""
        held = self.detectors.get(job)
        carried = None if held is None or held[0] is not tr else held[2].carried_from()
        return carried is not None and carried <= tr.consumed_step

    def _detector(self, job: str, tr: JobTracker) -> RankChangeDetector | None:
        """The job's detector, new when the job's tracker or its ranks changed (a new run, a
        layout that came later); None while fewer than half its ranks sent a part: its state
        is ~1 KB a rank of the declared world, and a job of 65,536 ranks of which one sent a
        part held ~65 MB (a peer median needs the peers anyway)."""
        ranks = tuple(tr.expected_ranks)
        if 2 * len(tr.ranks) < len(ranks):
            return None
        held = self.detectors.get(job)
        if held is None or held[0] is not tr or held[1] != ranks:
            stages = {r: e.stage or 0 for r, e in tr.layout.items()}
            detector = RankChangeDetector(list(ranks), stages, self.settings)
            # ranks whose rank_slowdown the store holds firing resume from what they fired
            # against (a new detector learnt the slow steps as their baseline and resolved
            # them while they stayed slow); a new run's alerts were resolved: none resume
            states = fast_state.load(self.monitor.store, job)
            if states:
                for a in self.monitor.store.alerts(job=job, status="firing"):
                    rank = rank_of(a.labels) if a.rule == FAST_RULE.name else None
                    if rank in states:
                        detector.resume(rank, states[rank])
            held = self.detectors[job] = (tr, ranks, detector)
            self.judged.pop(job, None)
            self.kept.pop(job, None)   # (saved again at its next decision)
        return held[2]

    # ---- silence, on the tick thread ---------------------------------------------------------

    def check_silence(self, now: float) -> None:
        """rank_silent alerts for the running jobs' ranks that sent nothing for stall_after_s
        while the others went on past their steps (a job silent as a whole is `stalled`, a
        state and its own alert)."""
        m, limit = self.monitor, self.monitor.config.stall_after_s
        if self.lagging():
            return   # its parts may be queued here: decided again once the ingest caught up
        decided, overdue = [], set()
        with m._lock:
            for job, tr in m.trackers.items():
                if not isinstance(tr, JobTracker) or m.states.get(job) != "running" \
                        or tr.first_arrival is None or tr.closed_marker:
                    continue
                silent, quiet = {}, False
                heard, unheard = tr.heard_expected()
                for rank in heard:
                    rp = tr.ranks.get(rank)
                    last = tr.quiet_since(rank) or now
                    # and the others went on past its steps: at a job's end its ranks' last
                    # parts, of the same last step, come over a second or two, which is not
                    # one rank gone (seen: 16 of 32 ranks alerted just before their job stalled)
                    behind = (rp.last_step if rp else -1) < tr.max_step
                    if now - last >= limit and not behind:
                        quiet = True   # silent once the others go past its steps
                    elif now - last >= limit:
                        here = m.in_flight(job, rank, since=last)
                        if here or not m.settled_elsewhere(last + limit):
                            # a part of it is in the ingest (written just before the
                            # deadline), here or at another instance: decided again once it
                            # is stored or refused (another's: at the next ticks, which a
                            # landing here need not wake)
                            if here:
                                m.defer_silence()
                            if rank in self.silent.get(job, {}):   # as decided before
                                silent[rank] = self.silent[job][rank]
                            continue
                        silent[rank] = now - last
                if unheard:   # the ranks never heard from share one silence: taken at once
                    quiet |= self._unheard(job, tr, heard, silent, now)
                if job not in self.silent or silent.keys() != self.silent[job].keys():
                    decided.append((job, silent, _places(tr)))
                if quiet:
                    overdue.add(job)
        self.overdue = overdue
        for job, silent, places in decided:
            before = self.silent.get(job)
            self.silent[job] = silent
            m.metrics.silent_ranks.labels(job).set(len(silent))
            what = f"job {job}'s silent ranks"
            alerted = self._alerted(silent)
            try:
                stored = m.store_dead_man(job, None, m.alerts.on_silence(job, alerted, places,
                                                                         now))
            except Exception as exc:   # noqa: BLE001 - decided again at the next tick
                stored = False
                m.trouble.refused(what, exc)
            if stored:
                m.trouble.stored(what)
                if len(alerted) < len(silent):   # (once stored: not at every retry)
                    log.warning("job %s: %d ranks silent; rank_silent alerts for the %d quiet "
                                "longest (max_silent_alerts)", job, len(silent), len(alerted))
            else:
                # not stored (the lease moved on, or ran out while this process was paused;
                # or the write was refused: a full disk): decided again at the next tick
                if before is None:
                    self.silent.pop(job, None)
                else:
                    self.silent[job] = before
                m.metrics.silent_ranks.labels(job).set(len(before or {}))
        for job in [j for j in self.silent if j not in m.trackers]:
            self.silent.pop(job, None)
            m.metrics.silent_ranks.labels(job).set(0)

    def _unheard(self, job: str, tr: JobTracker, heard: list[int], silent: dict[int, float],
                 now: float) -> bool:
        """The silence of a job's ranks that never sent a part, as check_silence decides a
        rank's, for all of them at once (walking a declared world of 65,536 ranks one by one
        each tick, for every such job, was most of an idle monitor's CPU); added to `silent`.
        True when they are quiet but not behind (the job has no step yet)."""
        m, limit = self.monitor, self.monitor.config.stall_after_s
        last = tr.quiet_since(-1) or now   # (-1: a rank never heard from)
        if now - last < limit:
            return False
        if tr.max_step < 0:
            return True
        others = tr.unheard(heard)
        # (another instance's parts in flight are not known by rank: all of them wait, for
        # the next ticks)
        elsewhere = not m.settled_elsewhere(last + limit)
        flying = None if elsewhere else m.ranks_in_flight(job, last)
        if flying is None or flying.intersection(others):
            # a part of one is in the ingest (or may be in a watcher's hand-over): those are
            # decided again once it is stored or refused, as before for the others
            if not elsewhere:
                m.defer_silence()
            before = self.silent.get(job, {})
            if flying is None:
                silent.update((r, v) for r, v in before.items() if r not in tr.ranks)
                return False
            for r in flying.intersection(others):
                if r in before:
                    silent[r] = before[r]
            others = sorted(set(others) - flying)
        silent.update(dict.fromkeys(others, now - last))
        return False

    def _alerted(self, silent: dict[int, float]) -> dict[int, float]:
        """The silent ranks that get a rank_silent alert: at most max_silent_alerts, those quiet
        longest (then the lowest ranks); the others are counted in one log line once stored."""
        cap = self.monitor.config.max_silent_alerts
        if len(silent) <= cap:
            return dict(sorted(silent.items()))   # (by rank, as the ranks were walked before)
        chosen = sorted(silent, key=lambda r: (-silent[r], r))[:cap]
        return {r: silent[r] for r in chosen}

    # ---- the monitor's own health, read by /metrics (metrics.HealthCollector) ----------------

    def ingest_lag(self) -> float:
        """Seconds the oldest part queued or being stored has waited (0 when none)."""
        m = self.monitor
        oldest = m._ingest_started
        with m._ingest.mutex:   # the queue's own lock: a peek at its head
            head = m._ingest.queue[0] if m._ingest.queue else None
        if head is not None:
            oldest = head.queued_at if oldest is None else min(oldest, head.queued_at)
        return max(0.0, time.monotonic() - oldest) if oldest is not None else 0.0

    def lagging(self) -> bool:
        """Whether the ingest is behind by half stall_after_s or more: a part written that long
        ago may be waiting here, so quiet is not silence (job and rank silence wait)."""
        return self.ingest_lag() >= self.monitor.config.stall_after_s / 2

    def queue_depths(self) -> dict[str, int]:
        """Items waiting on each of the monitor's queues."""
        m = self.monitor
        return {"ingest": m._ingest.qsize(), "analysis": m._analysis.qsize(),
                "changes": self.queue.qsize(),
                # watched files whose read did not return (left for a later scan)
                "stuck_reads": len(m.file_readers.stuck) + len(stuck_window_reads())}

    def delivery_counts(self) -> dict[str, int]:
        """Alert messages sent, given up on and dropped, over every sender."""
        m = self.monitor
        senders = [s for s in [getattr(m, "outbox", None), *getattr(m, "senders", ())] if s]
        return {outcome: sum(getattr(s, outcome, 0) for s in senders)
                for outcome in ("sent", "failed", "dropped")}

    def last_parts(self) -> dict[str, float]:
        """job → when its latest part arrived, for the jobs followed here."""
        m = self.monitor
        with m._lock:
            return {job: tr.last_arrival for job, tr in m.trackers.items()
                    if isinstance(tr, JobTracker) and tr.last_arrival is not None}


def _busy(src: PartFile | dict) -> PartBusy | None:
    """A part's busy time per step (its last compute aside), from its file or its columns."""
    if isinstance(src, PartFile):
        # a part of one step (a part a step): its step is the footer's, not read again
        return read_part_busy(src.path,
                              src.first_step if src.first_step == src.last_step else None)
    optype = src["optype"]
    return part_busy(src["step"], is_compute(optype), src["start_ts"], src["duration"],
                     optype == GC_CODE)


def _places(tr: JobTracker) -> dict[int, Place]:
    """rank → the labels that say where it runs (dp, pp, host), from the job's layout."""
    return {rank: Place(dp=None if e.dp_rank is None else str(e.dp_rank),
                        pp=None if e.stage is None else str(e.stage), host=e.host or None)
            for rank, e in tr.layout.items()}

