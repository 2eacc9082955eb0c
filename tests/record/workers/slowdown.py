"""The slow-rank injection the trainer workers share: a forward hook that adds real compute."""

from __future__ import annotations

import time

import torch


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


def slow_down(module: torch.nn.Module, fwd_s: float, bwd_s: float):
    """Make `module`'s forward take fwd_s longer and its backward bwd_s longer (a hook)."""
    def hook(_m, _args, out):
        return _Burn.apply(out, fwd_s, bwd_s) if torch.is_grad_enabled() else out
    return module.register_forward_hook(hook)
