"""Synthetic Megatron-style job traces with injected, recorded straggler causes."""

from stragglers.trace.synth._generate import generate
from stragglers.trace.synth.spec import (GC, GCInCompute, HeavyLastStage, HostStall, Injection,
                                         SequenceImbalance, SlowCollective, SlowLink, SlowWorker,
                                         SynthSpec)
from stragglers.trace.synth.truth import CauseWhere, InjectedCause, ground_truth

__all__ = ["GC", "CauseWhere", "GCInCompute", "HeavyLastStage", "HostStall", "InjectedCause",
           "Injection", "SequenceImbalance", "SlowCollective", "SlowLink", "SlowWorker",
           "SynthSpec", "generate", "ground_truth"]
