"""The Recorder's settings, typed and validated in one place (stragglers.config's pattern)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from stragglers.config import Config, setting
from stragglers.errors import InputError


@dataclasses.dataclass(frozen=True)
class RecorderConfig(Config):
    """How a Recorder samples, flushes, measures the clock and streams to the monitor."""

    sample_every: int = setting(1, "record one step in this many (steps with step % k == 0)",
                                minimum=1)
    flush_every: int = setting(64, "finished steps held before their marks are converted",
                               minimum=1)
    flush_interval_s: float = setting(1.0, "seconds between two written parts (a rank killed "
                                      "loses at most this much); at least 1 ms", minimum=1e-3)
    clock_rounds: int = setting(8, "ping-pong round trips per clock-offset estimate (the best "
                                "is kept)", minimum=1)
    gc_min_s: float = setting(50e-6, "GC pauses shorter than this are not recorded",
                              minimum=0.0)
    enabled: bool = setting(True, "False: the recorder does nothing (no collectives, no files)")
    overwrite: bool = setting(False, "replace an earlier run in the directory (its run-format "
                              "files only)")
    monitor: str | None = setting(None, "URL of the live monitor the parts are uploaded to")
    monitor_token: str | None = setting(None, "the monitor's write token")
    monitor_job: str | None = setting(None, "the job's name at the monitor (default: the run "
                                      "directory's name)")
    monitor_close_timeout_s: float = setting(10.0, "how long close (and SIGTERM) waits for "
                                             "the monitor to take the last parts", minimum=0.0)
    flush_on_sigterm: bool = setting(True, "on SIGTERM write the finished steps, then do what "
                                     "SIGTERM did before")

    source = "Recorder"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("monitor", "monitor_token", "monitor_job"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InputError(self.source, name, f"expected a string or None, got "
                                 f"{type(value).__name__}")


def recorder_config(config: RecorderConfig | None, keywords: Mapping[str, Any]) -> RecorderConfig:
    """The one place the Recorder's keyword settings (sample_every=..., monitor=...) become a
    RecorderConfig: they override `config` (or the defaults); an unknown one is refused."""
    base = config if config is not None else RecorderConfig()
    if not isinstance(base, RecorderConfig):
        raise InputError("Recorder", "config", f"expected a RecorderConfig, got "
                         f"{type(base).__name__}")
    if not keywords:
        return base
    return RecorderConfig.from_mapping({**base.to_dict(), **keywords}, "Recorder")
