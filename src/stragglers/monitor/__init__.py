"""stragglers.monitor: the live straggler monitor (SMon, docs/monitor.md).

A service that follows running jobs (watched run directories, or parts uploaded by the
recorder), runs the what-if analysis on every closed window of steps, keeps the history in
SQLite, raises alerts in Alertmanager's webhook format, exposes Prometheus metrics and serves a
live dashboard. Start it with `stragglers monitor serve`. Nothing here needs torch.
"""

from __future__ import annotations

from stragglers.lazy import lazy_exports

_LAZY = {
    "MonitorServer": "stragglers.monitor.server",
    "Monitor": "stragglers.monitor.service",
    "MonitorConfig": "stragglers.monitor.settings",
    "Store": "stragglers.monitor.store",
    "JobTracker": "stragglers.monitor.windows",
    "analyse_window": "stragglers.monitor.windows",
    "parse_rules": "stragglers.monitor.alerts",
    "create_app": "stragglers.monitor.app",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY)
