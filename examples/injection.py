"""Injected slowness shared by the examples and test workers: real extra compute, not sleeps.

A slow GPU or CPU stretches the op's own compute, so the injection burns compute inside the
op (forward, and the input-gradient backward through an autograd function) rather than
sleeping beside it, which the analysis would rightly call a host stall.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn


def burn(seconds: float) -> None:
    """Real extra compute for `seconds`."""
    a = torch.randn(64, 64)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


class _Burn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd_s: float, bwd_s: float):
        ctx.bwd_s = bwd_s
        burn(fwd_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        burn(ctx.bwd_s)
        return grad, None, None


class SlowDown(nn.Module):
    """Identity that adds compute in forward and in the input-gradient backward (0 s unless set)."""

    fwd_s = bwd_s = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Burn.apply(x, self.fwd_s, self.bwd_s) if self.fwd_s or self.bwd_s else x


def slow_down(module: nn.Module, fwd_s: float, bwd_s: float):
    """Make `module`'s forward take fwd_s longer and its backward bwd_s longer (a forward hook)."""
    def hook(_m, _args, out):
        return _Burn.apply(out, fwd_s, bwd_s) if torch.is_grad_enabled() else out
    return module.register_forward_hook(hook)
