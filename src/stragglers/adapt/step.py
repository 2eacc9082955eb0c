"""One AntDT-DD global step: local gradient accumulation, then exactly one AllReduce.

Each rank runs its b_i samples in k_i = ceil(b_i / M_i) micro-batches with no communication,
summing (not averaging) the loss. A single all_reduce(SUM) carries every gradient plus the
sample count and the loss sum; dividing by the global count Σ b_i = B gives the gradient of the
mean loss over one B-sample batch, i.e. Σ_i (b_i / B)·ḡ_i — unbiased for any split, including
short or empty batches at the end of the data.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class StepResult:
    """What one global step did."""

    global_count: int  # Σ b_i over ranks
    mean_loss: float  # loss per sample over the global batch
    compute_s: float  # this rank's forward/backward time, excluding the AllReduce wait
    collectives: int  # collective calls issued by this rank (always 1)
    extras: list[float] = field(default_factory=list)  # the summed `extras`


def global_step(model: torch.nn.Module, sum_loss: Callable, inputs: torch.Tensor | None,
                targets: torch.Tensor | None, micro_sizes: Sequence[int],
                optimizer: torch.optim.Optimizer, extras: Sequence[float] = (),
                on_micro_batch: Callable[[int], None] | None = None, group=None) -> StepResult:
    """Accumulate over `micro_sizes`, AllReduce once, apply the global-batch update.

    `sum_loss(outputs, targets)` must return the loss *summed* over samples (reduction="sum").
    `extras` are small numbers every rank contributes to the same AllReduce (summed), e.g. flags.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    start = time.perf_counter()
    loss_sum, offset = 0.0, 0
    for m in micro_sizes:
        if m <= 0:
            continue
        loss = sum_loss(model(inputs[offset:offset + m]), targets[offset:offset + m])
        loss.backward()  # gradients add up across micro-batches: no sync in between
        loss_sum += float(loss.detach())
        offset += m
        if on_micro_batch is not None:
            on_micro_batch(m)
    compute_s = time.perf_counter() - start
    dtype = params[0].dtype
    tail = torch.tensor([float(offset), loss_sum, *extras], dtype=torch.float64)
    flat = torch.cat([p.grad.reshape(-1).to(torch.float64) for p in params] + [tail])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    n_grad = flat.numel() - tail.numel()
    total = flat[n_grad].item()
    if total > 0:
        pos = 0
        for p in params:
            n = p.numel()
            p.grad.copy_((flat[pos:pos + n] / total).view_as(p).to(dtype))
            pos += n
        optimizer.step()
    return StepResult(int(round(total)), flat[n_grad + 1].item() / total if total else 0.0,
                      compute_s, 1, flat[n_grad + 2:].tolist())
