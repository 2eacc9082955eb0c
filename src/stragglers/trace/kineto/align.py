"""Align rank clocks on the end times of matched collectives (ends are nearly simultaneous)."""

from __future__ import annotations

import numpy as np

from stragglers.trace.kineto.ops import RING_SYNC
from stragglers.trace.kineto.ringclock import RingIndex, Span, read_ring

# Ends of one collective on different ranks agree to well under this; pairs further apart than
# this from the consensus are mismatched (sampled or filtered traces drop some collectives).
END_TOLERANCE_S = 1e-3
# Sets placed by ring exchanges are moved again against every other rank until none moves by
# more than this (or after this many sweeps).
SETTLED_S, MAX_SWEEPS = 1e-7, 20
# Up to this many ring-placed sets, every run of them is moved together (else single sets and
# the runs to the last placed).
MAX_RUN_SETS = 12


def consensus_offset(diffs: np.ndarray, tolerance: float = END_TOLERANCE_S) -> tuple[float, int]:
    """(median of the largest group of differences within `tolerance`, size of that group)."""
    d = np.sort(diffs)
    # For every i, how many differences lie in [d[i], d[i] + tolerance].
    counts = np.searchsorted(d, d + tolerance, side="right") - np.arange(len(d))
    best = counts.max()
    # Among equally dense windows take the one nearest the overall median.
    candidates = np.flatnonzero(counts == best)
    i = candidates[np.argmin(np.abs(d[candidates] - np.median(d)))]
    return float(np.median(d[i:i + best])), int(best)


def clock_offsets(sync: dict[int, dict[tuple, float]], hosts: dict[int, str | None] | None = None,
                  spans: dict[int, dict[tuple, Span]] | None = None,
                  peers: dict[int, dict[str, tuple[int, int]]] | None = None
                  ) -> tuple[dict[int, float], dict[int, dict], list[str]]:
    """Per-rank clock offsets (seconds, to subtract) so each rank's median end offset is 0.

    sync maps rank → {collective key → end time}. The lowest rank is the reference; a rank that
    shares no collective with it is aligned to the already aligned rank it shares most with.
    The median is taken over the pairs that agree with each other (mismatched pairs from
    sampled traces would otherwise pull it). Ranks whose trace names the same host share one
    clock and are not shifted against each other: there, end times differ only by scheduling
    jitter (milliseconds for gloo on a busy CPU), which would be worse than no correction.
    Returns (offsets, per-rank quality, notes).
    """
    hosts = hosts or {}
    ranks = sorted(sync)
    if not ranks:
        return {}, {}, []
    offsets = {ranks[0]: 0.0}
    quality: dict[int, dict] = {ranks[0]: {"reference": True}}
    notes: list[str] = []
    pending = ranks[1:]
    weak = []
    index = RingIndex(spans, peers or {}) if spans is not None else None
    rings: list[dict[int, float]] = []    # sets placed by the ring: their offsets within the set
    while pending:
        best: tuple[int, int, set[tuple]] | None = None
        for r in pending:
            for a in offsets:
                common = _firm(sync[r].keys() & sync[a].keys())
                if best is None or (_rank(common), len(common)) > (_rank(best[2]),
                                                                    len(best[2])):
                    best = (r, a, common)
        assert best is not None     # pending and offsets are both non-empty here
        r, a, common = best
        pending.remove(r)
        same = next((b for b in offsets if hosts.get(r) and hosts.get(b) == hosts.get(r)), None)
        if same is not None:
            offsets[r] = offsets[same]
            quality[r] = {"same_host_as": same, "host": hosts[r]}
            continue
        if index is not None and common and not _rank(common):
            group = _firm_set(r, pending, sync, hosts)
            inner, inner_q, more = clock_offsets({c: sync[c] for c in group}, hosts)
            d, ring, _ = _ring_offset(inner, offsets, sync, index)
            for c in group:
                if c in pending:
                    pending.remove(c)
                offsets[c] = inner[c] + d
                q = {k: v for k, v in inner_q[c].items() if k != "reference"}
                quality[c] = {**q, "ring": ring, "matched": q.get("matched", ring["rounds"]),
                              "agreeing": q.get("agreeing", ring["explained"])}
            rings.append(inner)
            notes += more
            continue
        if not common:
            offsets[r] = 0.0
            quality[r] = {"matched": 0, "agreeing": 0}
            notes.append(f"rank {r} shares no collective with the other ranks; its clock is "
                         "not aligned")
            continue
        diffs = np.array([sync[r][k] - sync[a][k] for k in common])
        off, agreeing = consensus_offset(diffs)
        offsets[r] = off + offsets[a]
        resid = np.abs(diffs - off)
        quality[r] = {"reference_rank": a, "matched": int(len(common)), "agreeing": agreeing,
                      "median_residual_s": float(np.median(resid[resid <= END_TOLERANCE_S]))}
        if agreeing < max(2, len(common) // 2 + 1):
            weak.append(r)
    if rings:
        assert index is not None
        notes += _refine(rings, offsets, quality, sync, index)
    if weak:
        notes.append(f"clock alignment of {len(weak)} rank(s) (e.g. rank {weak[0]}) rests on few "
                     "agreeing collectives: matched collectives disagree, as in sampled traces")
    return offsets, quality, notes


def _firm(keys: set[tuple]) -> set[tuple]:
    """The keys whose ends all members share; a ring exchange's (ops.RING_SYNC: each rank's
    round ends with its own neighbours') only where there are no others."""
    firm = {k for k in keys if not k or k[0] != RING_SYNC}
    return firm or keys


def _rank(keys: set[tuple]) -> int:
    """1 where `keys` are firm sync points, 0 where ring exchanges only (or none)."""
    return int(any(not k or k[0] != RING_SYNC for k in keys))


def _firm_set(r: int, pending: list[int], sync: dict[int, dict[tuple, float]],
              hosts: dict[int, str | None]) -> list[int]:
    """`r` and the pending ranks linked to it, directly or not, by firm sync points or a host."""
    found, todo = {r}, [r]
    while todo:
        a = todo.pop()
        for b in pending:
            if b not in found and ((hosts.get(a) and hosts.get(a) == hosts.get(b))
                                   or _rank(sync[a].keys() & sync[b].keys())):
                found.add(b)
                todo.append(b)
    return sorted(found)



def _ring_offset(inner: dict[int, float], aligned: dict[int, float],
                 sync: dict[int, dict[tuple, float]], index: RingIndex
                 ) -> tuple[float, dict, str | None]:
    """(offset of the set `inner` against the ranks `aligned`, what it rests on, a note where
    it is loose) from the ring exchanges they share (`ringclock`): of the waits across the two
    sides, the reading that explains the most exchanges; without waits, the middle of the
    causality bounds; where the exchanges bound nothing (no ring neighbour across traced),
    their ends' consensus."""
    got = read_ring(aligned, inner, index)
    lo, hi = got.low, got.high
    bounded = bool(np.isfinite(lo) and np.isfinite(hi) and lo <= hi + END_TOLERANCE_S)
    agreeing, note = 0, None
    ranks = ", ".join(map(str, sorted(inner)))
    if got.waits:
        cands = np.array(got.waits)
        score = got.explained(cands)
        # readings that explain as many exchanges: the transfer times' spread around one offset
        d = float(np.median(cands[score == score.max()]))
        agreeing = int(score.max())
    elif bounded:
        d = (lo + hi) / 2
        if hi - lo > END_TOLERANCE_S:
            note = (f"rank(s) {ranks} meet the others only in ring exchanges, in which no rank "
                    f"waited for the other side: their clock is known to ±"
                    f"{(hi - lo) / 2 * 1e6:.0f} µs (no exchange ends before a neighbour posted)")
    else:
        diffs = np.array([sync[c][k] - inner[c] - (sync[a][k] - aligned[a])
                          for c in inner for a in aligned for k in sync[c].keys() & sync[a].keys()])
        d, agreeing = consensus_offset(diffs) if len(diffs) else (0.0, 0)
        note = (f"rank(s) {ranks} meet the others only in ring exchanges whose neighbours are "
                "not traced: their clock rests on the exchanges' ends, which a slow rank in the "
                "ring moves")
    ring = {"rounds": got.rounds, "waits_read": len(got.waits), "explained": agreeing,
            "exchanges_scored": len(got.scored),
            # None where unbounded: meta.extra is written as JSON
            "bounds_s": [float(b) if np.isfinite(b) else None for b in (lo, hi)]}
    return float(d), ring, note


def _refine(rings: list[dict[int, float]], offsets: dict[int, float], quality: dict[int, dict],
            sync: dict[int, dict[tuple, float]], index: RingIndex) -> list[str]:
    """Move ring-placed sets against all other ranks while that explains more exchanges.

    Placed in turn, a set saw only the neighbours placed before it (in a ring that nothing else
    links every rank is a set of its own), and a set placed against a misplaced one carries
    its error on: so each set, and each run of sets placed one after another (a chain of them
    off by one shift), is moved to the reading that explains the most exchanges, where that
    explains more than where it is (or as many, nearer the middle of the readings that do)."""
    m = len(rings)
    # each run of sets placed one after another (every run where there are few sets)
    runs = [(i, j) for i in range(m) for j in range(i + 1, m + 1)] if m <= MAX_RUN_SETS \
        else [(i, i + 1) for i in range(m)] + [(i, m) for i in range(1, m)]
    moves = [sorted(c for inner in rings[i:j] for c in inner) for i, j in runs
             if j - i < m or i == 0]
    for _ in range(MAX_SWEEPS):
        moved = 0.0
        for members in moves:
            here = {c: offsets[c] for c in members}
            got = read_ring({r: o for r, o in offsets.items() if r not in here}, here, index)
            if not got.waits:
                continue
            cands = np.append(np.array(got.waits), 0.0)
            score = got.explained(cands)
            if score[:-1].max() < score[-1]:
                continue
            d = float(np.median(cands[:-1][score[:-1] == score.max()]))
            for c in members:
                offsets[c] += d
            moved = max(moved, abs(d))
        if moved < SETTLED_S:
            break
    notes = []
    for inner in rings:     # what each set's clock rests on, now that all are placed
        here = {c: offsets[c] for c in inner}
        _, ring, note = _ring_offset(here, {r: o for r, o in offsets.items() if r not in here},
                                     sync, index)
        for c in inner:
            quality[c]["ring"] = ring
        notes += [note] if note else []
    return notes
