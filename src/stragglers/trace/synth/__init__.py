"""Synthetic Megatron-style job traces with injected, recorded straggler causes."""

from stragglers.trace.synth.generate import generate
from stragglers.trace.synth.spec import (GC, GCInCompute, HeavyLastStage, HostStall, Injection,
                                         SequenceImbalance, SlowCollective, SlowLink, SlowWorker,
                                         SynthSpec)

__all__ = ["GC", "GCInCompute", "HeavyLastStage", "HostStall", "Injection", "SequenceImbalance",
           "SlowCollective", "SlowLink", "SlowWorker", "SynthSpec", "generate"]
