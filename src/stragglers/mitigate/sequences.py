"""Redistribute packed sequences across DP ranks and microbatches to balance Σ sᵢ²."""

from __future__ import annotations

import heapq
import operator
import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence

from stragglers.errors import InputError


def attention_cost(length: int) -> float:
    """Default cost of one sequence: s², the attention term that makes packing uneven."""
    return float(length) * float(length)


@dataclass
class SequencePlan:
    """Which sequences (indices into the input) each (DP rank, microbatch) gets, and its cost."""

    bins: list[list[list[int]]]  # bins[dp][mb] -> sequence indices
    cost: list[list[float]]
    tokens: list[list[int]]
    notes: list[str] = field(default_factory=list)

    @property
    def imbalance(self) -> float:
        """Max bin cost over mean bin cost (1.0 is perfect)."""
        flat = [c for row in self.cost for c in row]
        mean = sum(flat) / len(flat)
        return max(flat) / mean if mean > 0 else 1.0


def balance_sequences(seq_lens: Sequence[int], dp_size: int, num_microbatches: int,
                      cost: Callable[[int], float] = attention_cost,
                      max_tokens: int | None = None) -> SequencePlan:
    """Assign sequences to dp_size × num_microbatches bins so bin costs are as equal as possible.

    Longest-processing-time greedy: sequences by falling cost, each to the currently cheapest
    bin that still has room for its tokens (within 4/3 of the optimum for the max bin cost).
    Every DP rank must call it with the same input to get the same plan.
    """
    if dp_size < 1 or num_microbatches < 1:
        raise InputError("balance_sequences", "dp_size" if dp_size < 1 else "num_microbatches",
                         "expected a positive integer")
    # integers (numpy's and one-element integer tensors too): int() truncated 2.7 and failed
    # with a bare ValueError on NaN or 'a'
    lens = []
    for s in seq_lens:
        try:
            lens.append(operator.index(s))
        except TypeError:
            raise InputError("balance_sequences", "seq_lens", f"expected integer lengths >= 1, "
                             f"got {s!r:.40}") from None
    if any(s < 1 for s in lens):
        raise InputError("balance_sequences", "seq_lens", "expected lengths >= 1")
    if max_tokens is not None and lens and max(lens) > max_tokens:
        raise InputError("balance_sequences", "seq_lens", f"a sequence of {max(lens)} tokens "
                         f"exceeds max_tokens={max_tokens}")
    n_bins = dp_size * num_microbatches
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    bin_cost = [0.0] * n_bins
    bin_tokens = [0] * n_bins
    notes: list[str] = []
    heap = [(0.0, b) for b in range(n_bins)]
    order = sorted(range(len(lens)), key=lambda i: (-cost(lens[i]), i))
    for i in order:
        popped = []
        while heap:
            c, b = heapq.heappop(heap)
            if max_tokens is None or bin_tokens[b] + lens[i] <= max_tokens:
                break
            popped.append((c, b))
        else:
            # No bin has room: the fewest-token bin takes it, and the caller is told.
            b = min(range(n_bins), key=lambda k: bin_tokens[k])
            popped = [p for p in popped if p[1] != b]
            notes.append(f"sequence {i} ({lens[i]} tokens) did not fit any bin under "
                         f"max_tokens={max_tokens}; put in bin {b}, which now exceeds it")
        bins[b].append(i)
        bin_cost[b] += cost(lens[i])
        bin_tokens[b] += lens[i]
        heapq.heappush(heap, (bin_cost[b], b))
        for p in popped:
            heapq.heappush(heap, p)
    for note in notes:
        warnings.warn(f"balance_sequences: {note}", stacklevel=2)
    shape = lambda xs: [xs[d * num_microbatches:(d + 1) * num_microbatches] for d in range(dp_size)]  # noqa: E731
    return SequencePlan(shape(bins), shape(bin_cost), shape(bin_tokens), notes)
