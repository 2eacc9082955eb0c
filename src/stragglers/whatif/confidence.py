"""Is a gain real: seeded bootstrap intervals over steps and the one gate (diagnosis, advise)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal, Protocol, overload

import numpy as np

from stragglers.config import Config, setting

MAD_TO_SIGMA = 1.4826  # MAD of a normal sample × this = its standard deviation


class Bootstrap(Protocol):
    """The settings an interval reads: GainTest's, which DiagnosisConfig also carries."""

    @property
    def bootstrap_samples(self) -> int: ...
    @property
    def confidence(self) -> float: ...
    @property
    def seed(self) -> int: ...


class Gate(Bootstrap, Protocol):
    """The settings the gate reads besides the interval's."""

    @property
    def min_gain(self) -> float: ...


# One test for a finding and a remedy (docs/whatif.md §7). The interval answers "real": its
# lower end is clear of the job's step-to-step noise. min_gain answers "worth it", one line
# for both: a remedy that buys less than a cause worth naming is not worth switching on.
# bootstrap_samples sets neither, only how closely the seeded percentiles approach the
# bootstrap's own (at 200 the 5% point's Monte Carlo error is about 0.15 standard errors of
# the mean ratio, against an interval half-width of 1.64 of them); 200 keeps the diagnosis,
# an interval per worker, as cheap as it was.
@dataclass(frozen=True)
class GainTest(Config):
    """When a predicted speedup is real and worth acting on (GAIN: the diagnosis's, advise's)."""

    source = "gain test"

    min_gain: float = setting(
        1.03, "a finding is reported, and a remedy offered, only when its speedup and the lower "
        "end of its speedup interval reach this (what one cause must buy to be worth it); a "
        "finding its detector's own test established (a worker fault among five workers or "
        "more, GC pauses, sequence or expert imbalance) when its speedup reaches this and its interval "
        "lies above 1", minimum=1.0, maximum=2.0)
    confidence: float = setting(0.9, "coverage of the bootstrap intervals (over steps)",
                                minimum=0.5, maximum=0.999)
    bootstrap_samples: int = setting(200, "bootstrap resamples of the steps per interval",
                                     minimum=20, maximum=10000)
    seed: int = setting(0, "seed of the bootstrap (same trace, same intervals)", minimum=0)


# The one gain test: the diagnosis's defaults and advise's gate.
GAIN = GainTest()


@overload
def gain_setting(name: Literal["min_gain", "confidence"]) -> float: ...
@overload
def gain_setting(name: Literal["bootstrap_samples", "seed"]) -> int: ...
def gain_setting(name: str) -> float:
    """GainTest's declaration of a setting (GAIN's default, help, bounds) for DiagnosisConfig."""
    declared = next(f for f in fields(GainTest) if f.name == name)
    return field(default=getattr(GAIN, name), metadata=declared.metadata)


def gain_is_real(gain: float, low: float | None, test: Gate, established: bool = False) -> bool:
    """Whether a gain counts: it and its interval's lower end (None: no interval) reach min_gain.

    `established`: a detector already set the cause apart from noise (a worker that is an
    outlier among five or more); then a gain of at least min_gain whose interval lies above 1
    counts (the bootstrap over a few noisy steps is wide, and its lower end hid such workers).
    """
    low = gain if low is None else min(low, gain)
    if low >= test.min_gain:
        return True
    return established and gain >= test.min_gain and low > 1.0


def step_resamples(steps: int, cfg: Bootstrap) -> np.ndarray:
    """Bootstrap indices [B, T] over steps; seeded, so the same trace gives the same intervals."""
    rng = np.random.default_rng(cfg.seed)
    return rng.integers(0, steps, size=(cfg.bootstrap_samples, steps))


def _bounds(samples: np.ndarray, cfg: Bootstrap) -> tuple[float, float]:
    tail = 100 * (1 - cfg.confidence) / 2
    lo, hi = np.percentile(samples, [tail, 100 - tail], axis=0)
    return float(lo), float(hi)


def ratio_interval(num: np.ndarray, den: np.ndarray, cfg: Bootstrap,
                   strata: np.ndarray | None = None) -> tuple[float, float]:
    """Interval of mean(num)/mean(den), both per step [T], resampling steps.

    strata (bool [T]): an intermittent cause's steps; resampled apart from the others, so each
    resample holds as many affected steps as the trace (the question is how large the effect
    is where it happens, not how often a resample happens to miss it).
    """
    idx = step_resamples(len(num), cfg)
    if strata is not None and 0 < strata.sum() < len(strata):
        rng = np.random.default_rng(cfg.seed)
        parts = []
        for group in (np.flatnonzero(strata), np.flatnonzero(~strata)):
            parts.append(group[rng.integers(0, len(group), size=(cfg.bootstrap_samples,
                                                                  len(group)))])
        idx = np.concatenate(parts, axis=1)
    return _bounds(num[idx].mean(axis=1) / np.maximum(den[idx].mean(axis=1), 1e-300), cfg)


# Bytes of resampled values mean_interval holds at once.
_RESAMPLE_BYTES = 32 * 2**20


def mean_interval(values: np.ndarray, cfg: Bootstrap) -> tuple[np.ndarray, np.ndarray]:
    """Interval of the mean over the last axis (steps) of every row of values [..., T]."""
    idx = step_resamples(values.shape[-1], cfg)
    rows = values.reshape(-1, values.shape[-1])
    means = np.empty((len(rows), len(idx)))
    # a few rows' resamples at a time ([rows, B, T] each: 10,240 workers × 200 × 50 steps
    # would be 0.8 GB at once). Two rows at least: numpy lays a gather of one row out
    # differently, and sums it in another order (the last bits of the means would differ)
    step = max(1, _RESAMPLE_BYTES // max(1, idx.size * 8))
    parts = max(1, min(-(-len(rows) // step), len(rows) // 2))
    for chunk in np.array_split(np.arange(len(rows)), parts):
        lo, hi = int(chunk[0]), int(chunk[-1]) + 1
        means[lo:hi] = rows[lo:hi][:, idx].mean(axis=-1)
    tail = 100 * (1 - cfg.confidence) / 2
    lo, hi = np.percentile(means.reshape(values.shape[:-1] + (len(idx),)),   # [..., B]
                           [tail, 100 - tail], axis=-1)
    return lo, hi


def robust_z(values: np.ndarray, floor: float, norm: np.ndarray | None = None) -> np.ndarray:
    """(x − median) / (1.4826·MAD), the spread floored so identical values stay finite; the
    median and MAD those of `values[norm]` where a mask `norm` is given."""
    values = np.asarray(values, dtype=float)
    flat = (values if norm is None else values[norm]).ravel()
    med = float(np.median(flat))
    scale = max(MAD_TO_SIGMA * float(np.median(np.abs(flat - med))), floor, 1e-12)
    return (values - med) / scale
