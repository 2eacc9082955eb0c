"""Issue 34's leftovers of the worker places: a worker whose lease expired gives its place back
as one that released does, and a name's fences never restart (a restart with a higher
max_workers_per_dataset gave new names fence 1 again: a deleted name's old holder was current).

The store runs on a clock of its own: expiry is an interleaving, not a wait.
"""

from __future__ import annotations

import pytest

from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.errors import Fenced, Quarantined, QuotaExceeded
from stragglers.adapt.service import token_digest
from stragglers.adapt.shards import ShardStore

A = token_digest("a-issue34-token-0123456789")


def test_a_worker_whose_lease_expired_gives_its_place_to_a_new_name(tmp_path):
    """max_workers_per_dataset 1: `a` leases and is never heard of again. Once its lease has
    expired (requeued by the next call), a new name joins in its place (it was 429 for good:
    only a release freed a place); `a`'s incarnation is fenced off, and `a` back gets a fence
    above it."""
    now = [1000.0]
    store = ShardStore(tmp_path / "s.db", clock=lambda: now[0], max_workers_per_dataset=1)
    try:
        store.create_dataset(DatasetConfig("d", 16, 4, lease_s=10), A)
        a = store.join("d", "a", A).fence
        held = store.lease("d", "a", a, token_sha256=A).leases[0]
        with pytest.raises(QuotaExceeded):   # a holds a live lease: its place is kept
            store.join("d", "b", A)
        now[0] += 11
        store.expire("d")
        assert store.status("d").epochs["0"]["DOING"] == 0
        b = store.join("d", "b", A).fence
        assert store.lease("d", "b", b, token_sha256=A).leases[0].shard == held.shard
        with pytest.raises(Fenced, match="has not joined"):
            store.ack("d", "a", a, held.epoch, held.shard, 1, token_sha256=A)
        store.release("d", "b", b, failure=False, token_sha256=A)
        assert store.join("d", "a", A).fence > a
    finally:
        store.close()


def test_a_worker_that_acks_after_one_lease_expired_keeps_its_place(tmp_path):
    """One of `a`'s two shards expires while it acks the other: an ack is a live worker's, so
    `a` keeps its place once it holds nothing (a new name is still 429)."""
    now = [1000.0]
    store = ShardStore(tmp_path / "s.db", clock=lambda: now[0], max_workers_per_dataset=1)
    try:
        store.create_dataset(DatasetConfig("d", 16, 4, lease_s=10), A)
        a = store.join("d", "a", A).fence
        first, _ = store.lease("d", "a", a, count=2, token_sha256=A).leases
        now[0] += 6
        store.ack("d", "a", a, first.epoch, first.shard, 1, token_sha256=A)
        now[0] += 6
        store.expire("d")   # the other shard: expired, a marked as gone
        store.ack("d", "a", a, first.epoch, first.shard, 4, token_sha256=A)   # DONE: holds none
        with pytest.raises(QuotaExceeded):
            store.join("d", "b", A)
    finally:
        store.close()


def test_a_worker_whose_lease_expired_and_that_polls_keeps_its_place(tmp_path):
    """`a`'s lease expires in `x`'s call and `x` takes the shard; `a`, slow but alive, asks
    again and is told "wait": a call of its own is a live worker's, so its place is kept (a
    new name 429) and `a` goes on (its incarnation was deleted for a new name, then Fenced)."""
    now = [1000.0]
    store = ShardStore(tmp_path / "s.db", clock=lambda: now[0], max_workers_per_dataset=2)
    try:
        store.create_dataset(DatasetConfig("d", 4, 4, lease_s=10), A)
        a, x = store.join("d", "a", A).fence, store.join("d", "x", A).fence
        store.lease("d", "a", a, token_sha256=A)
        now[0] += 11
        assert store.lease("d", "x", x, token_sha256=A).status == "ok"   # a's shard, expired
        assert store.lease("d", "a", a, token_sha256=A).status == "wait"
        with pytest.raises(QuotaExceeded):
            store.join("d", "b", A)
        assert store.lease("d", "a", a, token_sha256=A).status == "wait"
    finally:
        store.close()


def test_fences_never_restart_when_the_limit_is_raised(tmp_path):
    """max_workers_per_dataset 1: `a` releases, `b` takes its place. After a restart with a
    limit of 4, `a` joins as a new name: its fence is above its old one (it was 1 again, the
    old incarnation's: a hung holder of it was current again)."""
    db = tmp_path / "s.db"
    store = ShardStore(db, max_workers_per_dataset=1)
    try:
        store.create_dataset(DatasetConfig("d", 16, 4), A)
        a = store.join("d", "a", A).fence
        store.release("d", "a", a, failure=False, token_sha256=A)
        store.join("d", "b", A)
    finally:
        store.close()
    store = ShardStore(db, max_workers_per_dataset=4)
    try:
        again = store.join("d", "a", A).fence
        assert again > a
        with pytest.raises(Fenced, match="stale"):
            store.lease("d", "a", a, token_sha256=A)
        assert store.join("d", "c", A).fence > a   # (every new name: above every deleted one)
    finally:
        store.close()


def _joined_three_times(db, lease: bool = False, delete: bool = False) -> int:
    """Data set d in a new store at `db`, `a` joined three times (its last fence returned),
    that fence's lease taken where `lease`, d deleted where `delete`; the store closed."""
    store = ShardStore(db)
    try:
        store.create_dataset(DatasetConfig("d", 16, 4), A)
        for _ in range(3):
            top = store.join("d", "a", A).fence
        if lease:
            store.lease("d", "a", top, token_sha256=A)   # (its row holds fence top)
        if delete:
            store.delete_dataset("d", A)
    finally:
        store.close()
    return top


def test_a_schema_4_file_keeps_its_fences_above_every_row_it_holds(tmp_path):
    """A file of schema 4 (no fence floors: which names gave their place is not known) opens
    with its floor at the highest fence its rows hold: a new name starts above it."""
    import sqlite3

    db = tmp_path / "s.db"
    top = _joined_three_times(db)
    with sqlite3.connect(db) as c:
        c.executescript("DROP TABLE fence_floors; PRAGMA user_version=4;")
    store = ShardStore(db)
    try:
        assert store.join("d", "b", A).fence == top + 1
    finally:
        store.close()


def test_a_data_set_deleted_and_created_again_never_hands_an_old_fence_back(tmp_path):
    """`a` of data set d holds a shard at fences 1..2, d is deleted and created again (no old
    row left but garbage): `a` joining the new d gets a fence above 2, also after a restart,
    and the old incarnation's lease is refused (fences started at 1 again: the stuck holder
    of the deleted d leased, acked and gave back on the new one)."""
    db = tmp_path / "s.db"
    store = ShardStore(db)
    try:
        store.create_dataset(DatasetConfig("d", 16, 4), A)
        store.join("d", "a", A)
        old = store.join("d", "a", A).fence
        held = store.lease("d", "a", old, token_sha256=A).leases[0]
        store.delete_dataset("d", A)
        store.create_dataset(DatasetConfig("d", 16, 4), A)
        new = store.join("d", "a", A).fence
        assert new > old
        with pytest.raises(Fenced, match="stale"):
            store.lease("d", "a", old, token_sha256=A)
        with pytest.raises(Fenced, match="stale"):
            store.ack("d", "a", old, held.epoch, held.shard, 1, token_sha256=A)
        with pytest.raises(Fenced, match="stale"):
            store.release("d", "a", old, token_sha256=A)
        store.delete_dataset("d", A)
    finally:
        store.close()
    store = ShardStore(db)   # (the floor is in the file: a restart keeps it)
    try:
        store.create_dataset(DatasetConfig("d", 16, 4), A)
        assert store.join("d", "b", A).fence > new
        assert store.join("d", "a", A).fence > new
    finally:
        store.close()


def test_a_quarantined_data_set_deleted_keeps_its_fences_above_its_rows(tmp_path):
    """d's row and fence floor are damaged (quarantined): the operator's delete (round 9's
    path) keeps a floor above every fence its rows held, so d created again starts above them
    (and the name is usable again: the damaged floor is not kept)."""
    import sqlite3

    db = tmp_path / "s.db"
    top = _joined_three_times(db, lease=True)
    with sqlite3.connect(db) as c:
        c.execute("INSERT OR REPLACE INTO fence_floors VALUES ('d', 'x')")
        c.execute("UPDATE datasets SET shard_size='x' WHERE name='d'")
        c.execute("DELETE FROM workers WHERE dataset='d'")   # (only the rows hold the fences)
    store = ShardStore(db)
    try:
        with pytest.raises(Quarantined):
            store.join("d", "c", A)
        store.delete_dataset("d", None, operator=True)
        store.create_dataset(DatasetConfig("d", 16, 4), A)
        assert store.join("d", "a", A).fence > top
    finally:
        store.close()


def test_a_schema_5_file_keeps_a_deleted_data_sets_fences_above_its_garbage_rows(tmp_path):
    """A file of schema 5 dropped a deleted data set's floor: opened, its name's floor goes
    above the fences its rows not yet collected hold."""
    import sqlite3

    db = tmp_path / "s.db"
    top = _joined_three_times(db, lease=True, delete=True)
    with sqlite3.connect(db) as c:   # (as schema 5 left it: no floor past the delete)
        c.executescript("DELETE FROM fence_floors; PRAGMA user_version=5;")
    store = ShardStore(db)
    try:
        store.create_dataset(DatasetConfig("d", 16, 4), A)
        assert store.join("d", "a", A).fence == top + 1
    finally:
        store.close()


def test_deleted_names_fence_floors_are_bounded_and_fold_into_one(tmp_path):
    """max_kept_floors 2: of three data sets created, joined and deleted in turn, the oldest
    name's floor folds into the store's (one row for every name without its own): each name
    created again still starts above its deleted fences, and the file keeps 2 by name (every
    deleted name kept one: created and deleted in a loop, the file grew without bound)."""
    import sqlite3

    db = tmp_path / "s.db"
    store = ShardStore(db, max_kept_floors=2)
    try:
        tops = {}
        for name in ("p", "q", "r"):
            store.create_dataset(DatasetConfig(name, 16, 4), A)
            for _ in range(3 if name == "p" else 1):
                tops[name] = store.join(name, "a", A).fence
            store.delete_dataset(name, A)
        with sqlite3.connect(db) as c:
            kept = c.execute("SELECT dataset FROM fence_floors ORDER BY dataset").fetchall()
            assert kept == [("*",), ("q",), ("r",)]
        for name in ("p", "q", "r", "s"):
            store.create_dataset(DatasetConfig(name, 16, 4), A)
            assert store.join(name, "a", A).fence > tops.get(name, 0)
    finally:
        store.close()


def test_max_kept_floors_is_a_service_setting(tmp_path):
    """max_kept_floors is a ServiceConfig setting (`--set max_kept_floors=N`, was only a
    ShardStore argument: a service kept 65,536 for good) that the service's store folds by;
    out of its bounds, one line naming it."""
    import sqlite3

    from stragglers.adapt.service import ServiceConfig, open_store
    from stragglers.config import cli_overrides
    from stragglers.errors import InputError

    db = tmp_path / "s.db"
    store = open_store(db, cli_overrides(ServiceConfig, ["max_kept_floors=1"]))
    try:
        for name in ("p", "q"):
            store.create_dataset(DatasetConfig(name, 16, 4), A)
            store.join(name, "a", A)
            store.delete_dataset(name, A)
    finally:
        store.close()
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT dataset FROM fence_floors ORDER BY dataset").fetchall() == \
            [("*",), ("q",)]
    for bad in ("-1", "x", str(1 << 25)):
        with pytest.raises(InputError, match="max_kept_floors") as refused:
            cli_overrides(ServiceConfig, [f"max_kept_floors={bad}"])
        assert "\n" not in str(refused.value)


def _damage(db, name: str, floor) -> None:
    import sqlite3

    with sqlite3.connect(db) as c:
        c.execute("UPDATE fence_floors SET floor=? WHERE dataset=?", (floor, name))


def test_a_damaged_store_floor_refuses_only_the_names_it_may_cover(tmp_path):
    """The store floor ('*': deleted names' floors folded into one) is damaged. It was read by
    every new worker name's join, so every data set's new names were refused (503). Now a
    data set takes it into a floor of its own at its creation, and the names folded into it
    are kept in a filter: e (created before) and old (no floor of its own, as a schema-6 file
    left it, its name never folded) serve new names, a name never folded is created and
    served; refused, nothing written, only what the floor may cover: r created again (folded:
    its fences unknown), a new name of p (created again from the floor, its own row lost).
    e deleted keeps its row (not folded into the damaged floor) and is created again above
    its fences; the floor repaired, r is created above its old fences."""
    import sqlite3

    db = tmp_path / "s.db"
    store = ShardStore(db, max_kept_floors=0)
    tops = {}
    try:
        for name in ("e", "p", "r", "old"):
            store.create_dataset(DatasetConfig(name, 16, 4), A)
            for _ in range(3 if name == "r" else 1):
                tops[name] = store.join(name, "a", A).fence
        for name in ("p", "r"):   # (max_kept_floors 0: folded into '*' at once)
            store.delete_dataset(name, A)
        store.create_dataset(DatasetConfig("p", 16, 4), A)
        assert store.join("p", "a", A).fence == tops["r"] + 1
    finally:
        store.close()
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT floor FROM fence_floors WHERE dataset='*'").fetchone() == (3,)
        c.execute("DELETE FROM fence_floors WHERE dataset IN ('old', 'p')")   # (schema 6)
    _damage(db, "*", "x")
    store = ShardStore(db, max_kept_floors=0)
    try:
        assert store.join("e", "b", A).fence == 1   # (was Quarantined: the store's floor)
        a = store.join("e", "a", A).fence
        assert store.lease("e", "a", a, token_sha256=A).status == "ok"
        assert store.join("old", "b", A).fence == 1
        store.create_dataset(DatasetConfig("new", 16, 4), A)
        assert store.join("new", "a", A).fence == 1
        with pytest.raises(Quarantined, match=r"fence_floors row '\*'"):
            store.create_dataset(DatasetConfig("r", 16, 4), A)
        with pytest.raises(Quarantined, match=r"fence_floors row '\*'"):
            store.join("p", "b", A)
        assert store.join("p", "a", A).fence == tops["r"] + 2   # (a name it knows)
        store.delete_dataset("e", A)
        store.create_dataset(DatasetConfig("e", 16, 4), A)
        assert store.join("e", "c", A).fence > a
    finally:
        store.close()
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT COUNT(*) FROM datasets WHERE name='r'").fetchone() == (0,)
    _damage(db, "*", tops["r"])   # (repaired by its operator)
    store = ShardStore(db)
    try:
        store.create_dataset(DatasetConfig("r", 16, 4), A)
        assert store.join("r", "a", A).fence == tops["r"] + 1
    finally:
        store.close()


def test_a_schema_6_files_folded_names_are_unknown_under_a_damaged_store_floor(tmp_path):
    """A file of schema 6 folded names into the store floor without noting which: upgraded,
    a damaged store floor then refuses every creation of a name without a floor of its own
    (none is proven never folded), a data set with its own floor is served; with no store
    floor the upgrade notes nothing (nothing was folded) and a damaged one covers no name."""
    import sqlite3

    for folded in (True, False):
        db = tmp_path / f"{folded}.db"
        store = ShardStore(db, max_kept_floors=0)
        try:
            for name in ("e", "p"):
                store.create_dataset(DatasetConfig(name, 16, 4), A)
                store.join(name, "a", A)
            if folded:
                store.delete_dataset("p", A)
        finally:
            store.close()
        with sqlite3.connect(db) as c:
            c.executescript("DROP TABLE fence_folds; PRAGMA user_version=6;")
        ShardStore(db).close()   # (upgraded)
        with sqlite3.connect(db) as c:   # (damaged; where none was folded, written damaged)
            c.execute("INSERT OR REPLACE INTO fence_floors VALUES ('*', 'x')")
        store = ShardStore(db)
        try:
            assert store.join("e", "b", A).fence == 1
            if folded:
                with pytest.raises(Quarantined, match=r"fence_floors row '\*'"):
                    store.create_dataset(DatasetConfig("new", 16, 4), A)
            else:
                store.create_dataset(DatasetConfig("new", 16, 4), A)
                assert store.join("new", "a", A).fence == 1
        finally:
            store.close()


def test_a_damaged_floor_is_never_raised_into_a_sound_one(tmp_path):
    """d's floor is damaged (-1): a new name taking the place of one that left is refused
    (its place not taken), and the floor stays damaged (MAX(-1, fence) wrote the fence that
    left as d's floor: its deleted incarnations' fences, which the floor stood for, lost)."""
    import sqlite3

    db = tmp_path / "s.db"
    store = ShardStore(db, max_workers_per_dataset=1)
    try:
        store.create_dataset(DatasetConfig("d", 16, 4), A)
        a = store.join("d", "a", A).fence
        store.release("d", "a", a, failure=False, token_sha256=A)
    finally:
        store.close()
    _damage(db, "d", -1)
    store = ShardStore(db, max_workers_per_dataset=1)
    try:
        with pytest.raises(Quarantined, match="fence floor is damaged"):
            store.join("d", "b", A)
        assert store.join("d", "a", A).fence == a + 1   # (a name it knows joins as before)
    finally:
        store.close()
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT floor FROM fence_floors WHERE dataset='d'").fetchone() == (-1,)


def test_a_worker_that_replays_a_lease_after_its_expiry_keeps_its_place(tmp_path):
    """max_workers_per_dataset 2: a's lease (r1) expires in b's call; a's client sends r1
    again (its reply was lost) and is answered the shard, not held. A replay is a live
    worker's call: a keeps its place (a new name is 429) and leases on (the replay returned
    before the mark was cleared: c took a's place and a's next lease was Fenced)."""
    now = [1000.0]
    store = ShardStore(tmp_path / "s.db", clock=lambda: now[0], max_workers_per_dataset=2)
    try:
        store.create_dataset(DatasetConfig("d", 16, 4, lease_s=5), A)
        a, b = store.join("d", "a", A).fence, store.join("d", "b", A).fence
        store.lease("d", "a", a, request_id="r1", token_sha256=A)
        now[0] += 10
        store.lease("d", "b", b, token_sha256=A)   # (requeues a's shard: a marked expired)
        replay = store.lease("d", "a", a, request_id="r1", token_sha256=A)
        assert [x.held for x in replay.leases] == [False]
        with pytest.raises(QuotaExceeded):
            store.join("d", "c", A)
        assert store.lease("d", "a", a, request_id="r2", token_sha256=A).status == "ok"
    finally:
        store.close()


def test_a_fence_past_the_bound_is_never_kept_as_a_floor(tmp_path):
    """a's stored fence is 2^63-1 (past MAX_FENCE, 2^62: no request can carry it): d is
    quarantined; its delete keeps a floor of its sound fences only, folded into the store's,
    so new names of e (created after) and of d created again get sound fences (2^63-1 kept
    made every new name's fence 2^63: OverflowError, a 500 on every join for good); a floor at
    MAX_FENCE, or a worker at it, is refused 409 naming the bound, not a fence past it."""
    from stragglers.adapt.errors import Conflict
    from stragglers.adapt.requests import MAX_FENCE

    db = tmp_path / "s.db"
    store = ShardStore(db, max_kept_floors=0)
    try:
        store.create_dataset(DatasetConfig("d", 16, 4), A)
        store.join("d", "a", A)
        b = store.join("d", "b", A).fence
    finally:
        store.close()
    import sqlite3

    with sqlite3.connect(db) as c:
        c.execute("UPDATE workers SET fence=? WHERE worker='a'", ((1 << 63) - 1,))
    store = ShardStore(db, max_kept_floors=0)
    try:
        with pytest.raises(Quarantined, match="worker 'a'"):
            store.join("d", "c", A)
        store.delete_dataset("d", None, operator=True)
        for name in ("e", "d"):
            store.create_dataset(DatasetConfig(name, 16, 4), A)
            assert b < store.join(name, "x", A).fence < MAX_FENCE
    finally:
        store.close()
    with sqlite3.connect(db) as c:
        c.execute("UPDATE fence_floors SET floor=? WHERE dataset='e'", (MAX_FENCE,))
        c.execute("UPDATE workers SET fence=? WHERE dataset='d'", (MAX_FENCE,))
    store = ShardStore(db)
    try:
        with pytest.raises(Conflict, match="no fence left"):
            store.join("e", "y", A)
        with pytest.raises(Conflict, match="no fence left"):
            store.join("d", "x", A)
    finally:
        store.close()
