"""After a window whose analysis failed, /metrics shows none of the window before's figures as
current: S, waste, the workers' scores and the causes go, stragglers_window_failed says 1."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from stragglers.monitor.metrics import MonitorMetrics
from stragglers.monitor.records import WindowFinding, WindowRow, WindowScore

PER_WINDOW = ("stragglers_slowdown", "stragglers_waste", "stragglers_worker_score",
              "stragglers_diagnosis")


def _series(metrics: MonitorMetrics, job: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if s.labels.get("job") == job:
                out[s.name + str(sorted(s.labels.items()))] = s.value
    return out


def _named(series: dict[str, float], name: str) -> list[float]:
    return [v for k, v in series.items() if k.startswith(name + "[")]


def test_an_error_window_takes_the_previous_windows_figures_off_metrics():
    m = MonitorMetrics()
    good = WindowRow(job="j", idx=0, first_step=0, last_step=9, steps=list(range(10)),
                     slowdown=1.8, waste=1 - 1 / 1.8,
                     scores=[WindowScore(dp=0, pp=0, score=1.0, rank=0),
                             WindowScore(dp=1, pp=0, score=1.8, rank=1)],
                     diagnosis=[WindowFinding(cause="worker_fault", speedup_if_fixed=1.7)])
    m.publish_window(good)
    m.publish_window(WindowRow(job="other", idx=0, first_step=0, last_step=9,
                               steps=list(range(10)), slowdown=1.2, waste=0.1))
    before = _series(m, "j")
    assert _named(before, "stragglers_slowdown") == [1.8]
    assert len(_named(before, "stragglers_worker_score")) == 2
    m.publish_window(WindowRow(job="j", idx=1, first_step=10, last_step=19,
                               steps=list(range(10, 20)), error="analysis stopped"))
    after = _series(m, "j")
    for name in PER_WINDOW:
        assert _named(after, name) == [], name   # (was: window 0's S 1.8 stayed "current")
    assert _named(before, "stragglers_window_failed") == [0.0]
    assert _named(after, "stragglers_window_failed") == [1.0]
    assert _named(after, "stragglers_windows_total") == [2.0]
    assert _named(_series(m, "other"), "stragglers_slowdown") == [1.2]   # others untouched
    # the next window that is analysed brings them back
    m.publish_window(good)
    again = _series(m, "j")
    assert _named(again, "stragglers_slowdown") == [1.8]
    assert _named(again, "stragglers_window_failed") == [0.0]
    assert len(_named(again, "stragglers_worker_score")) == 2
