"""Point-to-point exchanges that are no pipeline: ring attention's K/V passed around a ring.

Context parallelism's ring attention sends each rank's K/V chunk to the next rank of its group
and receives the previous rank's, one grouped launch (`batch_isend_irecv`) per round. Read as
pipeline transfers, a ring of two looks like a two-stage pipeline and a longer ring like a
cycle (no layout), and either way the ranks' waits for a slow peer became compute of their own.

What tells them apart is the first transfer of a step: a pipeline rank either sends an
activation it has not received anything for yet (the first stage) or receives one before it
has anything to send (every other stage), so it stands alone; a ring round sends and receives
at once from its start. A process group whose every send and receive, on every rank and in
every step, overlaps one of the other direction is an exchange group; each such pair becomes
one `exchange` op that synchronises the group, as a collective does. A ring's rank waits for
its two neighbours only, but over the cp - 1 rounds a late rank reaches them all (the README's
known limits: the diagnoses and gains measured the same); its ends, though, are not one
instant in a ring of three or more (each rank's round ends with its own neighbours' transfers).
"""

from __future__ import annotations

from collections import defaultdict

from stragglers.trace.kineto.ops import Coll, RankParts

EXCHANGE = "exchange"


def _pairs(ops: list[Coll]) -> list[tuple[Coll, Coll]] | None:
    """The (first, second) send/recv pairs of one rank's ops of one group in one step, in launch
    order, when every op overlaps one of the other direction; None when one stands alone."""
    ops = sorted(ops, key=lambda c: (c.launch, c.start))
    out: list[tuple[Coll, Coll]] = []
    used = [False] * len(ops)
    for i, a in enumerate(ops):
        if used[i]:
            continue
        for j in range(i + 1, len(ops)):
            b = ops[j]
            if not used[j] and b.kind != a.kind and a.start < b.end and b.start < a.end:
                used[i] = used[j] = True
                out.append((a, b))
                break
        else:
            return None
    return out


def merge_exchanges(parts: dict[int, RankParts]) -> set[str | None]:
    """Replace the send/recv pairs of exchange groups (see the module's docstring) with one
    `exchange` op each, in place; returns the groups so read (None: ops without a group)."""
    by_key: dict[tuple[str | None, int, int], list[Coll]] = defaultdict(list)
    for rank, p in parts.items():
        for c in p.colls:
            if c.kind in ("send", "recv"):
                by_key[(c.pg, rank, c.step)].append(c)
    pairs: dict[tuple[str | None, int, int], list[tuple[Coll, Coll]]] = {}
    alone: set[str | None] = set()
    for key, ops in by_key.items():
        found = _pairs(ops)
        if found is None:
            alone.add(key[0])
        else:
            pairs[key] = found
    groups = {pg for pg, _, _ in by_key} - alone
    if not groups:
        return set()
    mine: dict[int, list[tuple[Coll, Coll]]] = defaultdict(list)   # rank → its pairs
    for (pg, rank, _), found in pairs.items():
        if pg in groups:
            mine[rank] += found
    for rank, found in mine.items():
        merged = {id(c) for pair in found for c in pair}
        p = parts[rank]
        p.colls = sorted([c for c in p.colls if id(c) not in merged]
                         + [_merged(a, b) for a, b in found], key=lambda c: (c.step, c.start))
    return groups


def _merged(a: Coll, b: Coll) -> Coll:
    """One exchange op spanning a send/recv pair (matched across ranks by the pair's first
    sequence number, or by its order in the group and step), from the receive's source to the
    send's destination."""
    seq = min(a.seq, b.seq) if a.seq is not None and b.seq is not None else None
    send, recv = (a, b) if a.kind == "send" else (b, a)
    # its peers (where the trace names them): the ring neighbours the clock alignment reads
    return Coll(start=min(a.start, b.start), end=max(a.end, b.end),
                launch=min(a.launch, b.launch), step=a.step, kind=EXCHANGE, pg=a.pg, seq=seq,
                src=recv.src, dst=send.dst)
