"""What each remedy's advice carries beyond the common fields (`RemedyAdvice.details`), typed.

One Struct per remedy family; `to_dict` writes the JSON form of `stragglers advise --json`.
A field left UNSET is not written (a key the remedy does not have on that path), a None one is
written as null.
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET, UnsetType

from stragglers.trace.jsontypes import JsonObject
from stragglers.whatif.result import Basis, CapacityOption, Interval, Where, plain


class Details(msgspec.Struct, kw_only=True):
    """No details: what a refused remedy carries (written {})."""

    def to_dict(self) -> JsonObject:
        """Plain JSON-ready values, the fields set (NaN/inf become None)."""
        return plain(self, str_keys=True)


class BatchSplit(Details, kw_only=True):
    """antdt-dd: the per-DP-rank batches now and re-split, the split weights, the curves used."""

    batch_sizes: list[int]
    new_batch_sizes: list[int]
    split_weights: list[float]
    compute_curves: list[tuple[float, float]] | None   # None: compute ∝ batch assumed


class Restart(Details, kw_only=True):
    """antdt-nd: the worker to restart, what fixing it buys and what the restart costs."""

    worker: list[int]                   # [dp rank, stage]
    compute_ratio: float                # its compute over the stage's median peer
    fixed_step_s: float
    restart_cost_s: float
    remaining_steps: int | None
    gain_s: float | UnsetType = UNSET   # set once the remaining steps are known
    spec_gain_s: float | UnsetType = UNSET


class DiagnosedDetails(Details, kw_only=True):
    """A fix the diagnosis prices (planned-gc, sequence-balancing, stage-split, expert-balancing).

    The fields are in the order the JSON has always had them: the remedy's own settings sit
    between the diagnosis's speedups and its interval.
    """

    where: Where
    diagnosis_speedup: float | None
    diagnosis_speedup_alone: float | UnsetType = UNSET   # unset: planned-gc's own replay
    every: int | UnsetType = UNSET                       # planned-gc: collect every N steps
    full_pause_s: float | UnsetType = UNSET
    full_per_rank_step: float | UnsetType = UNSET
    # expert-balancing: what each capacity factor buys at the measured routing
    capacity_factor: dict[str, CapacityOption] | None | UnsetType = UNSET
    planned_pause_s: float | UnsetType = UNSET           # planned-gc's own replay
    diagnosis_interval: Interval | UnsetType = UNSET
    diagnosis_upper_bound: bool | UnsetType = UNSET
    diagnosis_basis: Basis | UnsetType = UNSET


class StragglarBucket(msgspec.Struct):
    """One DP all-reduce (gradient bucket) StragglAR would replace."""

    straggler_dp_rank: int
    last_share: float                   # share of steps it was last at this all-reduce
    median_lead_s: float                # how much later it arrives than the others
    library_transfer_s: float
    phase1_s: float
    phase2_s: float


class StragglarDetails(Details, kw_only=True):
    """stragglar: per bucket, the straggler and the phase times (written {"bucket i": ...})."""

    buckets: list[StragglarBucket]

    def to_dict(self) -> JsonObject:
        """{"bucket 0": {...}, ...}: the JSON form advise has always written."""
        return {f"bucket {i}": plain(b) for i, b in enumerate(self.buckets)}


class CodeDetails(Details, kw_only=True):
    """gradient-coding: the stragglers tolerated, the exact code, the aggregator's exchange."""

    s: int
    scheme: str
    exchange_s: float
