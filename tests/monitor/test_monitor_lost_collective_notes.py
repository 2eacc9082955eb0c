"""A window whose rank lost a collective's rows is analysed with every rank, the collective
rebuilt there from its group's ends, and its notes say so (red team round 12: the rank's DP
replica was left out, the 3x straggler in it with it, S 1.00)."""

from __future__ import annotations

from conftest import eventually
from monitor_jobs import dropping, get, parts_of, serving_job, slow_job
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.runformat import table_bytes
from stragglers.whatif.grid import OPS_LEFT_OUT

TOKEN = "lost-collective-token-0123456789ab"


def test_a_window_names_the_collective_rebuilt_and_scores_every_rank(tmp_path):
    trace = slow_job(steps=5, slow=(0, 0, 3.0))
    change = dropping(2, "grads-reduce-scatter")
    config = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05)
    with serving_job(tmp_path / "mon.db", trace, TOKEN, config) as c:
        for rank, n, cols in parts_of(trace, 5):
            r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}",
                      content=table_bytes(change(rank, cols)))
            assert r.status_code == 200, r.text
        eventually(lambda: get(c, "/api/jobs/j?history=10")["windows_total"] >= 1,
                   what="window 0")
        w = get(c, "/api/jobs/j/windows/0")
    assert w["error"] is None and w["slowdown"] > 1.15, (w["error"], w["slowdown"])
    assert w["missing_ranks"] == [] and sorted(s["rank"] for s in w["scores"]) == [0, 1, 2, 3]
    said = [n for n in w["notes"] if n.startswith(OPS_LEFT_OUT)]
    assert len(said) == 1 and "Rebuilt at the workers that lack them" in said[0] and \
        "grads-reduce-scatter #0 on stage 1 (run by DP rank(s) 1, not by 0)" in said[0], w["notes"]
