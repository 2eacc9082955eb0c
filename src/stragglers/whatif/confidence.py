"""Intervals and outlier tests for the diagnosis: seeded bootstrap over steps, robust z-scores."""

from __future__ import annotations

import numpy as np

from stragglers.whatif.config import DiagnosisConfig

MAD_TO_SIGMA = 1.4826  # MAD of a normal sample × this = its standard deviation


def step_resamples(steps: int, cfg: DiagnosisConfig) -> np.ndarray:
    """Bootstrap indices [B, T] over steps; seeded, so the same trace gives the same intervals."""
    rng = np.random.default_rng(cfg.seed)
    return rng.integers(0, steps, size=(cfg.bootstrap_samples, steps))


def _bounds(samples: np.ndarray, cfg: DiagnosisConfig) -> tuple[float, float]:
    tail = 100 * (1 - cfg.confidence) / 2
    lo, hi = np.percentile(samples, [tail, 100 - tail], axis=0)
    return float(lo), float(hi)


def ratio_interval(num: np.ndarray, den: np.ndarray, cfg: DiagnosisConfig,
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


def mean_interval(values: np.ndarray, cfg: DiagnosisConfig) -> tuple[np.ndarray, np.ndarray]:
    """Interval of the mean over the last axis (steps) of every row of values [..., T]."""
    idx = step_resamples(values.shape[-1], cfg)
    means = values[..., idx].mean(axis=-1)          # [..., B]
    tail = 100 * (1 - cfg.confidence) / 2
    lo, hi = np.percentile(means, [tail, 100 - tail], axis=-1)
    return lo, hi


def robust_z(values: np.ndarray, floor: float) -> np.ndarray:
    """(x − median) / (1.4826·MAD), the spread floored so identical values stay finite."""
    flat = np.asarray(values, dtype=float).ravel()
    med = float(np.median(flat))
    scale = max(MAD_TO_SIGMA * float(np.median(np.abs(flat - med))), floor, 1e-12)
    return (np.asarray(values, dtype=float) - med) / scale
