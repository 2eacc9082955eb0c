"""The store contract, run against both backends: SQLite (a file) and PostgreSQL (a real server).

Two store objects on one database stand for two monitor instances: what one writes the other
reads, leases divide the jobs, a fenced write of an instance whose lease was taken stores
nothing, and outbox messages are claimed by one instance at a time.
"""

from __future__ import annotations

import json
import threading
import time

import msgspec
import pytest
from pg_cluster import postgres_cluster, postgres_url  # noqa: F401 - fixtures

from stragglers.monitor.alerts import AlertEngine, parse_rules
from stragglers.monitor.records import PartCount, WindowRow, plain
from stragglers.monitor.store import JobConflict, PostgresStore, SQLiteStore, open_store

RULES = parse_rules([{"name": "straggling", "when": "slowdown >= 1.1", "for_windows": 1}])


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.slow)])
def stores(request, tmp_path):
    """open(): a new store object on the test's one database (each one an 'instance')."""
    if request.param == "sqlite":
        target = str(tmp_path / "mon.db")
    else:
        target = request.getfixturevalue("postgres_url")
    opened = []

    def open_one():
        opened.append(open_store(target))
        return opened[-1]

    yield open_one
    for s in opened:
        s.close()


def window(job, idx, s=1.0):
    return msgspec.convert(window_json(job, idx, s), WindowRow)


def window_json(job, idx, s=1.0):
    return {"job": job, "idx": idx, "first_step": idx * 10, "last_step": idx * 10 + 9,
            "steps": list(range(idx * 10, idx * 10 + 10)), "slowdown": s, "waste": 1 - 1 / s,
            "t_base": 1.0, "t_ideal": 1.0, "sim_error": 0.0, "m_w": None, "m_s": None,
            "scores": [{"dp": 0, "pp": 0, "rank": 0, "host": "h", "score": s}],
            "diagnosis": [{"cause": "none"}], "missing_ranks": [], "error": None,
            "reason": "complete", "closed_at": 1.0, "analysed_at": 2.0, "analysis_s": 0.5}


def test_the_backend_is_chosen_by_the_db_argument(stores, tmp_path):
    s = stores()
    assert isinstance(s, PostgresStore if s.shared else SQLiteStore)
    from stragglers.monitor.store_postgres import redacted

    assert redacted("postgresql://mon:s3cret@db:5432/m") == "postgresql://mon:***@db:5432/m"


def test_jobs_parts_and_their_sequence(stores):
    a, b = stores(), stores()
    assert a.register_job("j", "/runs/j", "http", {"world_size": 2}) is True
    assert b.register_job("j", "/runs/j", "http", {"world_size": 2}) is False
    # an uploaded job is the uploads folder's by its name: instances reaching that folder by
    # different paths announce one job; a watched run of the same name elsewhere is another
    assert b.register_job("j", "/mnt/uploads/j", "http", None) is False
    with pytest.raises(JobConflict):
        b.register_job("j", "/elsewhere", "files", None)
    assert a.add_parts([("j", 0, 0, 5, 0, 4, 100, "http", "d0"),
                        ("j", 1, 0, 5, 0, 4, 100, "http", "d1")], now=10.0) == [True, True]
    # the same part from the other instance counts once; a new one gets the next number
    assert b.add_parts([("j", 0, 0, 5, 0, 4, 100, "http", "d0"),
                        ("j", 0, 1, 7, 5, 9, 100, "files")], now=11.0) == [False, True]
    assert a.job_marks(["j"])["j"].part_seq == 3
    assert [(p.rank, p.part, p.seq) for p in a.part_index("j", after_seq=2)] == [(0, 1, 3)]
    assert b.part_digest("j", 1, 0) == "d1" and b.has_part("j", 0, 1)
    assert a.max_step("j") == 9 and a.max_step("none") == -1
    totals = b.totals()
    assert totals["by_job"]["j"] == PartCount(parts=3, records=17)
    assert type(totals["by_way"]["http"].records) is int   # (PostgreSQL sums to numeric)
    a.set_upload_dropped("j", 0, 4)
    b.set_upload_dropped("j", 0, 2)   # an older report does not lower the count
    assert a.upload_dropped("j") == {0: 4}
    job = b.jobs()[0]
    assert job.job == "j" and job.upload_dropped == 4 and job.world_size == 2
    assert b.job("j").meta == {"world_size": 2} and b.job("none") is None


def test_windows_and_alert_changes_are_stored_once_with_their_messages(stores):
    a, b = stores(), stores()
    a.register_job("j", "/runs/j", "http", None)
    engine = AlertEngine(RULES, a, repeat_s=3600)
    w = window("j", 0, 1.3)
    rows, log, _ = engine.on_window("j", w, now=5.0)
    assert a.add_window(w, rows, log) is True
    got = b.last_window("j")
    assert got == w and got.scores[0].score == 1.3 and got.steps == list(range(10))
    assert b.window_span("j") == (1, 0) and b.windows("j")[0].causes == ["none"]
    assert [x.status for x in b.alerts(job="j")] == ["firing"]
    assert [e.window for e in b.alert_log(job="j")] == [0]
    # the alert change and its message went in together, once
    assert [(m.status, m.attempts) for m in b.outbox("j")] == [("firing", 0)]
    a.add_alert_changes(rows, [])   # the same decision again: no second message
    assert len(b.outbox("j")) == 1


@pytest.mark.slow
def test_the_stored_json_keeps_its_form_and_older_rows_still_read(stores):
    a = stores()
    a.register_job("j", "/runs/j", "http", None)
    engine = AlertEngine(RULES, a, repeat_s=3600)
    w = window("j", 0, 1.3)
    a.add_window(w, *engine.on_window("j", w, now=5.0)[:2])
    raw = a._rows("SELECT scores, diagnosis FROM windows WHERE job = ?", ("j",))[0]
    assert json.loads(raw["scores"]) == [{**window_json("j", 0, 1.3)["scores"][0],
                                          "decomposed": False}]
    finding = json.loads(raw["diagnosis"])[0]
    assert finding["cause"] == "none" and finding["where"] == {} and finding["headline"] == ""
    alert = a._rows("SELECT labels, annotations FROM alerts")[0]
    # the labels' text, hence Alertmanager's dedup keys, as the dict form wrote them
    assert alert["labels"] == json.dumps({"alertname": "straggling", "job": "j",
                                          "severity": "warning"}, sort_keys=True)
    assert set(json.loads(alert["annotations"])) == {"summary", "description"}
    # a row written before findings' workers were objects, with a key since dropped
    old = {**window_json("j", 1), "diagnosis": [
        {"cause": "worker_fault", "where": {"workers": [[1, 0]]}, "ranks": [3], "gone": 1},
        {"cause": 7}]}
    a._write(lambda db: a._exec(db, "INSERT INTO windows (job, idx, first_step, last_step, "
                                "steps, scores, diagnosis, missing_ranks, reason, closed_at, "
                                "analysed_at, analysis_s) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, "
                                "?, ?, ?)", ("j", 1, 10, 19, json.dumps(old["steps"]), "[]",
                                             json.dumps(old["diagnosis"]), "{}", "complete",
                                             1.0, 2.0, 0.5)))
    got = a.window("j", 1)
    assert [(f.cause, f.where.workers[0].dp, f.ranks) for f in got.diagnosis] == \
        [("worker_fault", 1, [3])]     # the finding that cannot be read is left out
    assert got.missing_ranks == [] and plain(got)["scores"] == []
    # an alert row whose labels do not decode is left out, the others are read
    a._write(lambda db: a._exec(db, "INSERT INTO alerts (fingerprint, rule, job, labels, "
                                "annotations, status, starts_at, ends_at, last_sent) VALUES "
                                "(?, ?, ?, ?, ?, ?, ?, ?, ?)", ("bad", "straggling", "j", "{x",
                                                                "{}", "firing", 1.0, None, 1.0)))
    assert [x.rule for x in a.alerts(job="j")] == ["straggling"]


def test_leases_divide_jobs_and_a_taken_lease_fences_its_old_holder(stores):
    a, b = stores(), stores()
    for j in ("j1", "j2", "j3", "j4"):
        a.register_job(j, f"/runs/{j}", "http", None)
    held_a = a.heartbeat("A", "http://a", 60.0, {})
    assert sorted(held_a) == ["j1", "j2", "j3", "j4"]        # alone: every job
    assert b.heartbeat("B", "http://b", 60.0, {}) == {}     # all held and not expired
    held_a = a.heartbeat("A", "http://a", 60.0, held_a)     # B is live: A keeps its half
    assert len(held_a) == 2
    held_b = b.heartbeat("B", "http://b", 60.0, {})
    assert len(held_b) == 2 and not set(held_a) & set(held_b)
    job = sorted(held_b)[0]
    assert b.add_window(window(job, 0), [], [], lease=("B", held_b[job])) is True
    # B stops renewing (killed): once its leases expire, A takes them with a new epoch
    a.heartbeat("A", "http://a", 0.05, held_a)
    b.heartbeat("B", "http://b", 0.05, held_b)
    time.sleep(0.3)
    held_a = a.heartbeat("A", "http://a", 60.0, held_a)
    assert sorted(held_a) == ["j1", "j2", "j3", "j4"]
    assert held_a[job] == held_b[job] + 1
    # B wakes up and tries to store its next window: fenced out, nothing stored
    assert b.add_window(window(job, 1), [], [], lease=("B", held_b[job])) is False
    assert b.window_span(job) == (1, 0)
    assert b.heartbeat("B", "http://b", 60.0, held_b) == {}   # and it learns it lost them
    assert a.add_window(window(job, 1), [], [], lease=("A", held_a[job])) is True
    a.release_leases("A")
    assert {r.owner for r in b.leases()} == {None}
    assert b.take_lease("B", "j1", 60.0) is not None and a.take_lease("A", "j1", 60.0) is None


@pytest.mark.slow
def test_concurrent_heartbeats_never_give_one_job_to_two_instances(stores):
    instances = [stores() for _ in range(4)]
    for i in range(40):
        instances[0].register_job(f"j{i:02d}", f"/runs/{i}", "http", None)
    held: dict[str, dict] = {str(n): {} for n in range(4)}

    def run(n):
        for _ in range(5):
            held[str(n)] = instances[n].heartbeat(str(n), "u", 60.0, held[str(n)])

    threads = [threading.Thread(target=run, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    owners = {r.job: r.owner for r in instances[0].leases()}
    for n, jobs in held.items():
        assert all(owners[j] == n for j in jobs)
    assert sum(len(j) for j in held.values()) == sum(o is not None for o in owners.values())


@pytest.mark.slow
def test_outbox_messages_are_claimed_by_one_instance_in_order(stores):
    a, b = stores(), stores()
    a.register_job("j", "/runs/j", "http", None)
    engine = AlertEngine(RULES, a, repeat_s=3600)
    rows, log, _ = engine.on_window("j", window("j", 0, 1.3), now=5.0)
    a.add_window(window("j", 0, 1.3), rows, log)
    rows, log, _ = engine.on_window("j", window("j", 1, 1.0), now=6.0)   # it resolves
    a.add_window(window("j", 1, 1.0), rows, log)
    first = a.claim_messages("A", 10, claim_s=60.0)
    assert [m.status for m in first] == ["firing"]     # resolved waits for its firing
    assert (first[0].alert.labels.alertname, first[0].alert.status) == ("straggling", "firing")
    assert b.claim_messages("B", 10, claim_s=60.0) == []  # claimed by A
    a.message_sent(first[0].id, "A")
    second = b.claim_messages("B", 10, claim_s=60.0)
    assert [m.status for m in second] == ["resolved"]
    b.message_failed(second[0].id, retry_in_s=0.0)   # the receiver was down: again later
    again = a.claim_messages("A", 10, claim_s=0.05)
    assert [(m.id, m.attempts) for m in again] == [(second[0].id, 2)]
    time.sleep(0.3)   # A died holding the claim: once it runs out, B may send it
    assert [m.id for m in b.claim_messages("B", 10, claim_s=60.0)] == [second[0].id]


def test_a_new_run_is_reset_once_when_two_instances_see_it(stores):
    a, b = stores(), stores()
    a.register_job("j", "/runs/j", "http", {"extra": {"clock": {"start": 1}}})
    a.add_parts([("j", 0, 0, 5, 0, 4, 100, "http")])
    a.add_window(window("j", 0), [], [])
    new = {"extra": {"clock": {"start": 2}}}

    def old_run(meta):
        return (meta or {}).get("extra", {}).get("clock", {}).get("start") == 1

    assert a.reset_job("j", new, [], [], still_old=old_run) is True
    a.add_parts([("j", 0, 0, 5, 0, 4, 100, "http")])          # the new run's first part
    assert b.reset_job("j", new, [], [], still_old=old_run) is False   # seen late: no reset
    assert b.has_part("j", 0, 0) and b.window_span("j") == (0, None)
    assert b.job_marks(["j"])["j"].run == 1


def test_the_runs_a_reset_replaced_are_in_the_job_row_for_every_instance(stores):
    # (an instance's memory of them was lost at a restart and never seen by the others: the
    # replaced run announcing itself again reset the newer run's parts away)
    from stragglers.monitor.jobmeta import run_token
    from stragglers.monitor.store_base import MAX_SUPERSEDED, superseded_tokens

    a, b = stores(), stores()
    a.register_job("j", "/runs/j", "http", {"extra": {"run": "r0"}})
    for n in range(1, MAX_SUPERSEDED + 3):
        assert a.reset_job("j", {"extra": {"run": f"r{n}"}}, [], [], token_of=run_token)
    seen = superseded_tokens(b.job("j").superseded)
    # r0 to r17 were replaced: the last 16, in order
    assert seen == [f"r{n}" for n in range(2, MAX_SUPERSEDED + 2)]
    assert b.reset_job("j", {"extra": {"run": "r0"}}, [], [], token_of=None)
    assert superseded_tokens(a.job("j").superseded) == seen   # no token: nothing added


@pytest.mark.slow
def test_a_change_on_one_postgres_instance_reaches_the_others_listeners(postgres_url):
    # (one SQLite file has one instance: its listeners hear its own writes)
    a, b = open_store(postgres_url), open_store(postgres_url)
    heard = threading.Event()
    b.on_change(lambda version: heard.set())
    a.register_job("j", "/runs/j", "http", None)
    try:
        assert heard.wait(10.0), "the other instance never heard of the write (LISTEN/NOTIFY)"
    finally:
        a.close()
        b.close()


@pytest.mark.slow
def test_a_postgres_store_that_cannot_be_used_is_refused_in_one_line(tmp_path, postgres_url):
    # (InputError: the CLI prints its one line and exits 2, as for a SQLite file that is not one)
    import socket

    from stragglers.errors import InputError
    from stragglers.monitor.service import Monitor

    with socket.socket() as s:   # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        nobody = f"postgresql://mon:s3cret@127.0.0.1:{s.getsockname()[1]}/monitor"
    with pytest.raises(InputError) as bad:
        open_store(nobody)
    said = str(bad.value)
    assert "cannot use this PostgreSQL database" in said and "\n" not in said
    assert "s3cret" not in said                    # the password is never shown
    store = open_store(postgres_url)
    try:
        with pytest.raises(InputError, match="--data-dir"):   # a shared store needs a shared
            Monitor(store)                                    # folder for the uploads
    finally:
        store.close()


def test_an_outbox_message_that_does_not_read_is_set_aside_not_every_message(stores):
    # its alert text damaged: the claim failed, rolled back and found it first again at every
    # poll, so no alert of any job left the outbox any more
    a = stores()
    a.register_job("j", "/runs/j", "http", None)
    engine = AlertEngine(RULES, a, repeat_s=3600)
    rows, log, _ = engine.on_window("j", window("j", 0, 1.3), now=5.0)
    a.add_window(window("j", 0, 1.3), rows, log)

    def damage(db):
        a._exec(db, "UPDATE alert_outbox SET alert = ?", ("{not json",))
        return True
    a._write(damage)
    a.register_job("k", "/runs/k", "http", None)   # another job's message behind it
    rows, log, _ = engine.on_window("k", window("k", 0, 1.3), now=6.0)
    a.add_window(window("k", 0, 1.3), rows, log)
    claimed = a.claim_messages("A", 10, claim_s=60.0)
    assert [(m.job, m.alert.rule, m.status) for m in claimed] == [("k", "straggling", "firing")]
    bad = [r for r in a.outbox("j") if r.failed_at is not None]
    assert len(bad) == 1 and bad[0].delivered_at is None   # given up on, named in the log
    assert a.claim_messages("A", 10, claim_s=60.0) == []


@pytest.mark.slow
def test_a_full_postgres_disk_is_the_oserror_a_full_disk_is(postgres_url):
    # PostgreSQL's disk_full (SQLSTATE 53100), raised by the real server inside a write: the
    # service answers 507 for it as for a full local disk (it was 503, "cannot reach storage")
    import errno

    from stragglers.serving import error_status

    store = open_store(postgres_url)
    try:
        store.register_job("j", "/runs/j", "http", None)

        def full(db):
            db.execute("DO $$ BEGIN RAISE EXCEPTION 'could not extend file' USING ERRCODE = "
                       "'disk_full'; END $$")
        with pytest.raises(OSError) as got:
            store._write(full)
        assert got.value.errno == errno.ENOSPC and "disk is full" in str(got.value)
        assert error_status(got.value)[0] == 507
        assert store.job("j") is not None   # and the store goes on
    finally:
        store.close()


def test_a_dead_man_change_is_stored_with_its_message_claimed_in_one_transaction(stores):
    a, b = stores(), stores()
    a.register_job("j", "/runs/j", "http", None)
    lease = ("A", a.take_lease("A", "j", 60.0))
    engine = AlertEngine(parse_rules(None), a, repeat_s=3600)
    rows, log, _ = engine.on_state("j", "stalled", now=5.0)
    [m] = a.add_dead_man("j", "stalled", rows, log, lease, "A", 30.0)
    assert (m.job, m.status, m.alert.rule, m.attempts) == ("j", "firing", "stalled", 1)
    assert a.job("j").state == "stalled"
    assert b.claim_messages("B", 10, claim_s=30.0) == []   # claimed by A already
    # an instance whose lease was taken stores nothing
    a.release_leases("A")
    assert b.take_lease("B", "j", 60.0) is not None
    assert a.add_dead_man("j", "running", [], [], lease, "A", 30.0) is None
    assert a.job("j").state == "stalled"


def test_alerts_and_the_alert_log_are_read_a_page_at_a_time(stores):
    """/api/alerts's pages (the whole list was one answer): the same pages on both backends,
    each alert once, in its key's order; the log newest first."""
    a = stores()
    labels = '{"alertname": "straggling", "job": "j", "severity": "warning"}'

    def tx(db):
        for i in range(25):
            a._exec(db, "INSERT INTO alerts (fingerprint, rule, job, labels, annotations, "
                    "status, starts_at, ends_at, last_sent) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (f"{i:016x}", "straggling", "j", labels, "{}",
                     "firing" if i % 5 else "resolved", float(25 - i), None, 1.0))
            a._exec(db, "INSERT INTO alert_log (at, fingerprint, job, rule, status, severity, "
                    "summary, description) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (float(i), f"{i:016x}", "j", "straggling", "firing", "warning", f"s{i}",
                     "d"))
    a._write(tx)
    got, after = [], None
    while True:
        page, after = a.alerts_page("firing", after, 7)
        assert len(page) <= 7
        got += [x.fingerprint for x in page]
        if after is None:
            break
    assert got == [f"{i:016x}" for i in range(25) if i % 5]
    log, before = [], None
    while True:
        entries, before = a.alert_log_page(before, 10)
        log += [e.summary for e in entries]
        if before is None:
            break
    assert log == [f"s{i}" for i in reversed(range(25))]


def test_new_sizes_are_refused_under_the_job_lock_once_a_part_is_stored(stores):
    # the monitor looked for parts, then wrote the new sizes: a part another instance
    # committed in between was stored at sizes the job no longer had; judged in the write
    # itself now, and a part checked against the metadata before is not committed
    from stragglers.monitor.store import JobConflict
    from stragglers.monitor.store_base import STALE
    a, b = stores(), stores()
    a.register_job("j", "/runs/j", "http", {"world_size": 4})
    seq = a.job("j").meta_seq
    assert b.add_parts([("j", 3, 0, 5, 0, 4, 100, "http")], fence={"j": seq}) == [True]
    with pytest.raises(JobConflict):
        a.register_job("j", "/runs/j", "http", {"world_size": 2}, sizes_change=True)
    assert a.job("j").meta == {"world_size": 4} and a.job("j").meta_seq == seq
    a.register_job("j", "/runs/j", "http", {"world_size": 4, "name": "j"})   # no resize
    assert a.job("j").meta_seq == seq + 1
    assert b.add_parts([("j", 2, 0, 5, 0, 4, 100, "http")], fence={"j": seq}) == [STALE]
    assert not b.has_part("j", 2, 0)
    assert b.add_parts([("j", 2, 0, 5, 0, 4, 100, "http")], fence={"j": seq + 1}) == [True]
