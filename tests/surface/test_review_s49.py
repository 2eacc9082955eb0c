"""Review of session 49's changes (0739cd0..89a1fcb, reviewer hV50): one test per defect
confirmed by running it, each strict-xfail until fixed (/tmp/h/hV50-review.md)."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest

from stragglers.monitor.replaced import was_replaced, with_replaced
from stragglers.trace.model import OPTYPE_CODES, Trace
from stragglers.trace.synth import generate
from stragglers.whatif import analyze


def _job(dp: int, pp: int = 2) -> Trace:
    """A synthetic dp x pp job (rank 0 3x slower), as tests/whatif/test_whatif_odd_op_sets."""
    return generate(dp=dp, pp=pp, microbatches=4, steps=5, seed=0, slow_worker=(0, 0, 3.0))


def _with_extra(trace: Trace, rank: int, optype: str) -> Trace:
    """`rank` runs one `optype` (seq 0, 0.1 ms, after its last op) each step; no peer does."""
    o = trace.ops
    rows = np.flatnonzero(o["rank"] == rank)
    rows = rows[np.lexsort((o["start_ts"][rows], o["step"][rows]))]
    last = rows[np.r_[o["step"][rows][1:] != o["step"][rows][:-1], True]]
    add = {k: v[last].copy() for k, v in o.items()}
    add["optype"][:] = OPTYPE_CODES[optype]
    add["seq_id"][:] = 0
    add["mb_id"][:] = -1
    add["gmc"][:] = -1
    add["start_ts"] = add["start_ts"] + add["duration"]
    add["duration"][:] = 1e-4
    return Trace({k: np.concatenate([o[k], add[k]]) for k in o}, trace.meta, trace.source)


def _without(trace: Trace, rank: int, optype: str) -> Trace:
    o = trace.ops
    return trace.select(~((o["rank"] == rank) & (o["optype"] == OPTYPE_CODES[optype])))


def test_left_out_workers_are_named_with_their_own_stages_ops():
    """Found: dp 3 x pp 2; rank 2 (dp 2, pp 0) ran an extra barrier, rank 5 (dp 2, pp 1) lost
    its grads-reduce-scatter: BOTH LeftOut entries read missing ['grads-reduce-scatter #0'],
    extra ['barrier #0']: leave_out_odd took judged.lacks[:, a] / judged.extra[:, a] over every
    node, not those of stage p. (Since s50-hC lost or extra collectives are rebuilt or left
    out at every worker, so the replica path is shown with transfers: rank 2 lost its
    forward-sends, rank 5 its backward-sends; at 680732f each read both.) Each worker is named
    with its own stage's ops only."""
    trace = _without(_without(_job(3), 2, "forward-send"), 5, "backward-send")
    r = analyze(trace, steps="all")
    odd = {(w.dp, w.pp, w.rank): (w.missing, w.extra) for w in r.left_out
           if w.reason == "ops_differ"}
    assert set(odd) == {(2, 0, 2), (2, 1, 5)}   # (both judged odd: right)
    assert odd[(2, 0, 2)] == ([f"forward-send #{i}" for i in range(4)], [])
    assert odd[(2, 1, 5)] == ([f"backward-send #{i}" for i in range(4)], [])


def test_replaced_runs_filter_does_not_refuse_new_runs_of_a_long_lived_job_name():
    """Now: after 3,000 runs of one job name replaced (an hourly job for four months), 525 of
    4,000 never-seen run tokens read as replaced (13%; 2.3% after 2,000, 0.075% after 1,000):
    ingest_http.check_run answers such a new run's early parts (sent before rank 0's
    meta.json registers it) 409 superseded_run, and its uploader stops for good: an honest
    run's ranks lose their data. Should: a new run is never (or with a bounded chance that
    does not grow with the name's history, e.g. < 1e-3) taken for a replaced one."""
    row = None
    for i in range(3000):
        row = with_replaced(row, f"run-{i:05d}")
    fresh = sum(was_replaced(row, f"fresh-{j}") for j in range(4000))
    assert fresh <= 4, f"{fresh} of 4000 new run tokens read as replaced"


def test_window_notes_keep_every_moved_rank_when_a_worker_is_also_left_out():
    """Now: dp 40 x pp 1, ranks 6-39 each on its own clock (+6.5 .. +14.75 s), rank 1 with an
    extra barrier a step. clock_notes gives 32 lines (31 ranks, then '3 more ranks' clocks
    were moved ... (ranks 37, 38, 39)'); analyse_window then makes notes [left-out note] +
    those lines[:31]: the summary goes, and ranks 37, 38, 39 (moved by 14.25-14.75 s) are
    named nowhere in the window. Should: every moved rank named or summed up (the summary
    recomputed over what is cut, or the left-out note taking one of the rank lines' places)."""
    import re
    import time

    from stragglers.monitor.windows import MAX_NOTES, Window, analyse_window

    t = generate(dp=40, pp=1, microbatches=2, steps=4, seed=0, slow_worker=(0, 0, 2.0))
    o = {k: v.copy() for k, v in t.ops.items()}
    moved = set(range(6, 40))
    for r in moved:
        o["start_ts"][o["rank"] == r] += 5.0 + 0.25 * r
    trace = _with_extra(Trace(o, t.meta, t.source), 1, "barrier")
    row, _ = analyse_window(Window("j", 0, list(range(4)), trace, missing_ranks=[],
                                   closed_at=time.time()))
    # (rank 1's extra barrier: since s50-hC left out at every worker, not rank 1's replica;
    # either way the engine's note comes first and the clocks' lines share one budget)
    assert row.error is None, row.error
    assert row.notes[0].startswith(("ranks left out of the analysis", "ops some workers lack"))
    assert len(row.notes) <= MAX_NOTES, len(row.notes)
    named: set[int] = set()
    for n in row.notes:
        m = re.match(r"rank (\d+): its clock", n)
        if m:
            named.add(int(m.group(1)))
        m = re.search(r"more ranks' clocks were moved the same way \(ranks ([\d, ]+)", n)
        if m:
            named |= {int(x) for x in m.group(1).split(",")}
    assert named == moved, f"moved ranks named nowhere: {sorted(moved - named)}"


def test_a_start_refused_for_a_served_file_leaves_its_schema_as_it_was(tmp_path):
    """Now: a schema-6 file (as 0739cd0 wrote it: schema 7 less fence_folds, user_version 6)
    held by a running service (its flock, adapt/claim.py). EmbeddedServer(db).start() is
    refused 'another shard service serves this file (pid ...)', but open_store ran first and
    upgraded it: user_version 7. The running 0739cd0 service, once restarted, is refused
    'shard database of schema version 7; this version reads 6 (start a new file)' (run with
    0739cd0's src: /tmp/h/hV50-review.md) -- an operator told to discard the file that holds
    every data set. Should: claim first (serve and EmbeddedServer.start), then open/upgrade:
    a refused start writes nothing, user_version stays 6."""
    from stragglers.adapt.claim import claim
    from stragglers.adapt.dataset import DatasetConfig
    from stragglers.adapt.service import EmbeddedServer
    from stragglers.adapt.shards import ShardStore
    from stragglers.errors import InputError

    db = tmp_path / "shards.db"
    s = ShardStore(db)
    s.create_dataset(DatasetConfig("d", 100, 10))
    s.join("d", "w")
    s.close()
    c = sqlite3.connect(db)
    c.executescript("DROP TABLE fence_folds; PRAGMA user_version=6;")
    c.close()
    held = claim(db)   # (the service serving it)
    try:
        with pytest.raises(InputError, match="another shard service serves this file"):
            EmbeddedServer(db).start()
    finally:
        held.close()
    c = sqlite3.connect(db)
    try:
        assert c.execute("PRAGMA user_version").fetchone()[0] == 6
        assert c.execute("SELECT name FROM sqlite_master WHERE name='fence_folds'"
                         ).fetchone() is None
    finally:
        c.close()


def test_a_run_linked_from_deeper_in_its_root_is_watched_live(tmp_path):
    """Now: runs/latest -> runs/archive/2026-12-07/run (canonical() accepts it: its real path
    lies in the watched root). The watch child (c1310a4: each root and each non-link folder
    in it, not recursively) reports a part written there never: the batch that reports a
    part written after it in runs/other holds only that one. 0739cd0's recursive watch
    reported both. Should: the real folders of the runs the ingest follows watched too (the
    parent passes them, or the child adds the real path of each accepted link inside a
    root), so a followed run's parts arrive live."""
    import json
    import os
    import queue
    import subprocess
    import sys
    import threading

    root = tmp_path / "runs"
    deep = root / "archive" / "2026-12-07" / "run"
    deep.mkdir(parents=True)
    (root / "latest").symlink_to(deep)
    (root / "other").mkdir()
    # (the child imports this package as this process does, as the monitor starts it)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    child = subprocess.Popen([sys.executable, "-m", "stragglers.monitor.watch_child",
                              str(root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(json.loads(x)) for x in child.stdout],
                     daemon=True).start()
    try:
        lines.get(timeout=60)   # (its first batch: the watch is built)
        (deep / "rank0.part0.parquet").write_bytes(b"x")
        later = root / "other" / "rank0.part0.parquet"
        later.write_bytes(b"x")   # (its event comes after the first one's, if that is watched)
        seen: set[str] = set()
        while str(later) not in seen:
            _, changes = lines.get(timeout=60)   # (a bound against a hang)
            seen |= {name for _, name in changes or []}
        assert str(deep / "rank0.part0.parquet") in seen, sorted(seen)
    finally:
        child.stdin.close()
        child.wait(30)


def test_a_lost_last_stage_collective_does_not_blame_the_rank_that_ran_it():
    """Now: dp 2 x pp 2, rank 0 (dp 0, pp 0) a real 3x straggler (whole: S 1.435,
    worker_fault); the last stage runs a DP all-reduce each step that no other stage runs
    (Megatron averages the loss over the DP group at the last stage only), and rank 3
    (dp 1, pp 1)'s profiler lost that row. odd_workers settles the tie by "a collective no
    other stage ran is an extra": honest rank 2 is left out for 'ran all-reduce #7', its
    replica with it -- rank 0, the straggler -- and the rest reads S 1.003, straggling None.
    One lost row on one side or one extra on the other cannot be told apart here (as the
    one-stage case, which names both: 'each may be'). Should: the tie judges nobody (the
    error names both workers), never the rank that ran the op alone."""
    from stragglers.errors import InputError

    t = _job(2)
    last = [int(r) for r in np.unique(t.ops["rank"][t.ops["stage"] == 1])]   # ranks 2, 3
    for r in last:
        t = _with_extra(t, r, "all-reduce")
    o = t.ops
    lost = (o["rank"] == 3) & (o["optype"] == OPTYPE_CODES["all-reduce"])
    try:
        r = analyze(t.select(~lost), steps="all")
    except InputError as exc:   # (the tie judging nobody: both named)
        assert "(dp 0, pp 1)" in str(exc) and "(dp 1, pp 1)" in str(exc), str(exc)
        return
    blamed = {w.rank for w in r.left_out if w.reason == "ops_differ"}
    assert blamed != {2}, (r.warnings[0], r.slowdown)
