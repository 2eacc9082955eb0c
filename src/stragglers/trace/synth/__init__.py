"""Synthetic Megatron-style job traces with injected, recorded straggler causes."""

from stragglers.trace.synth.generate import generate

__all__ = ["generate"]
