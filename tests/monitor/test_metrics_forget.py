"""/metrics does not keep a job's series for the process's life: a job forgotten (expired,
deleted) loses every family's series, a finished one its per-rank and per-worker series (they
stayed: 4,096 upload_dropped lines for one job of 4,096 ranks, growing with every job seen)."""

from __future__ import annotations

import msgspec

from stragglers.monitor.metrics import MonitorMetrics
from stragglers.monitor.records import WindowRow


FAMILIES = {"stragglers_slowdown", "stragglers_waste", "stragglers_worker_score",
            "stragglers_diagnosis", "stragglers_windows_total", "stragglers_windows_created",
            "stragglers_upload_dropped", "stragglers_job_state", "stragglers_alerts_firing",
            "stragglers_silent_ranks", "stragglers_window_failed"}


def _window(job: str, ranks: int) -> WindowRow:
    return msgspec.convert({
        "job": job, "idx": 0, "first_step": 0, "last_step": 9, "steps": list(range(10)),
        "slowdown": 1.5, "waste": 1 / 3,
        "scores": [{"dp": r, "pp": 0, "rank": r, "host": f"h{r}", "score": 1.0 + r}
                   for r in range(ranks)],
        "diagnosis": [{"cause": "compute", "speedup_if_fixed": 1.4}],
        "closed_at": 1.0, "analysed_at": 2.0}, WindowRow)


def _exposed(m: MonitorMetrics) -> MonitorMetrics:
    for job in ("a", "b"):
        m.publish_window(_window(job, 4))
        m.set_state(job, "running")
        m.open_alerts.labels(job).set(1)
        m.silent_ranks.labels(job).set(0)
        for rank in range(4):   # (as ingest_http sets it from X-Stragglers-Dropped)
            m.upload_dropped.labels(job, str(rank)).set(rank + 1)
    return m


def _lines(m: MonitorMetrics, job: str) -> list[str]:
    return [line for line in m.render().decode().splitlines()
            if not line.startswith("#") and f'job="{job}"' in line]


def test_a_forgotten_job_leaves_no_series():
    m = _exposed(MonitorMetrics())
    before_b = _lines(m, "b")
    assert {line.split("{")[0] for line in _lines(m, "a")} == FAMILIES
    m.forget("a")
    assert _lines(m, "a") == []
    assert _lines(m, "b") == before_b   # another job's untouched
    m.publish_window(_window("a", 2))   # a job of that name again: exposed afresh
    assert sum("stragglers_worker_score{" in line for line in _lines(m, "a")) == 2


def test_a_finished_job_keeps_its_figures_not_its_ranks():
    m = _exposed(MonitorMetrics())
    m.set_state("a", "finished")
    left = _lines(m, "a")
    assert not any(line.startswith(("stragglers_worker_score{", "stragglers_upload_dropped{"))
                   for line in left)
    assert any(line.startswith("stragglers_slowdown{") for line in left)
    assert 'stragglers_job_state{job="a",state="finished"} 1.0' in left
    assert sum(line.startswith("stragglers_worker_score{") for line in _lines(m, "b")) == 4
    m.set_state("a", "running")   # it runs again: its next window exposes its workers
    m.publish_window(_window("a", 3))
    assert sum(line.startswith("stragglers_worker_score{") for line in _lines(m, "a")) == 3
