"""Fence floors: a data set's fences never repeat, across its workers' places and its deletes.

A data set's floor (table fence_floors, a row by name) is above every fence of a worker name
that gave its place and of a deleted data set of its name; its new worker names start above
it. The floors of the oldest deleted names fold into one, the store floor (row STORE_FLOOR),
and their names into a Bloom filter (table fence_folds) that says which names it may cover.
A damaged floor refuses only what it stands for (Quarantined, nothing written), never lets an
old fence through, and leaves every other data set and name served as before.
"""

from __future__ import annotations

import hashlib
import sqlite3
from typing import TypeGuard

from stragglers.adapt.dataset import MAX_FENCE
from stragglers.adapt.errors import Conflict, Quarantined

# The fence_floors row of the oldest deleted names, folded into one (no data set is named so:
# see dataset.NAME_PATTERN). A data set takes it into a row of its own when it is created (a
# name folded into it may be the new one's), so only creations read it.
STORE_FLOOR = "*"
# The folded names' filter: a name it does not hold was never folded (a damaged store floor
# does not cover it); one it holds may have been (1 in ~200 of the others at 10,000 names).
# No row: nothing was folded since the file had the table (a file upgraded with a store floor
# has one of NULL: its names unknown). Any one damaged row is thus never an old fence let
# through: a damaged floor with a sound filter, or a sound floor (the filter then unread).
FOLD_BITS = 1 << 17
FOLD_HASHES = 4
# A floor raised to `excluded.floor`; a damaged one stays as it is (MAX of -1 or 'x' with a
# fence wrote a floor that looked sound and was not: the fences it stood for were lost).
_RAISE = ("INSERT INTO fence_floors VALUES (?,?) ON CONFLICT (dataset) DO UPDATE SET floor ="
          f" CASE WHEN typeof(floor) = 'integer' AND floor BETWEEN 0 AND {MAX_FENCE} THEN"
          " MAX(floor, excluded.floor) ELSE floor END")
# A fence a kept floor may be raised to (a stored one past MAX_FENCE is damaged: its data set
# quarantined, never a floor; 2^63-1 kept made every new name's fence 2^63, a 500 for good)
_SOUND_FENCE = f"typeof(fence) = 'integer' AND fence BETWEEN 1 AND {MAX_FENCE}"


def sound_floor(floor: object) -> TypeGuard[int]:
    """Whether a stored fence floor reads as one (an integer 0..MAX_FENCE)."""
    return type(floor) is int and 0 <= floor <= MAX_FENCE


def raise_fence_floor(c: sqlite3.Connection, name: str, fence: int) -> None:
    """Raise data set `name`'s fence floor to `fence` (a damaged floor is left damaged)."""
    c.execute(_RAISE, (name, fence))


def pin_fence_floor(c: sqlite3.Connection, name: str) -> int:
    """Data set `name`'s fence floor, a row of its own written where it has none: the store
    floor where its name may be one folded into it, else 0; Quarantined, nothing written,
    where the floor it needs is damaged (only then: a data set with a sound row of its own,
    or a name the filter proves never folded, does not read the store floor)."""
    row = c.execute("SELECT floor FROM fence_floors WHERE dataset=?", (name,)).fetchone()
    if row is not None:
        if not sound_floor(row[0]):
            raise Quarantined(f"data set '{name}': its stored fence floor is damaged (floor="
                              f"{row[0]!r:.40}, expected an integer 0..{MAX_FENCE}): new"
                              " worker names cannot be given fences above its deleted"
                              " incarnations'; other data sets are not affected (restore the"
                              " file from a backup)")
        return row[0]
    floor = _store_floor(c)
    if not sound_floor(floor):
        if _maybe_folded(c, name):
            seen = "missing" if floor is _MISSING else f"floor={floor!r:.40}"
            raise Quarantined(f"data set '{name}' has no fence floor of its own, its name may"
                              " be one of the deleted data sets' folded into the store's"
                              f" (fence_floors row '{STORE_FLOOR}'), and that is damaged ({seen},"
                              f" expected an integer 0..{MAX_FENCE}): its new"
                              " workers' fences cannot be put above theirs; names never folded"
                              f" and data sets with a floor of their own are not affected (set"
                              f" row '{STORE_FLOOR}' to the highest fence a deleted data set's"
                              " workers held, or restore the file from a backup)")
        floor = 0   # (never folded, no row of its own: no deleted fences to stay above)
    c.execute("INSERT INTO fence_floors VALUES (?,?)", (name, floor))
    return floor


def next_fence(name: str, worker: str, fence: int) -> int:
    """The fence after `fence` (a join's, or a new name's above its floor); Conflict past
    MAX_FENCE (no request can carry it: the worker could never call again)."""
    if fence >= MAX_FENCE:
        raise Conflict(f"worker '{worker}' of data set '{name}' has no fence left (fences end at"
                       f" {MAX_FENCE}); join with another name")
    return fence + 1


def keep_fence_floor(c: sqlite3.Connection, name: str, key: str, max_kept: int) -> None:
    """Raise data set `name`'s fence floor to its workers' fences, before it is deleted: the
    floor outlives it, so a data set created again under its name starts its fences above
    every fence of the deleted one (they started at 1 again: a stuck holder was current).
    Past `max_kept` rows by name, the oldest deleted names' floors go into STORE_FLOOR."""
    high = c.execute("SELECT MAX(fence) FROM workers WHERE dataset=? AND " + _SOUND_FENCE,
                     (name,)).fetchone()[0]
    row = c.execute("SELECT floor FROM fence_floors WHERE dataset=?", (name,)).fetchone()
    if row is not None and not sound_floor(row[0]):
        # a damaged floor (a quarantined data set's delete): above every fence its rows
        # (under `key`) hold instead, read this once (one data set's rows, a rare path)
        held = c.execute("SELECT MAX(fence) FROM shards WHERE dataset=? AND " + _SOUND_FENCE,
                         (key,)).fetchone()[0]
        high = max((v for v in (high, held) if v is not None), default=0)
        c.execute("UPDATE fence_floors SET floor=? WHERE dataset=?", (high, name))
    elif high is not None:   # (no worker ever joined: no row, none kept for it)
        raise_fence_floor(c, name, high)
    # (names created and deleted in a loop would each keep a row: the file grew without bound)
    over = c.execute("SELECT COUNT(*) FROM fence_floors WHERE dataset != ?",
                     (STORE_FLOOR,)).fetchone()[0] - max_kept
    # Neither into a damaged store floor (the names' rows are kept: their floors are proven,
    # and while it is damaged no name it may cover can be created, so none are added in a
    # loop; a lost one written anew would hold only the new names' fences) nor from a damaged
    # row (its name's creation stays refused, not let past its fences)
    if over > 0 and sound_floor(_store_floor(c)):
        fold = c.execute("SELECT rowid, dataset, floor FROM fence_floors f WHERE dataset != ?"
                         f" AND typeof(floor) = 'integer' AND floor BETWEEN 0 AND {MAX_FENCE}"
                         " AND NOT EXISTS (SELECT 1 FROM datasets d WHERE d.name = f.dataset)"
                         " ORDER BY rowid LIMIT ?", (STORE_FLOOR, over)).fetchall()
        if fold:
            _note_folded(c, [n for _, n, _ in fold])
            raise_fence_floor(c, STORE_FLOOR, max(f for _, _, f in fold))
            c.executemany("DELETE FROM fence_floors WHERE rowid=?", [(r,) for r, _, _ in fold])


# the store floor's row lost while the filter says names were folded into it (a damaged file
# loses rows too): damaged, never 0 (read as 0, a folded name's deleted fences came back)
_MISSING = object()


def _store_floor(c: sqlite3.Connection) -> object:
    """The store floor: 0 where there is none and nothing was folded, _MISSING where there is
    none though the filter has a row (damaged), else the stored value (checked by the caller)."""
    row = c.execute("SELECT floor FROM fence_floors WHERE dataset=?", (STORE_FLOOR,)).fetchone()
    if row is None:
        return _MISSING if _filter(c)[0] else 0
    return row[0]


def _bits(name: str) -> list[int]:
    """The filter's bits of `name`."""
    digest = hashlib.sha256(name.encode()).digest()
    return [int.from_bytes(digest[4 * i:4 * i + 4], "big") % FOLD_BITS
            for i in range(FOLD_HASHES)]


def _filter(c: sqlite3.Connection) -> tuple[bool, bytes | None]:
    """(whether a filter row exists, its bits; None where they are unknown or damaged)."""
    row = c.execute("SELECT names FROM fence_folds WHERE id = 0").fetchone()
    if row is None:
        return False, None
    sound = isinstance(row[0], bytes) and len(row[0]) == FOLD_BITS // 8
    return True, row[0] if sound else None


def _note_folded(c: sqlite3.Connection, names: list[str]) -> None:
    """Add `names` to the folded names' filter (one whose names are unknown stays so)."""
    exists, bits = _filter(c)
    if exists and bits is None:
        return
    out = bytearray(bits or bytes(FOLD_BITS // 8))
    for name in names:
        for b in _bits(name):
            out[b >> 3] |= 1 << (b & 7)
    c.execute("INSERT OR REPLACE INTO fence_folds VALUES (0, ?)", (bytes(out),))


def _maybe_folded(c: sqlite3.Connection, name: str) -> bool:
    """Whether `name` may be one folded into the store floor (False: provably never)."""
    exists, bits = _filter(c)
    if not exists:
        return False
    return bits is None or all(bits[b >> 3] >> (b & 7) & 1 for b in _bits(name))
