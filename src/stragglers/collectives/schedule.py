"""StragglAR phase-2 schedules: data model, synthesisers for any n and a verifier (docs/stragglar.md §2).

Ranks are *logical*: the straggler is S = n-1, the ready ranks are 0..n-2, and chunk g is the
chunk that ready rank g reduced in phase 1. The executor maps logical ranks onto real ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

from stragglers.errors import InputError, StragglersError


class Transfer(NamedTuple):
    """One message of one round: `src` sends chunk `chunk` to `dst`.

    `exchange` marks the straggler exchange: the ready rank sends its phase-1 partial, the
    straggler its raw input, and both add what they receive.
    """

    src: int
    dst: int
    chunk: int
    exchange: bool = False


@dataclass(frozen=True)
class Schedule:
    """The phase-2 schedule for n ranks: a tuple of rounds, each a tuple of transfers."""

    n: int
    rounds: tuple[tuple[Transfer, ...], ...]
    method: str
    note: str = ""
    lower_bound: int = field(default=0)
    # per-rank views, kept on the schedule itself: they live and die with it, so a plan can
    # never be served for another schedule (a cache keyed by id() did, after an eviction)
    _plans: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    @property
    def straggler(self) -> int:
        """The logical rank of the straggler (always n-1)."""
        return self.n - 1

    @property
    def num_chunks(self) -> int:
        """Number of chunks the buffer is split into (n-1)."""
        return self.n - 1

    @property
    def num_rounds(self) -> int:
        """Number of phase-2 rounds."""
        return len(self.rounds)

    def rank_plan(self, rank: int) -> list[tuple[list[Transfer], list[Transfer]]]:
        """Per round, what `rank` sends and what it receives."""
        if not 0 <= rank < self.n:
            raise InputError("stragglar schedule", "rank", f"expected 0..{self.n - 1}, got {rank!r}")
        if rank not in self._plans:
            self._plans[rank] = [([t for t in rnd if t.src == rank], [t for t in rnd if t.dst == rank])
                                 for rnd in self.rounds]
        return self._plans[rank]

    def describe(self) -> str:
        """The schedule in the notation of docs/stragglar.md §2 (a⇄S:k, a→b:k, a⇄b:k/l)."""
        s = self.n - 1
        name = lambda r: "S" if r == s else str(r)  # noqa: E731
        lines = []
        for i, rnd in enumerate(self.rounds):
            parts, done = [], set()
            by_pair = {(t.src, t.dst): t for t in rnd}
            for t in rnd:
                if (t.src, t.dst) in done:
                    continue
                back = by_pair.get((t.dst, t.src))
                if t.exchange:
                    a = t.src if t.dst == s else t.dst
                    parts.append(f"{a}⇄S:{t.chunk}")
                    done |= {(t.src, t.dst), (t.dst, t.src)}
                elif back is not None and not back.exchange:
                    parts.append(f"{name(t.src)}⇄{name(t.dst)}:{t.chunk}/{back.chunk}")
                    done |= {(t.src, t.dst), (t.dst, t.src)}
                else:
                    parts.append(f"{name(t.src)}→{name(t.dst)}:{t.chunk}")
                    done.add((t.src, t.dst))
            lines.append(f"R{i}: " + "  ".join(parts))
        return "\n".join(lines)


def lower_bound_rounds(n: int) -> int:
    """Rounds any phase-2 schedule needs: n-2 exchanges, then ceil(log2 n) doublings of the last chunk."""
    if n < 2:
        return 0
    return n - 2 + math.ceil(math.log2(n))


def _where(i: int, t: Transfer) -> str:
    return f"round {i}, transfer {t.src}->{t.dst} chunk {t.chunk}"


def verify(schedule: Schedule) -> None:
    """Check the schedule; raise StragglersError naming the first violated rule (docs/stragglar.md §2)."""
    n, s = schedule.n, schedule.n - 1
    held: list[set[int]] = [set() for _ in range(n)]  # fully reduced chunks each rank holds
    exchanged = set()
    for i, rnd in enumerate(schedule.rounds):
        senders, receivers, new = set(), set(), []
        exchanges = {(t.src, t.dst): t for t in rnd if t.exchange}
        for t in rnd:
            if not (0 <= t.src < n and 0 <= t.dst < n and t.src != t.dst):
                raise StragglersError(f"{_where(i, t)}: ranks must be distinct and in 0..{n - 1}")
            if not 0 <= t.chunk < n - 1:
                raise StragglersError(f"{_where(i, t)}: chunk must be in 0..{n - 2}")
            if t.src in senders:
                raise StragglersError(f"{_where(i, t)}: rank {t.src} sends twice in one round")
            if t.dst in receivers:
                raise StragglersError(f"{_where(i, t)}: rank {t.dst} receives twice in one round")
            senders.add(t.src)
            receivers.add(t.dst)
            if t.exchange:
                ready = t.src if t.dst == s else t.dst
                if s not in (t.src, t.dst) or ready != t.chunk:
                    raise StragglersError(f"{_where(i, t)}: an exchange is between rank k and S on chunk k")
                back = exchanges.get((t.dst, t.src))
                if back is None or back.chunk != t.chunk:
                    raise StragglersError(f"{_where(i, t)}: exchange without its reverse message")
                if t.src == ready:
                    if t.chunk in exchanged:
                        raise StragglersError(f"{_where(i, t)}: chunk {t.chunk} exchanged twice")
                    new.append((ready, t.chunk))
                    new.append((s, t.chunk))
            elif t.chunk not in held[t.src]:
                raise StragglersError(f"{_where(i, t)}: rank {t.src} does not hold chunk {t.chunk} fully reduced")
            else:
                new.append((t.dst, t.chunk))
        for rank, chunk in new:
            held[rank].add(chunk)
        exchanged |= {c for r, c in new}
    everything = set(range(n - 1))
    for rank in range(n):
        if held[rank] != everything:
            missing = sorted(everything - held[rank])
            raise StragglersError(f"after the last round rank {rank} still lacks chunks {missing[:8]}")


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _exchange(r: int, s: int) -> list[Transfer]:
    return [Transfer(r, s, r, True), Transfer(s, r, r, True)]


def _power_of_two_schedule(n: int) -> list[list[Transfer]]:
    """The optimal n-2+log2(n)-round construction for n a power of two.

    Invariant (docs/stragglar.md §2): after round t the ready ranks are partitioned by the active chunks
    t-L+1..t with sizes n/2..1, and rank m sits in chunk m-L's group when it meets S at round m.
    """
    L = n.bit_length() - 1
    s = n - 1
    if n == 2:
        return [_exchange(0, s)]
    rounds: list[list[Transfer]] = [_exchange(0, s)]
    groups: dict[int, list[int]] = {0: [0]}  # active chunk -> ready ranks holding it
    # Rounds 1..L-1: every holder sends its chunk to a fresh rank; rank r-1+L joins chunk r-1.
    fillers = iter(range(2 * L - 1, n - 1))
    for t in range(1, L):
        rnd = _exchange(t, s)
        for c in sorted(groups):
            for a in list(groups[c]):
                b = c + L if (c == t - 1 and a == c) else next(fillers)
                rnd.append(Transfer(a, b, c))
                groups[c].append(b)
        groups[t] = [t]
        rounds.append(rnd)
    # Rounds L..n-2 (steady) and n-1..n-3+L (S free): the oldest group completes its chunk by
    # swapping with every other group, which doubles; S feeds chunk n-2 once it is free.
    for t in range(L, n - 2 + L):
        oldest = min(groups)
        A = groups.pop(oldest)
        busy = t if t <= n - 2 else None
        free = [a for a in A if a != busy]
        # ranks about to meet S must land in the group of the chunk that will be oldest then
        forced = {a: a - L for a in free if busy is not None and t < a < t + L and a - L in groups}
        capacity = {c: len(g) for c, g in groups.items()}
        if busy is None:
            capacity[n - 2] += 1  # the spare A-rank receives chunk n-2 from S
        assign: dict[int, int] = {}
        for a, c in forced.items():
            assign[a] = c
            capacity[c] -= 1
        # the remaining ranks: soonest to meet S first, into the oldest groups
        rest = sorted((a for a in free if a not in assign), key=lambda a: (a <= t, a))
        slots = [c for c in sorted(capacity) for _ in range(capacity[c])]
        for a, c in zip(rest, slots):
            assign[a] = c
        rnd = _exchange(t, s) if busy is not None else []
        partners = {c: list(g) for c, g in groups.items()}
        s_fed = False
        for a in free:
            c = assign[a]
            if partners[c]:
                b = partners[c].pop()
                rnd.append(Transfer(a, b, oldest))
                rnd.append(Transfer(b, a, c))
            else:  # only chunk n-2 after S is free has this extra slot
                rnd.append(Transfer(s, a, c))
                s_fed = True
            groups[c].append(a)
        if busy is None and not s_fed:
            raise StragglersError(f"power-of-two construction broke at round {t} for n={n}")
        if busy is not None:
            groups[t] = [t]
        rounds.append(rnd)
    return rounds


def _greedy_schedule(n: int, max_rounds: int, chunk_order: str = "fewest", sender_pref: bool = False
                     ) -> list[list[Transfer]] | None:
    """Greedy matching per round for any n: the straggler exchange, then chunk by chunk each free
    holder sends to a free rank that lacks it; None if it needs more than `max_rounds`.

    chunk_order "fewest": chunks with the fewest holders first (they must double to make their
    deadline); "oldest": lowest missing chunk first before S is free, highest after. Receivers
    that meet S soonest pick first. sender_pref: holders of the fewest unfinished chunks send first.
    """
    # Kept per chunk (its holders) and per round (the receivers still free, skipped in O(1)),
    # so a round costs its chunks' holders, not ranks x chunks: n = 1,000 in seconds, not hours.
    s = n - 1
    holders: list[set[int]] = [set() for _ in range(n - 1)]  # chunk -> ranks holding it reduced
    open_held = [0] * n            # rank -> unfinished chunks it holds (sender_pref's key)
    active: set[int] = set()       # unfinished chunks with a holder (the others cannot be sent)
    left = n - 1                   # unfinished chunks
    rounds: list[list[Transfer]] = []
    t = 0
    while left:
        if t >= max_rounds:
            return None
        rnd: list[Transfer] = []
        sent: set[int] = set()
        busy = (t, s) if t <= n - 2 else ()
        if busy:
            rnd += _exchange(t, s)
            sent |= {t, s}
        if chunk_order == "fewest":
            order = sorted(active, key=lambda c: (len(holders[c]), c))
        else:
            order = sorted(active, reverse=t >= n - 1)
        # receivers that meet S soonest first: t+1..n-2, then those done with S, then S itself
        recv = [r for r in range(t + 1, n - 1) if r not in busy] + \
               [r for r in range(min(t + 1, n - 1)) if r not in busy] + ([s] if not busy else [])
        skip = list(range(len(recv) + 1))  # position -> next position whose rank may still receive

        def free_from(i: int) -> int:
            while skip[i] != i:
                skip[i] = skip[skip[i]]
                i = skip[i]
            return i

        for c in order:
            if free_from(0) == len(recv):
                break                     # every rank receives already: nothing more to send
            have = holders[c]
            senders = sorted(have - sent)
            if not senders:
                continue
            if sender_pref:
                senders.sort(key=lambda a: (open_held[a], a))
            takers: list[int] = []
            i = free_from(0)
            while i < len(recv) and len(takers) < len(senders):
                if recv[i] not in have:   # skipped at most once per holder of c
                    takers.append(i)
                i = free_from(i + 1)
            for a, i in zip(senders, takers):
                rnd.append(Transfer(a, recv[i], c))
                sent.add(a)
                skip[i] = i + 1
        for tr in rnd:
            if tr.exchange:
                if tr.src == tr.chunk:
                    holders[tr.chunk] |= {tr.src, s}
                    open_held[tr.src] += 1
                    open_held[s] += 1
                    active.add(tr.chunk)
            else:
                holders[tr.chunk].add(tr.dst)
                open_held[tr.dst] += 1
        for c in [c for c in active if len(holders[c]) == n]:
            active.discard(c)
            left -= 1
            if sender_pref:
                for a in range(n):
                    open_held[a] -= 1
        rounds.append(rnd)
        t += 1
    return rounds


def _best_greedy_schedule(n: int) -> list[list[Transfer]]:
    """The shortest of a few greedy variants (all of them for n <= 128, else the usual winner)."""
    variants = [("fewest", False), ("fewest", True), ("oldest", False), ("oldest", True)]
    if n > 128:
        variants = variants[:1]
    best = None
    for order, pref in variants:
        rounds = _greedy_schedule(n, 4 * n + 8 if best is None else len(best) - 1, order, pref)
        if rounds is not None and (best is None or len(rounds) < len(best)):
            best = rounds
    if best is None:
        raise StragglersError(f"no greedy schedule for n={n} finished in {4 * n + 8} rounds")
    return best


MATCHING_MAX_N = 64  # the matching search costs seconds here; above, the greedy (milliseconds)


def _matching_or_greedy(n: int) -> tuple[list[list[Transfer]], str]:
    greedy = _best_greedy_schedule(n)
    if n > MATCHING_MAX_N or len(greedy) == lower_bound_rounds(n):
        return greedy, "greedy matching"
    from stragglers.collectives.matching import matching_schedule

    best, method = greedy, "greedy matching"
    for width, seed in ((16, 0), (16, 2)) if n <= 32 else ((8, 0),):
        found = matching_schedule(n, width=width, seed=seed, max_rounds=len(best) - 1)
        if found is not None and len(found) < len(best):
            best = [[Transfer(*x) for x in rnd] for rnd in found]
            method = "maximum-weight matching per round"
        if len(best) == lower_bound_rounds(n):
            break
    return best, method


@lru_cache(maxsize=64)
def synthesize(n: int) -> Schedule:
    """The phase-2 schedule for n ranks (cached): the optimal construction for powers of two;
    otherwise the shorter of a maximum-weight matching per round (n <= 64) and a greedy one."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise InputError("stragglar schedule", "n", f"need an integer number of ranks >= 2, got {n!r}")
    bound = lower_bound_rounds(n)
    if _is_power_of_two(n):
        rounds = _power_of_two_schedule(n)
        method, note = "power-of-two construction", ""
    else:
        rounds, method = _matching_or_greedy(n)
        note = (f"n={n} is not a power of two: {method} schedule with {len(rounds)} rounds "
                f"(lower bound {bound})")
        if n % 2:
            note += "; odd n is outside the paper, the greedy schedule is verified but not proven near-optimal"
    sched = Schedule(n, tuple(tuple(r) for r in rounds), method, note, bound)
    verify(sched)
    return sched


PRICED_SYNTHESIS_MAX_N = 512  # the greedy is ~n³ overall (n = 1,000: ~18 s CPU); above, the bound


def phase2_rounds(n: int) -> tuple[int, str]:
    """The phase-2 round count for pricing, and a note where it is not a synthesised schedule's.

    Powers of two: the construction's n-2+log2(n) (it meets the bound, nothing is built); other
    n up to PRICED_SYNTHESIS_MAX_N: the synthesised schedule's; above: the lower bound, noted.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise InputError("stragglar schedule", "n", f"need an integer number of ranks >= 2, got {n!r}")
    bound = lower_bound_rounds(n)
    if _is_power_of_two(n):
        return bound, ""
    if n <= PRICED_SYNTHESIS_MAX_N:
        return synthesize(n).num_rounds, ""
    return bound, (f"phase 2 priced at the lower bound of {bound} rounds: schedules are synthesised "
                   f"for pricing up to {PRICED_SYNTHESIS_MAX_N} ranks (n={n}); the greedy one needed "
                   f"4-5% more rounds at n = 400 and 1,000, so phase 2 may be that much longer")
