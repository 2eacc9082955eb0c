"""The Grafana dashboard asks only for metrics the monitor really exposes (the §5 contract)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from monitor_jobs import parts_of, slow_job
from stragglers.monitor.metrics import MonitorMetrics
from stragglers.monitor.windows import JobTracker, analyse_window

DASHBOARD = Path(__file__).resolve().parents[2] / "src/stragglers/monitor/grafana/" \
    "stragglers-dashboard.json"


def test_every_metric_in_the_dashboard_is_exposed():
    trace = slow_job(steps=5)
    tr = JobTracker("j", trace.meta, 5, 30.0)
    for rank, part, cols in parts_of(trace, 5):
        tr.add_part(rank, part, int(cols["step"].max()), cols, 0.0)
    metrics = MonitorMetrics()
    row, _ = analyse_window(tr.close_ready(0.0)[0])
    metrics.publish_window(row)
    metrics.set_state("j", "running")
    metrics.open_alerts.labels("j").set(0)
    metrics.upload_dropped.labels("j", "0").set(0)
    metrics.rejected.labels("bad_part").inc()
    metrics.publish_latency.observe(0.1)
    exposed = set(re.findall(r"^(stragglers_\w+?)(?:\{| )", metrics.render().decode(), re.M))
    dash = json.loads(DASHBOARD.read_text())
    wanted = {name for p in dash["panels"] for t in p["targets"]
              for name in re.findall(r"stragglers_\w+", t["expr"])}
    assert wanted and wanted <= exposed, wanted - exposed
    for name in ("stragglers_slowdown", "stragglers_waste", "stragglers_worker_score",
                 "stragglers_diagnosis", "stragglers_windows_total",
                 "stragglers_parts_ingested_total", "stragglers_records_ingested_total",
                 "stragglers_ingest_rejected_total", "stragglers_window_analysis_seconds_bucket"):
        assert name in exposed, name
