"""Test helpers: synthetic jobs written as a recorder would (parts per rank), servers, polling."""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections.abc import Collection
from pathlib import Path

import numpy as np

from stragglers.monitor.windows import Window
from stragglers.trace.model import Trace
from stragglers.trace.runformat import write_meta, write_rank
from stragglers.trace.synth import generate


def slow_job(steps: int = 30, dp: int = 2, pp: int = 2, slow=(1, 1, 3.0), seed: int = 0) -> Trace:
    """A synthetic dp × pp job with one slow worker, with a recorder-style layout in meta."""
    trace = generate(dp=dp, pp=pp, microbatches=4, steps=steps, seed=seed, slow_worker=slow)
    o = trace.ops
    keys = np.unique(np.stack([o["rank"], o["dp_rank"], o["stage"]], axis=1), axis=0)
    trace.meta.extra["layout"] = [{"rank": int(r), "dp_rank": int(d), "stage": int(s),
                                   "host": f"host{int(r) % 2}"} for r, d, s in keys]
    return trace


def rank_of(trace: Trace, dp: int, pp: int) -> int:
    """The global rank of worker (dp, pp) in the trace's layout."""
    return next(e["rank"] for e in trace.meta.extra["layout"]
                if e["dp_rank"] == dp and e["stage"] == pp)


def parts_of(trace: Trace, steps_per_part: int) -> list[tuple[int, int, dict]]:
    """(rank, part number, columns) of every part, in the order a recorder would flush them."""
    o, out = trace.ops, []
    steps = np.unique(o["step"])
    chunks = [steps[i:i + steps_per_part] for i in range(0, len(steps), steps_per_part)]
    for part, chunk in enumerate(chunks):
        for rank in np.unique(o["rank"]):
            sel = (o["rank"] == rank) & np.isin(o["step"], chunk)
            out.append((int(rank), part, {k: v[sel] for k, v in o.items()}))
    return out


def closed_windows(n: int, steps_per_window: int = 5) -> list:
    """n closed windows of a job with one slow worker (a JobTracker fed every part)."""
    from stragglers.monitor.windows import JobTracker

    trace = slow_job(steps=n * steps_per_window, slow=(1, 1, 3.0))
    tr = JobTracker("job-a", trace.meta, steps_per_window, 30.0)
    for rank, part, cols in parts_of(trace, steps_per_part=steps_per_window):
        tr.add_part(rank, part, int(cols["step"].max()), cols, 0.0)
    out = tr.close_ready(0.0)
    assert len(out) == n
    return out


class HeldWindow(Window):
    """A window whose rows are read once `release` is set (an engine busy past any limit)."""

    release: threading.Event

    def load(self):
        self.release.wait(60)
        return super().load()


def held(window: Window) -> HeldWindow:
    """`window` as a HeldWindow, its `release` not set yet."""
    out = HeldWindow(**{k: getattr(window, k) for k in window.__dataclass_fields__})
    out.release = threading.Event()
    return out


def write_parts(directory: Path, parts) -> None:
    """Write parts as the recorder does (atomic rename)."""
    for rank, part, cols in parts:
        write_rank(directory, rank, cols, part=part)


def start_run(directory: Path, trace: Trace) -> None:
    """meta.json as the recorder's start() writes it."""
    write_meta(directory, trace.meta)


def write_whole_run(directory: Path, trace: Trace) -> None:
    """A run written as whole-rank files (rank-RRRRR.parquet, no parts), its meta.json first."""
    start_run(directory, trace)
    o = trace.ops
    for rank in np.unique(o["rank"]):
        write_rank(directory, int(rank), {k: v[o["rank"] == rank] for k, v in o.items()})


def get(client, url: str, **kw):
    """GET returning JSON, asserting 200."""
    r = client.get(url, **kw)
    assert r.status_code == 200, (url, r.status_code, r.text)
    return r.json()


def dump(obj) -> str:
    return json.dumps(obj, indent=1, default=str)[:4000]


@contextlib.contextmanager
def serving_job(db: Path, trace: Trace, token: str, config):
    """A monitor on loopback (store `db`) with job j's meta.json (`trace`'s) put: a client
    holding `token`; the server stopped after."""
    import httpx

    from stragglers.monitor.server import MonitorServer

    s = MonitorServer(db, port=0, token=token, config=config).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60,
                          headers={"Authorization": f"Bearer {token}"}) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict()).status_code == 200
            yield c
    finally:
        s.stop()


def at_rank(rank: int, fn):
    """A part change applying `fn(cols)` to `rank`'s parts only."""
    return lambda r, cols: fn(cols) if r == rank else cols


def dropping(rank: int, optype: str):
    """A part change dropping every `optype` row of `rank`'s parts."""
    from stragglers.trace.model import OPTYPE_CODES

    def drop(cols):
        keep = cols["optype"] != OPTYPE_CODES[optype]
        return {k: v[keep] for k, v in cols.items()}
    return at_rank(rank, drop)


def windows_of(tmp_path: Path, trace: Trace, change, token: str, config, windows: int = 4,
               statuses=(200, 422), names: str = ""):
    """Job j of `trace` served (store under tmp_path), every part (5 steps) PUT with
    `change(rank, cols)` applied; its GET (history 10) once `windows` windows closed, or None
    where a part was refused (422, its error naming `names`)."""
    from conftest import eventually
    from stragglers.trace.runformat import table_bytes

    with serving_job(tmp_path / "mon.db", trace, token, config) as c:
        refused = 0
        for rank, n, cols in parts_of(trace, 5):
            r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}",
                      content=table_bytes(change(rank, cols)))
            assert r.status_code in statuses, r.text
            if r.status_code == 422:
                assert names in r.json()["error"], r.text
                refused += 1
        if refused:
            return None
        eventually(lambda: get(c, "/api/jobs/j?history=10")["windows_total"] >= windows,
                   what=f"windows 0-{windows - 1}")
        return get(c, "/api/jobs/j?history=10")


def straggler_seen(job) -> None:
    """Every window of `job` (a windows_of answer; None: refused, as allowed) analysed, each
    reading the straggler's slowdown (S > 1.15)."""
    if job is None:
        return
    windows = job["windows"]
    assert [w["error"] for w in windows if w["error"]] == [], windows[0]["error"]
    assert min(w["slowdown"] for w in windows) > 1.15, windows


def healthy(job, analysed_only: bool = False) -> None:
    """Every window of `job` (a windows_of answer; None: refused, as allowed) reads a healthy
    job (S < 1.1; `analysed_only`: of the windows with a slowdown) and no alert fired."""
    if job is None:
        return
    slowdowns = [round(w["slowdown"], 3) for w in job["windows"]
                 if not analysed_only or w["slowdown"]]
    assert max(slowdowns) < 1.1, slowdowns
    assert not [a["rule"] for a in job["alerts"]], job["alerts"]


def alerts_beyond_left_out(job, ranks: Collection[int]) -> list:
    """`job`'s alerts other than the windows' account of `ranks` left out (round 13 #8: a
    rank the windows leave out is named, with the replica peers dropped with it, and
    `ranks_left_out` holds; the cause 'partial' it leaves is a new cause): what blames or
    flags anyone else (a ranks_left_out naming a rank outside `ranks` included)."""
    def named(text: str) -> set[int]:   # the ranks each "rank(s) 1, 3" of a note lists
        return {int(r) for m in re.finditer(r"rank\(s\) ([\d, ]*)", text)
                for r in re.findall(r"\d+", m.group(1))}
    return [(a["rule"], a["labels"].get("rank")) for a in job["alerts"]
            if not (a["rule"] == "ranks_left_out"
                    and named(a["annotations"]["description"]) <= set(ranks))
            and not (a["rule"] == "new_cause" and a["labels"].get("cause") == "partial")]
