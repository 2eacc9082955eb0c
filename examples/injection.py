"""Injected slowness shared by the examples and test workers: real extra compute, not sleeps.

A slow GPU or CPU stretches the op's own compute, so the injection burns compute inside the
op (forward, and the input-gradient backward through an autograd function) rather than
sleeping beside it, which the analysis would rightly call a host stall. The extra compute is a
fixed amount of work (what `seconds` of the kernel do on this CPU, measured once): on a busy
machine it stretches as the model's own compute does, so a rank injected to compute 5× as long
stays 5× as long under any load (a burn for a fixed wall time would shrink to a fraction of the
stretched compute).
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn


def burn(seconds: float) -> None:
    """Real extra compute for `seconds` of wall time."""
    a = torch.randn(64, 64)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


_RATE: list[float] = []


def kernel_rate() -> float:
    """Iterations per second of the burn kernel on this CPU: the fastest of 7 runs of 5 ms (the
    least disturbed by other processes, as a calibration's shortest compute is), measured once."""
    if not _RATE:
        a, rates = torch.randn(64, 64), []
        for _ in range(7):
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < 0.005:
                a, n = torch.tanh(a @ a), n + 1
            rates.append(n / (time.perf_counter() - t0))
        _RATE.append(max(rates))
    return _RATE[0]


def work(seconds: float) -> None:
    """Real extra compute: the work the kernel does in `seconds` on this CPU (kernel_rate)."""
    if seconds <= 0:
        return
    a = torch.randn(64, 64)
    for _ in range(max(1, round(seconds * kernel_rate()))):
        a = torch.tanh(a @ a)


class _Burn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd_s: float, bwd_s: float):
        ctx.bwd_s = bwd_s
        work(fwd_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        work(ctx.bwd_s)
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
