"""Two ranks claiming one place (dp_rank, stage) in a job without a layout: the engine takes one
worker per place, and such a part failed every window it was in for every rank. The first rank
at a place holds it; another rank's part there is refused alone (409 naming the place), and a
window that holds two anyway (stored before) is analysed without the later rank."""

from __future__ import annotations

import time

import httpx
import pytest

from conftest import eventually
from monitor_jobs import get, parts_of, slow_job
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.model import Trace
from stragglers.trace.runformat import table_bytes

TOKEN = "places-test-token-0123456"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CFG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, rescan_s=3600)


def unlaid_job(steps: int) -> Trace:
    """A dp 2 × pp 2 job whose meta.json has no layout (the ranks' places are their rows')."""
    trace = slow_job(steps=steps)
    del trace.meta.extra["layout"]
    return trace


def place_of(cols) -> tuple[int, int]:
    return int(cols["dp_rank"][0]), int(cols["stage"][0])


def test_a_second_rank_at_a_place_is_refused_alone_and_the_windows_are_analysed(tmp_path):
    trace = unlaid_job(steps=10)
    parts = parts_of(trace, 5)
    first = {rank: cols for rank, part, cols in parts if part == 0}
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict(),
                         headers=AUTH).status_code == 200

            def put(rank, part, cols):
                return c.put(f"/api/jobs/j/ranks/{rank}/parts/{part}",
                             content=table_bytes(cols), headers=AUTH)

            assert put(0, 0, first[0]).status_code == 200
            dp, stage = place_of(first[0])
            there = {**first[1], "dp_rank": first[1]["dp_rank"] * 0 + dp,
                     "stage": first[1]["stage"] * 0 + stage}
            r = put(1, 0, there)
            assert r.status_code == 409, r.text
            assert f"dp_rank {dp}, stage {stage}, the place of rank 0" in r.json()["error"]
            # a rank whose rows sit at two places: refused, named
            spread = dict(first[2])
            spread["stage"] = spread["stage"].copy()
            spread["stage"][0] = 1 - spread["stage"][0]
            r = put(2, 0, spread)
            assert r.status_code == 422 and "more than one place" in r.json()["error"], r.text
            for rank, part, cols in parts:   # the real parts: each stored
                if (rank, part) != (0, 0):
                    assert put(rank, part, cols).status_code == 200
            # rank 1 at rank 0's place again, in a later part: its own place is held now
            moved = {**there, "step": there["step"] + 10}
            r = put(1, 2, moved)
            assert r.status_code == 422 and "earlier parts are at" in r.json()["error"], r.text
            wins = eventually(lambda: len(get(c, "/api/jobs/j")["windows"]) == 2
                              and get(c, "/api/jobs/j")["windows"], what="2 windows")
            assert [w["error"] for w in wins] == [None, None], wins
    finally:
        s.stop()


def test_a_window_holding_two_ranks_at_one_place_is_analysed_without_the_later_one():
    from stragglers.monitor.windows import Window, analyse_window
    trace = unlaid_job(steps=5)
    o = dict(trace.ops)
    at = {int(r): (int(d), int(st)) for r, d, st in zip(o["rank"], o["dp_rank"], o["stage"])}
    low, high = sorted(r for r, p in at.items() if p[0] == 1)   # DP replica 1's two ranks
    sel = o["rank"] == high
    o["stage"] = o["stage"].copy()
    o["stage"][sel] = at[low][1]                      # the higher one at the lower one's place
    window = Window("j", 0, list(range(5)), Trace(o, trace.meta, "monitor:j#0"),
                    missing_ranks=[], closed_at=time.time(), reason="steps")
    row, _ = analyse_window(window)
    assert row.error is None and row.slowdown is not None, row.error
    assert row.missing_ranks == [high]
    assert {s.rank for s in row.scores} == {r for r, p in at.items() if p[0] == 0}


def test_a_restart_knows_the_places_of_ranks_whose_parts_were_all_analysed(tmp_path):
    # the places were learned from parts as they came: after a restart, a rank whose parts were
    # all analysed held no place, and another rank's part there was taken as the first
    trace = unlaid_job(steps=10)
    parts = parts_of(trace, 5)
    first = {rank: cols for rank, part, cols in parts if part == 0}
    later = {rank: cols for rank, part, cols in parts if part == 1}
    for attempt in range(2):
        s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
        try:
            with httpx.Client(base_url=s.url, timeout=60) as c:
                if attempt == 0:
                    assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict(),
                                 headers=AUTH).status_code == 200
                    for rank, cols in first.items():
                        assert c.put(f"/api/jobs/j/ranks/{rank}/parts/0", headers=AUTH,
                                     content=table_bytes(cols)).status_code == 200
                    eventually(lambda: get(c, "/api/jobs/j")["windows"], what="window 0")
                    continue
                dp, stage = place_of(later[0])
                there = {**later[1], "dp_rank": later[1]["dp_rank"] * 0 + dp,
                         "stage": later[1]["stage"] * 0 + stage}
                r = c.put("/api/jobs/j/ranks/1/parts/1", content=table_bytes(there),
                          headers=AUTH)
                # (rank 1's own place is known again too: it moved)
                assert r.status_code == 422 and "earlier parts are at" in r.json()["error"], \
                    r.text
                for rank, cols in later.items():
                    assert c.put(f"/api/jobs/j/ranks/{rank}/parts/1", headers=AUTH,
                                 content=table_bytes(cols)).status_code == 200
        finally:
            s.stop()


@pytest.mark.slow
def test_parts_another_instance_stored_are_place_checked_when_read_back(tmp_path):
    # an instance that does not analyse a job stores its parts unchecked for places (it does
    # not know them); the holder read them back and took their places as they came: rank 1's
    # part at rank 3's place took that place, and every later part of rank 3 was refused 409
    from stragglers.monitor.part_names import fingerprint
    from stragglers.monitor.store import open_store
    trace = unlaid_job(steps=15)
    parts = parts_of(trace, 5)
    by = {(rank, part): cols for rank, part, cols in parts}
    at = {rank: place_of(cols) for (rank, part), cols in by.items() if part == 0}
    rank_at = {place: rank for rank, place in at.items()}
    one, three = 1, rank_at[(1 - at[1][0], 1 - at[1][1])]   # a rank, the one at its far place
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict(),
                         headers=AUTH).status_code == 200
            for rank in at:
                assert c.put(f"/api/jobs/j/ranks/{rank}/parts/0", headers=AUTH,
                             content=table_bytes(by[(rank, 0)])).status_code == 200
            eventually(lambda: get(c, "/api/jobs/j")["windows"], what="window 0")
    finally:
        s.stop()
    # what another instance would have stored meanwhile: rank `one`'s part 1 with its rows at
    # rank `three`'s place, and rank `three`'s part 2 with rows at two places
    cols = by[(one, 1)]
    there = {**cols, "dp_rank": cols["dp_rank"] * 0 + at[three][0],
             "stage": cols["stage"] * 0 + at[three][1]}
    spread = dict(by[(three, 2)])
    spread["stage"] = spread["stage"].copy()
    spread["stage"][0] = 1 - spread["stage"][0]
    store = open_store(tmp_path / "mon.db")
    try:
        for rank, part, rows in ((one, 1, there), (three, 2, spread)):
            body = table_bytes(rows)
            (tmp_path / "mon.db.uploads" / "j" /
             f"rank-{rank:05d}.part-{part:06d}.parquet").write_bytes(body)
            store.add_parts([("j", rank, part, len(rows["step"]), int(rows["step"].min()),
                              int(rows["step"].max()), len(body), "http",
                              fingerprint(body))])
    finally:
        store.close()
    # (a rank without rows in a window is waited for gap_wait_s after its last part)
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN,
                      config=CFG.replace(gap_wait_s=1.0)).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            for rank, part in [(r, 1) for r in at if r != one] + \
                    [(r, 2) for r in at if r != three]:
                r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{part}", headers=AUTH,
                          content=table_bytes(by[(rank, part)]))
                assert r.status_code == 200, (rank, part, r.text)
            wins = eventually(lambda: len(get(c, "/api/jobs/j")["windows"]) == 3
                              and get(c, "/api/jobs/j")["windows"], what="3 windows")
            assert [w["error"] for w in wins] == [None] * 3, wins
            missing = [get(c, f"/api/jobs/j/windows/{i}")["missing_ranks"] for i in range(3)]
            assert missing == [[], [one], [three]], missing
            set_aside = sorted(r["source"].rsplit("/", 1)[-1] for r in s.monitor.recent_rejects
                               if "set aside when read back" in r["problem"])
            assert set_aside == [f"rank-{one:05d}.part-000001.parquet",
                                 f"rank-{three:05d}.part-000002.parquet"], \
                list(s.monitor.recent_rejects)
            assert c.get("/health").status_code == 200
    finally:
        s.stop()
