"""Every threshold of the diagnosis, named once (contract in whatif/README.md)."""

from __future__ import annotations

from dataclasses import dataclass

from stragglers.config import Config, setting
from stragglers.whatif.confidence import gain_setting

# A job is straggling when S ≥ 1.1 (docs/whatif.md §7). Reports import this one constant.
STRAGGLING_SLOWDOWN = 1.1
# Attribution (by op type, stage, DP rank) is computed from this S on (docs/whatif.md §7).
DECOMPOSE_SLOWDOWN = 1.03


@dataclass(frozen=True)
class DiagnosisConfig(Config):
    """Thresholds of the diagnosis: which causes are reported and how predictions are bounded."""

    source = "diagnosis config"

    straggling_slowdown: float = setting(
        STRAGGLING_SLOWDOWN, "S at or above this: the job is straggling (docs/whatif.md §7)",
        minimum=1.0, maximum=10.0)
    # the gain test's settings, declared once (whatif/confidence.py GainTest, shared with advise)
    min_gain: float = gain_setting("min_gain")
    confidence: float = gain_setting("confidence")
    bootstrap_samples: int = gain_setting("bootstrap_samples")
    seed: int = gain_setting("seed")
    # --- worker fault and host stall ---------------------------------------------------
    worker_min_excess: float = setting(
        0.15, "with fewer than five workers (no outlier test possible), a faulty worker's busy "
        "compute per step exceeds its stage peers' median by at least this fraction (lower end "
        "of its interval); with five or more the outlier test decides", minimum=0.01,
        maximum=10.0)
    outlier_z: float = setting(
        6.0, "a named worker stands out from all workers by this many robust standard "
        "deviations (1.4826·MAD) of the per-worker ratio", minimum=1.0, maximum=100.0)
    outlier_scale_floor: float = setting(
        0.01, "smallest robust spread of per-worker ratios assumed (so identical healthy "
        "workers do not make a tiny difference look like an outlier)", minimum=0.0, maximum=1.0)
    stall_min_seconds: float = setting(
        0.0, "a host stall must add at least this many seconds per step (besides the relative "
        "test against the step time)", minimum=0.0)
    stall_min_fraction: float = setting(
        0.03, "a host-stalling worker loses at least this fraction of the median step time "
        "per step to launch delays beyond its peers'", minimum=0.0, maximum=1.0)
    # --- stage imbalance ---------------------------------------------------------------
    stage_min_excess: float = setting(
        0.05, "the heaviest stage computes at least this fraction more per step than the mean "
        "stage (lower end of its interval)", minimum=0.0, maximum=10.0)
    # --- sequence imbalance ------------------------------------------------------------
    seq_corr: float = setting(
        0.9, "forward and backward of the same microbatch correlate at least this much "
        "(docs/whatif.md §7)", minimum=0.0, maximum=1.0)
    seq_fit: float = setting(
        0.6, "or: a microbatch's compute correlates with its recorded Σs² at least this much",
        minimum=0.0, maximum=1.0)
    seq_cv: float = setting(
        0.1, "coefficient of variation of microbatch compute within a worker and step",
        minimum=0.0, maximum=10.0)
    # --- expert imbalance (MoE) ---------------------------------------------------------
    expert_corr: float = setting(
        0.8, "the compute after an all-to-all dispatch correlates with the rows each rank "
        "received at least this much (across the group's ranks, each step's mean taken out); "
        "also the bar an all-to-all's transfer must meet against the rows each rank moved "
        "to be priced at balanced volume",
        minimum=0.0, maximum=1.0)
    expert_min_excess: float = setting(
        0.1, "the busiest rank of an expert-parallel group receives at least this fraction "
        "more rows than the group's mean (mean over steps)", minimum=0.0, maximum=100.0)
    # --- GC ------------------------------------------------------------------------------
    gc_pause_fraction: float = setting(
        0.2, "a gc row counts as a pause when it lasts this fraction of the longest one",
        minimum=0.0, maximum=1.0)
    gc_outlier_z: float = setting(
        8.0, "without gc rows: a compute op is a pause when its log duration exceeds the same "
        "op's median on the same worker by this many robust deviations", minimum=1.0,
        maximum=100.0)
    gc_min_excess: float = setting(
        0.25, "without gc rows: a pause adds at least this fraction of the op's median "
        "duration", minimum=0.0, maximum=100.0)
    gc_max_rate: float = setting(
        0.1, "without gc rows: pauses are rare, at most this fraction of compute ops",
        minimum=0.0, maximum=1.0)
    gc_max_bound: float = setting(
        0.5, "without gc rows: at most this fraction of the outliers that chance does not "
        "already put beside an outlier of the same microbatch elsewhere may sit there (else "
        "it is sequence imbalance)", minimum=0.0, maximum=1.0)
    # --- communication -----------------------------------------------------------------
    comm_min_ratio: float = setting(
        2.0, "a slow link's transfers take at least this multiple of their op type's median",
        minimum=1.0, maximum=1000.0)
    comm_min_share: float = setting(
        0.5, "workers whose excess transfer time reaches this fraction of the worst worker's "
        "are part of the slow link", minimum=0.0, maximum=1.0)
    contention_explains: float = setting(
        0.5, "a slow link whose transfers' lateness lies at least this fraction within their "
        "threads' waits for a CPU (recorded cpu_wait) is reported as cpu_contention",
        minimum=0.0, maximum=1.0)
    intermittent_fraction: float = setting(
        0.5, "a slowdown seen on fewer than this fraction of steps is intermittent: its steps "
        "are named", minimum=0.0, maximum=1.0)
    intermittent_step_share: float = setting(
        0.5, "a step is one of an intermittent slowdown's steps when its effect there reaches "
        "this fraction of the largest step's", minimum=0.0, maximum=1.0)
    # --- noise floor and warm-up -------------------------------------------------------
    noise_draws: int = setting(
        2, "replays of i.i.d. jitter of the measured size that estimate the noise floor of S",
        minimum=1, maximum=50)
    noise_margin: float = setting(
        0.02, "S within this of the noise floor counts as noise (verdict none)",
        minimum=0.0, maximum=1.0)
    warmup_factor: float = setting(
        1.5, "a leading step slower than this multiple of the median step is warm-up",
        minimum=1.0, maximum=100.0)
    warmup_max_fraction: float = setting(
        0.25, "at most this fraction of the steps may be dropped as warm-up",
        minimum=0.0, maximum=0.9)


DEFAULT = DiagnosisConfig()
