"""Red team round nine (issue 34): both services against what the last two sessions added
(control_idle_s, unused_dataset_s, run tokens, anonymous paces, reply caps, bounded reads) and
against races and restarts between the steps of one operation.

Each test is one defect class, marked xfail(strict=True) until its fix lands (then the mark goes):
a pass before the fix fails the suite, so each flips exactly when its defect is gone. Real
servers on loopback (the shard service on a thread of this process, as tests/adapt's hostile
tests start it; the monitor as a process, as an operator starts it).
"""

from __future__ import annotations

import sys
import time

import httpx
import pytest

from conftest import REPO, eventually
from stragglers.adapt.service import EmbeddedServer, ServiceConfig
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.runformat import table_bytes

sys.path.insert(0, str(REPO / "tests" / "monitor"))
from monitor_jobs import get, parts_of, slow_job  # noqa: E402

TOKEN = "hostile-round9-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MONITOR = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05)


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {name}-round9-token-0123456789"}


CONTROL = {"policy": "bsp", "world_size": 1, "global_batch": 8}


def test_a_refused_controller_creation_takes_no_idle_controller_with_it(tmp_path):
    """Two jobs' controllers, idle past control_idle_s (an agent paused by a long checkpoint, a
    job between incarnations). A third token asks for a controller that no room can fit (its
    records alone are past max_control_records): refused 429 — and nothing else may change. The
    idle controllers were dropped first to make room (_make_room), then the creation refused
    (_check_records): each of their owners' next report is 404, their step history gone."""
    config = ServiceConfig(max_jobs=2, control_idle_s=1.0, max_control_records=2000)
    server = EmbeddedServer(tmp_path / "s.db", config=config).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            for job in ("a", "b"):
                r = c.post(f"/jobs/{job}/control/config", json=CONTROL, headers=bearer(job))
                assert r.status_code == 200, r.text
            time.sleep(1.1)   # (control_idle_s, its least setting: both are idle now)
            r = c.post("/jobs/c/control/config", headers=bearer("c"),
                       json={**CONTROL, "world_size": 1000, "global_batch": 1000})
            assert r.status_code == 429, r.text
            for job in ("a", "b"):
                r = c.get(f"/jobs/{job}/control/state", headers=bearer(job))
                assert r.status_code == 200, f"job {job}'s controller: {r.status_code} {r.text}"
    finally:
        server.stop()


def test_one_op_cannot_poison_a_window_from_the_last_step_of_its_part(tmp_path):
    """A job uploaded one step a part (a recorder flushing every step, or a hostile one). Rank
    3's part of step 2 has one op of 3,000 s (under MAX_OP_SECONDS) although its step 3, in the
    next part, starts a fraction of a second after step 2 did: the op cannot be what happened.
    check_op_spans compares an op's end only with the next step *in the same part*, so at a
    part's last step any op up to an hour passes: window 0's slowdown was 1,863 and `severe`
    and `new_cause` fired. Refused (422, the part or the one that contradicts it), or the
    window not poisoned. (Fixed at 2c7abd7: a window judges its ops' ends over all its
    parts.)"""
    trace = slow_job(steps=6, slow=None)
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=MONITOR).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60, headers=AUTH) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict()).status_code == 200
            refused = []
            for rank, n, cols in parts_of(trace, 1):
                if rank == 3 and n == 2:
                    cols = {k: v.copy() for k, v in cols.items()}
                    cols["duration"][0] = 3000.0
                r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols))
                assert r.status_code in (200, 422), r.text
                if r.status_code == 422:
                    refused.append(r.json()["error"])
            if refused:
                return
            eventually(lambda: get(c, "/api/jobs/j?history=10")["windows_total"] >= 1,
                       what="window 0")
            job = get(c, "/api/jobs/j?history=10")
            assert job["windows"][0]["slowdown"] < 1.5, job["windows"][0]["slowdown"]
            assert not [a["rule"] for a in job["alerts"]], job["alerts"]
    finally:
        s.stop()


def test_a_rescan_period_the_clock_cannot_wait_is_refused_or_kept(tmp_path):
    """rescan_s: 1e19 in the monitor's settings (an operator's 'never': its other periods take
    1e300 and work). Accepted, the watcher's rescan thread waits `Event.wait(1e19)` after the
    first scan and dies ('OverflowError: timestamp out of range for platform time_t', a
    traceback on stderr): from then on no watched folder is ever rescanned (runs on a file
    system without inotify events, NFS, are never found). Refused in one line naming
    rescan_s, or the thread waits on (the period bounded where the clock can wait)."""
    import threading

    from stragglers.errors import InputError

    try:
        config = MonitorConfig.from_mapping({**MONITOR.to_dict(), "rescan_s": 1e19}, "settings")
    except InputError as exc:
        assert "rescan_s" in str(exc), exc
        return
    (tmp_path / "watch").mkdir()
    s = MonitorServer(tmp_path / "mon.db", watch=[tmp_path / "watch"], port=0, token=TOKEN,
                      config=config).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            eventually(lambda: not get(c, "/health")["scanning"], what="the first scan")
        rescan = [t for t in threading.enumerate() if t.name == "stragglers-files-rescan"]
        assert rescan, "no rescan thread"
        rescan[0].join(timeout=1.0)   # (dead at once before the fix; waits on after it)
        assert rescan[0].is_alive(), "the rescan thread ended after the first scan"
    finally:
        s.stop()


def test_a_data_set_being_restored_by_its_owner_is_not_taken_as_unused(tmp_path):
    """A data set created more than unused_dataset_s ago whose job never joined (it crashed
    first), its owner now restoring a snapshot with progress into it: the service writes a
    restore in paced steps (restore_begin, restore_rows per chunk, restore_finish, each its own
    transaction on the commit thread), and a creation by another token at max_datasets
    between two steps reclaims it as 'unused' (no worker row, every stored shard TODO: the
    restore's rows are not its rows yet). The restore then ends 403 'restoring creates data
    set: that needs the service token', and so does every retry of its owner: its progress
    cannot be put back. The steps are driven here as the service's paced writer drives them,
    on the store with a clock of its own (the interleaving is the case, not its timing)."""
    from stragglers.adapt.dataset import DatasetConfig, validate_snapshot
    from stragglers.adapt.restores import prepare_restore
    from stragglers.adapt.service import token_digest
    from stragglers.adapt.shards import ShardStore

    now = [1000.0]
    store = ShardStore(tmp_path / "s.db", clock=lambda: now[0], max_datasets=2,
                       unused_dataset_s=60)
    mine, theirs = token_digest("owner-round9-token-0123456789"), \
        token_digest("other-round9-token-0123456789")
    try:
        store.create_dataset(DatasetConfig("d", 64, 4), mine)
        store.create_dataset(DatasetConfig("x", 64, 4), theirs)
        snap = store.snapshot("d")
        for row in snap["shards"][:8]:   # (the job's progress: 8 shards done)
            row[2], row[3] = "DONE", 4
        now[0] += 61
        prepared = prepare_restore(validate_snapshot(snap))
        key = store.restore_begin(prepared, mine, may_create=False)
        try:
            store.create_dataset(DatasetConfig("e", 64, 4), theirs)
        except Exception:   # noqa: BLE001 - refused (429) is a fix too
            pass
        for i in range(len(prepared.chunks)):
            store.restore_rows(key, prepared.chunk(i))
        store.restore_finish(prepared, key, mine, may_create=False)
        assert store.status("d").epochs["0"]["DONE"] == 8
    finally:
        store.close()


def test_a_watched_run_named_with_bytes_that_are_not_utf8_is_taken_or_refused_cleanly(tmp_path):
    """A watched folder holding a good run and a run folder named b'run-\\xff' (a name copied
    from another system, a Latin-1 tar): the run is taken under a safe job name
    (_job_name's ASCII fallback, as for 'é') or refused naming why — not 'UnicodeEncodeError:
    surrogates not allowed' (hashlib of str(run).encode() in _job_name), refused again at every
    rescan. And its refusal, listed by /api/stats, must not make /api/stats a 500 for everyone
    (the JSON reply cannot encode the path's surrogate escape)."""
    import os

    from monitor_jobs import start_run, write_parts

    trace = slow_job(steps=6, slow=None)
    watch = tmp_path / "watch"
    watch.mkdir()
    for name in ("good", "staging"):
        start_run(watch / name, trace)
        write_parts(watch / name, parts_of(trace, 6))
    os.rename(watch / "staging", watch / os.fsdecode(b"run-\xff"))
    s = MonitorServer(tmp_path / "mon.db", watch=[watch], port=0, token=TOKEN,
                      config=MONITOR).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            eventually(lambda: not get(c, "/health")["scanning"], what="the first scan")
            r = c.get("/api/stats")
            assert r.status_code == 200, r.text
            rejects = " ".join(str(x) for x in r.json()["rejects"])
            assert "Error:" not in rejects, rejects[:500]
    finally:
        s.stop()


def test_a_monitor_in_a_folder_not_named_in_utf8_refuses_to_start_or_takes_jobs(tmp_path):
    """A monitor whose --db lies in a folder named b'd\\xff' (the shard service runs there:
    create, lease, restore and delete all work): it starts, says where it listens, and then
    answers every PUT /api/jobs/{job}/meta '500 internal error (UnicodeEncodeError)' — a
    service that can never take a job (the uploads' folder path is put in a row or hashed as
    str). Refused at the start naming the folder (InputError, one line from the CLI), or jobs
    taken."""
    import os

    from stragglers.errors import StragglersError

    folder = tmp_path / os.fsdecode(b"d\xff")
    folder.mkdir()
    try:
        s = MonitorServer(folder / "mon.db", port=0, token=TOKEN, config=MONITOR).start()
    except StragglersError as exc:
        assert "d\\xff" in str(exc) or "UTF-8" in str(exc), exc
        return
    try:
        trace = slow_job(steps=6, slow=None)
        r = httpx.put(f"{s.url}/api/jobs/j/meta", json=trace.meta.to_dict(), headers=AUTH,
                      timeout=60)
        assert r.status_code == 200, r.text
    finally:
        s.stop()


def test_workers_that_left_give_their_places_of_max_workers_back(tmp_path):
    """An elastic job whose workers get new names at each start (pods named by the scheduler,
    hostnames): each leaves with `release(failure=False)`, holding nothing. Their names keep
    their places of max_workers_per_dataset for good: after 1,024 such names (2 here) every new
    worker's join is 429 'join with a name used before' and the job cannot grow again, as
    controllers and data sets held their places before control_idle_s / DELETE. A name that
    released and holds no shard (its remembered replies are what the place bounds) gives its
    place to a new one."""
    config = ServiceConfig(max_workers_per_dataset=2)
    server = EmbeddedServer(tmp_path / "s.db", config=config).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60, headers=bearer("owner")) as c:
            assert c.post("/datasets", json={"name": "d", "num_samples": 64,
                                             "shard_size": 4}).status_code == 200
            for w in ("pod-a", "pod-b"):
                fence = c.post("/datasets/d/join", json={"worker": w}).json()["fence"]
                lease = c.post("/datasets/d/lease", json={"worker": w, "fence": fence}).json()
                shard = lease["leases"][0]
                assert c.post("/datasets/d/ack", json={
                    "worker": w, "fence": fence, "epoch": shard["epoch"],
                    "shard": shard["shard"], "consumed": 4}).status_code == 200
                r = c.post("/datasets/d/release", json={"worker": w, "fence": fence,
                                                        "failure": False})
                assert r.status_code == 200 and r.json()["released"] == [], r.text
            r = c.post("/datasets/d/join", json={"worker": "pod-c"})
            assert r.status_code == 200, r.text
    finally:
        server.stop()


def test_a_job_set_aside_while_serving_gives_its_place_of_max_jobs_back(tmp_path):
    """max_jobs 1: job a's stored row is damaged while the monitor serves (a bad disk sector,
    an operator's hand edit); its next upload is answered 409 'set aside', as designed. Its
    place of max_jobs stays taken ('quarantined' counts as a live job): every new job's
    meta.json is 409 'the monitor tracks 1 jobs not finished already' — until the monitor is
    restarted, when the set-aside job no longer counts (c is then 200). Set aside is not
    running: the place is given back at once, as at a restart."""
    import sqlite3

    trace = slow_job(steps=6, slow=None)
    parts = parts_of(trace, 3)
    config = MonitorConfig.from_mapping({**MONITOR.to_dict(), "max_jobs": 1}, "settings")
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=config).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60, headers=AUTH) as c:
            assert c.put("/api/jobs/a/meta", json=trace.meta.to_dict()).status_code == 200
            for rank, n, cols in parts[:4]:
                assert c.put(f"/api/jobs/a/ranks/{rank}/parts/{n}",
                             content=table_bytes(cols)).status_code == 200
            with sqlite3.connect(tmp_path / "mon.db") as db:
                db.execute("UPDATE jobs SET part_seq = 'x' WHERE job = 'a'")
            db.close()
            r = c.put("/api/jobs/a/ranks/0/parts/1", content=table_bytes(parts[4][2]))
            assert r.status_code == 409 and "set aside" in r.text, r.text
            r = c.put("/api/jobs/c/meta", json=trace.meta.to_dict())
            assert r.status_code == 200, r.text
    finally:
        s.stop()


def test_one_op_cannot_poison_a_window_whose_close_comes_before_its_ranks_next_part(tmp_path):
    """F2 again after 2c7abd7, parts of window_steps steps (a hostile uploader aligns them):
    rank 3's part 0 has one op of 3,000 s at step 4, the window's last step. The fix bounds
    it by rank 3's step 5 — when that part is there when window 0 is analysed. Ranks 0-2 go
    on (step 5, starting ~0.1 s after the last), rank 3 sends nothing more: window 0
    is analysed with S 1,864, `severe` and `new_cause` fire. (In the recorder's own order,
    every rank's part 0 then every rank's part 1, window 0 closed before rank 3's part 1
    came and was S 1,864 too, 3 runs of 3; not tested: the order of the close and that
    upload is a race.) The op ends ~3,000 s after the latest op of every other rank of the
    job: an end no clock of the job has reached. Refused, or the window not poisoned."""
    import numpy as np

    trace = slow_job(steps=6, slow=None)
    config = MonitorConfig.from_mapping({**MONITOR.to_dict(), "gap_wait_s": 0.5}, "settings")
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=config).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60, headers=AUTH) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict()).status_code == 200
            for rank, n, cols in parts_of(trace, 5):
                if rank == 3 and n >= 1:
                    continue   # (rank 3 sends nothing after its part 0)
                if rank == 3:
                    cols = {k: v.copy() for k, v in cols.items()}
                    last = int(np.flatnonzero(cols["step"] == cols["step"].max())[0])
                    cols["duration"][last] = 3000.0
                r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols))
                assert r.status_code in (200, 422), r.text
                if r.status_code == 422:
                    return
            eventually(lambda: get(c, "/api/jobs/j?history=10")["windows_total"] >= 1,
                       what="window 0")
            job = get(c, "/api/jobs/j?history=10")
            assert job["windows"][0]["slowdown"] < 1.5, job["windows"][0]["slowdown"]
            assert not [a["rule"] for a in job["alerts"]], job["alerts"]
    finally:
        s.stop()


def run_meta(trace, start: float, token: bool = True) -> dict:
    """`trace`'s meta.json as a run started at `start` sends it: its start clock and (a
    recorder that has them) its run token."""
    meta = trace.meta.to_dict()
    meta["extra"]["clock"] = {"start": [start] * meta["world_size"]}
    if token:
        meta["extra"]["run"] = f"run-{start:.0f}"
    return meta


def test_a_stale_runs_meta_without_a_run_token_does_not_replace_the_newer_run(tmp_path):
    """Run b (token run-2000, start clock 2000) replaced run a (start 1000) under one job name
    and has a window analysed. Then run a's meta.json comes again without extra.run (an older
    recorder, or a's end-of-run rewrite by a tool that keeps only the known keys): the
    superseded check looks only at tokens, and is_new_run, one token missing, compares start
    clocks for inequality — an older start is taken as a new run. The job is reset to run a:
    b's analysed window gone (windows_total 1 -> 0), b's token put among the superseded, b's
    own meta.json then 409 'replaced by a newer run'. A run that started before the current
    one is not newer: refused (409), b kept."""
    trace = slow_job(steps=6, slow=None)
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=MONITOR).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60, headers=AUTH) as c:
            assert c.put("/api/jobs/t/meta", json=run_meta(trace, 1000)).status_code == 200
            assert c.put("/api/jobs/t/meta", json=run_meta(trace, 2000)).status_code == 200
            for rank, n, cols in parts_of(trace, 6):
                assert c.put(f"/api/jobs/t/ranks/{rank}/parts/{n}", content=table_bytes(cols),
                             headers={"X-Stragglers-Run": "run-2000"}).status_code == 200
            eventually(lambda: get(c, "/api/jobs/t")["windows_total"] >= 1, what="b's window")
            c.put("/api/jobs/t/meta", json=run_meta(trace, 1000, token=False))
            assert get(c, "/api/jobs/t")["windows_total"] >= 1, "run b's window is gone"
            r = c.put("/api/jobs/t/meta", json=run_meta(trace, 2000))
            assert r.status_code == 200, r.text
    finally:
        s.stop()


def test_a_new_runs_part_before_its_meta_is_retried_not_told_superseded(tmp_path):
    """A re-run under the same job name (--overwrite, the documented case): every rank has its
    own uploader and only rank 0 sends meta.json, so rank 1's first part may come first — and
    does whenever rank 0's meta.json waits: 503 while the last run's parts or window are being
    stored (RunBusy), 429 past meta_changes_per_minute while other jobs upload. check_run
    answers a run token that is not the job's current one 409 superseded_run ('run-2000 ...
    which a newer run replaced (run run-1000)': it is the newer one), and the recorder's
    uploader, on that kind, drops its buffer and sends nothing more for the rest of the run.
    A token that is neither the current run's nor among the superseded is not known to be
    stale: answered as retryable (404 / 503, as for a job not announced yet), then stored."""
    from stragglers.record.upload import RETRY_STATUSES

    trace = slow_job(steps=6, slow=None)
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=MONITOR).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60, headers=AUTH) as c:
            assert c.put("/api/jobs/t/meta", json=run_meta(trace, 1000)).status_code == 200
            rank, n, cols = parts_of(trace, 6)[1]
            new_run = {"X-Stragglers-Run": "run-2000"}
            r = c.put(f"/api/jobs/t/ranks/{rank}/parts/{n}", content=table_bytes(cols),
                      headers=new_run)
            assert r.status_code in RETRY_STATUSES, r.text
            assert c.put("/api/jobs/t/meta", json=run_meta(trace, 2000)).status_code == 200
            r = c.put(f"/api/jobs/t/ranks/{rank}/parts/{n}", content=table_bytes(cols),
                      headers=new_run)
            assert r.status_code == 200, r.text
    finally:
        s.stop()


def test_a_quarantined_data_set_can_be_deleted_by_its_owner(tmp_path):
    """One damaged shard row (state NULL: a bad sector, a hand edit) quarantines data set d, as
    designed: every call on it 503 Quarantined, 'use a new data set name'. Its owner's DELETE
    is refused the same 503 (owned() raises the quarantine first), and nothing else gives its
    places back (it is not 'unused': a row is not TODO): with max_datasets 1 the new name the
    remedy names is 429 for good, as is every creation of its token past its quota.
    Deleting a quarantined data set reads none of its rows: its owner may."""
    import sqlite3

    config = ServiceConfig(max_datasets=1)
    server = EmbeddedServer(tmp_path / "s.db", config=config).start()
    spec = {"name": "d", "num_samples": 16, "shard_size": 4}
    try:
        with httpx.Client(base_url=server.url, timeout=60, headers=bearer("owner")) as c:
            assert c.post("/datasets", json=spec).status_code == 200
    finally:
        server.stop()
    with sqlite3.connect(tmp_path / "s.db") as db:
        db.execute("UPDATE shards SET state = NULL WHERE shard = 1")
    db.close()
    server = EmbeddedServer(tmp_path / "s.db", config=config).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60, headers=bearer("owner")) as c:
            assert c.get("/datasets/d/status").status_code == 503   # quarantined, as designed
            r = c.delete("/datasets/d")
            assert r.status_code == 200, r.text
            assert c.post("/datasets", json={**spec, "name": "e"}).status_code == 200
    finally:
        server.stop()


def test_a_part_acknowledged_before_its_runs_meta_is_not_lost_at_the_reset(tmp_path):
    """F8 the other way: the job's current run a sends no run token (an older recorder). Run
    b (token run-2000) re-runs under the same name; its rank 1's first part comes before rank
    0's meta.json: check_run takes any token when the current run has none, so it is stored
    as run a's and acknowledged 200 — and the uploader never sends it again. b's meta.json then
    resets the job (a new run: the start clocks differ), deleting a's parts, that one among
    them: b's rank 1 part 0 acknowledged, then gone (parts left: ranks 0, 2, 3), and b's
    window 0 waits on a rank that will not send it. A part is either refused (retryable) or
    kept."""
    import sqlite3

    trace = slow_job(steps=6, slow=None)
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=MONITOR).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60, headers=AUTH) as c:
            assert c.put("/api/jobs/t/meta",
                         json=run_meta(trace, 1000, token=False)).status_code == 200
            new_run = {"X-Stragglers-Run": "run-2000"}
            rank, n, cols = parts_of(trace, 6)[1]
            early = c.put(f"/api/jobs/t/ranks/{rank}/parts/{n}", content=table_bytes(cols),
                          headers=new_run)
            assert c.put("/api/jobs/t/meta", json=run_meta(trace, 2000)).status_code == 200
            if early.status_code != 200:
                return   # (refused: the uploader sends it again)
            with sqlite3.connect(tmp_path / "mon.db") as db:
                kept = db.execute("SELECT COUNT(*) FROM parts WHERE job = 't' AND rank = ? "
                                  "AND part = ?", (rank, n)).fetchone()[0]
            db.close()
            assert kept == 1, f"rank {rank}'s part {n}, acknowledged 200, is gone"
    finally:
        s.stop()
