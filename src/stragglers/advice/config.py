"""`AdviseConfig`: what the trace cannot tell and a remedy's price depends on (all optional).

Light on purpose (no numpy, no what-if engine): the command line builds its options from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from stragglers.collectives.cost_model import LinkModel
from stragglers.config import Config, setting
from stragglers.errors import InputError

MAX_KNOB_SECONDS = 1e7   # the adapt service's bound on a restart's cost (adapt/requests.py)


@dataclass(frozen=True)
class AdviseConfig(Config):
    """The job's knobs for `advise`: prices the trace cannot give (refused with their name)."""

    link: LinkModel | None = setting(
        None, "calibrated α–β of the DP collective's backend (load_calibration)")
    global_batch: int | None = setting(None, "samples (or tokens) per global step (DD's split)",
                                       minimum=1)
    batch_sizes: Sequence[int] | None = setting(
        None, "current per-DP-rank batch (default: equal)")
    remaining_steps: int | None = setting(None, "steps the job still runs (prices ND)",
                                          minimum=0)
    restart_cost_s: float | None = setting(None, "seconds one restart costs (ND)", minimum=0.0,
                                           maximum=MAX_KNOB_SECONDS, flag="--restart-cost")
    devices: Mapping[int, str] | None = setting(
        None, "DP rank -> device type (a deterministic straggler's device differs)")
    max_s: int = setting(2, "price gradient codes s = 1 .. this", minimum=1, maximum=16,
                         flag="--s")
    threshold: float = setting(0.6, "StragglAR: a rank last in this share of the steps is a "
                               "persistent straggler", minimum=0.0, maximum=1.0)
    # Measured in the job by a calibration step (examples/train_advised.py --calibrate); the
    # run's meta.json `extra.calibration` gives them when these are unset.
    compute_curves: Sequence[tuple[float, float]] | None = setting(
        None, "per DP rank: forward+backward seconds = fixed + per_sample × batch (DD)")
    gc_sync_pause_s: float | None = setting(
        None, "one full collection with every rank collecting at once (planned GC's price)",
        minimum=0.0, maximum=MAX_KNOB_SECONDS)

    def __post_init__(self) -> None:
        if isinstance(self.link, Mapping):   # as to_dict() writes it (YAML, JSON)
            object.__setattr__(self, "link", _link(self.link))
        if isinstance(self.devices, Mapping):   # JSON's keys are text
            object.__setattr__(self, "devices", _devices(self.devices))
        super().__post_init__()


def _link(values: Mapping[str, Any]) -> LinkModel:
    """{"alpha": s, "beta": s/byte} as a LinkModel."""
    if set(values) != {"alpha", "beta"}:
        raise InputError("AdviseConfig", "link", f"expected alpha and beta, got {dict(values)!r}")
    for name in ("alpha", "beta"):
        value = values[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 \
                or value == float("inf"):
            raise InputError("AdviseConfig", f"link.{name}", f"expected seconds"
                             f"{' per byte' if name == 'beta' else ''} >= 0, got {value!r}")
    return LinkModel(float(values["alpha"]), float(values["beta"]))


def _devices(values: Mapping[Any, Any]) -> dict[int, str]:
    """DP rank -> device type, the ranks as integers (JSON writes them as text)."""
    try:
        return {int(rank): str(device) for rank, device in values.items()}
    except (TypeError, ValueError):
        raise InputError("AdviseConfig", "devices", f"expected DP rank -> device type, got "
                         f"{dict(values)!r}") from None


def advise_config(config: AdviseConfig | None, settings: dict[str, Any],
                  source: str = "advise") -> AdviseConfig:
    """The one place keyword settings become an AdviseConfig (an unknown name refused with it)."""
    if config is not None and not isinstance(config, AdviseConfig):
        raise InputError(source, "config", f"expected an AdviseConfig, got {config!r}")
    if not settings:
        return config or AdviseConfig()
    base = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)} if config else {}
    return AdviseConfig.from_mapping({**base, **settings}, source)
