"""α–β cost model of AllReduce algorithms with a late rank (docs/stragglar.md §3).

α is the per-message latency (s), β the time per byte (s/B), s the buffer size (B) and D how
long after the others the straggler reaches the collective (s). All times include D, so they
compare what the ready ranks see: time from their arrival until the result is everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from stragglers.errors import InputError
from stragglers.protocols import ALLREDUCE_ALGORITHMS

ALGORITHMS = ("ring", "halving_doubling", "tree", "stragglar")


@dataclass(frozen=True)
class LinkModel:
    """The α–β parameters of one backend/link: α seconds per message, β seconds per byte."""

    alpha: float
    beta: float

    @classmethod
    def from_bandwidth(cls, alpha: float, bytes_per_second: float) -> "LinkModel":
        """A link with latency `alpha` and bandwidth `bytes_per_second`."""
        return cls(alpha, 1.0 / bytes_per_second)


def _check(n: int, size: float, delay: float) -> None:
    if not isinstance(n, int) or n < 2:
        raise InputError("cost model", "n", f"need an integer number of ranks >= 2, got {n!r}")
    if size < 0:
        raise InputError("cost model", "size", f"need a size in bytes >= 0, got {size!r}")
    if delay < 0:
        raise InputError("cost model", "delay", f"need a straggler delay >= 0 s, got {delay!r}")


def ring_time(n: int, size: float, link: LinkModel, delay: float = 0.0) -> float:
    """Ring AllReduce: 2(n-1) messages of s/n bytes, started when the straggler arrives."""
    _check(n, size, delay)
    return delay + 2 * (n - 1) * link.alpha + 2 * (n - 1) / n * size * link.beta


def halving_doubling_time(n: int, size: float, link: LinkModel, delay: float = 0.0) -> float:
    """Recursive halving/doubling (Rabenseifner); for n not a power of two the extra ranks fold
    their whole buffer into a partner before and receive the result after (two more full messages)."""
    _check(n, size, delay)
    p = 1 << (n.bit_length() - 1)
    t = 2 * math.log2(p) * link.alpha + 2 * (p - 1) / p * size * link.beta
    if p != n:
        t += 2 * (link.alpha + size * link.beta)
    return delay + t


def tree_time(n: int, size: float, link: LinkModel, delay: float = 0.0) -> float:
    """Binomial-tree reduce then broadcast of the whole buffer (no pipelining): 2⌈log2 n⌉ (α + sβ)."""
    _check(n, size, delay)
    return delay + 2 * math.ceil(math.log2(n)) * (link.alpha + size * link.beta)


def reduce_scatter_time(m: int, size: float, link: LinkModel) -> float:
    """Ring ReduceScatter among m ranks: (m-1)α + (m-1)/m · sβ (StragglAR phase 1, m = n-1)."""
    if m <= 1:
        return 0.0
    return (m - 1) * link.alpha + (m - 1) / m * size * link.beta


def stragglar_phase2_time(n: int, size: float, link: LinkModel, rounds: int | None = None) -> float:
    """Phase 2: R rounds of one chunk of s/(n-1) bytes; R by default from `schedule.phase2_rounds`
    (the synthesised schedule's, or the lower bound where building it would cost minutes)."""
    _check(n, size, 0.0)
    if rounds is None:
        from stragglers.collectives.schedule import phase2_rounds

        rounds = phase2_rounds(n)[0]
    return rounds * (link.alpha + size / (n - 1) * link.beta)


def stragglar_time(n: int, size: float, link: LinkModel, delay: float = 0.0,
                   rounds: int | None = None) -> float:
    """StragglAR: max(D, T_RS(n-1)) + T_phase2 — phase 1 hides in the straggler's delay."""
    _check(n, size, delay)
    return max(delay, reduce_scatter_time(n - 1, size, link)) + stragglar_phase2_time(n, size, link, rounds)


@dataclass(frozen=True)
class PricedAllReduce:
    """An all-reduce algorithm of the cost model (the `AllReduceAlgorithm` protocol)."""

    name: str
    model: Callable[[int, float, LinkModel, float], float]  # (n, size, link, delay) -> seconds

    def time(self, n: int, size: float, link: LinkModel, delay: float = 0.0) -> float:
        """α–β time in seconds of an all-reduce of `size` bytes on n ranks, straggler `delay` late."""
        return self.model(n, size, link, delay)


for _name, _model in (("ring", ring_time), ("halving_doubling", halving_doubling_time),
                      ("tree", tree_time), ("stragglar", stragglar_time)):
    ALLREDUCE_ALGORITHMS.register(_name)(PricedAllReduce(_name, _model))


def algorithm_time(name: str, n: int, size: float, link: LinkModel, delay: float = 0.0) -> float:
    """The time of the algorithm registered as `name` in ALLREDUCE_ALGORITHMS."""
    return ALLREDUCE_ALGORITHMS.get(name, "algorithm").time(n, size, link, delay)


def break_even_delay(n: int, size: float, link: LinkModel) -> float:
    """The delay above which StragglAR beats Ring (solved exactly from the model, not the
    (log2 n - 2)α + (log2 n / n)sβ approximation)."""
    _check(n, size, 0.0)
    t_ring = ring_time(n, size, link)
    t_p2 = stragglar_phase2_time(n, size, link)
    t_rs = reduce_scatter_time(n - 1, size, link)
    # StragglAR - Ring = max(D, T_RS) + T_p2 - D - T_ring; for D >= T_RS this is T_p2 - T_ring.
    if t_p2 >= t_ring:
        return math.inf
    return max(0.0, t_rs + t_p2 - t_ring)


def speedup_over_ring(n: int, size: float, link: LinkModel, delay: float | None = None) -> float:
    """Ring time / StragglAR time; delay=None means phase 1 fully hidden (docs/stragglar.md §3)."""
    if delay is None:
        return ring_time(n, size, link) / stragglar_phase2_time(n, size, link)
    return ring_time(n, size, link, delay) / stragglar_time(n, size, link, delay)


PAPER_LINK = LinkModel.from_bandwidth(3e-6, 450 * 2**30)
"""The paper's reference link: α = 3 µs, 1/β = 450 GiB/s."""
