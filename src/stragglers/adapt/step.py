"""One AntDT-DD global step on DDP: accumulation under `no_sync()`, then one weighted reduction.

Each rank runs its b_i samples in k_i = ceil(b_i / M_i) micro-batches; all but the last run
under `DistributedDataParallel.no_sync()`, so gradients accumulate locally and the last
backward starts DDP's bucketed all-reduce (overlapping the backward). The loss is *summed* over
samples. A small statistics parameter rides in the same buckets: its gradient is
[samples, loss sum, extras...] of this rank, so after the reduction it holds the global count
Σ b_i. The comm hook sums instead of averaging, and the gradients are divided by Σ b_i: the
update of the mean loss over one B-sample batch, Σ_i (b_i / B)·ḡ_i — unbiased for any split,
including short or empty batches at the end of the data.

Every tensor lives on the gradients' device; the per-step host values (count, extras) go up
in one pinned, non-blocking copy, and the statistics come back in one read after the
reduction (the optimizer step depends on the global count). The CUDA path is written for NCCL
but untested here (no GPU); gloo on CPU is tested.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.nn.parallel import DistributedDataParallel

from stragglers.collectives.completion import CompletionThread, reduce_bucket


@dataclass
class StepResult:
    """What one global step did."""

    global_count: int  # Σ b_i over ranks
    mean_loss: float  # loss per sample over the global batch
    compute_s: float  # forward/backward until the last bucket is ready (no wait for peers)
    collectives: int  # gradient reductions (DDP buckets) this rank issued during the step
    extras: list[float] = field(default_factory=list)  # the summed `extras`


class _WithStatistics(torch.nn.Module):
    """The model plus a statistics parameter that DDP reduces in the same buckets."""

    def __init__(self, model: torch.nn.Module, size: int):
        super().__init__()
        self.model = model
        device = next(model.parameters()).device
        # float32 whatever the model's dtype: counts up to 2^24 stay exact.
        self.statistics = torch.nn.Parameter(torch.zeros(size, device=device))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(inputs)


class DataParallelStep:
    """AntDT-DD steps for `model` (already on its device) over the default or given group."""

    def __init__(self, model: torch.nn.Module, n_extras: int = 0, group=None,
                 bucket_cap_mb: float = 25.0):
        self.model = model
        self.n_extras = n_extras
        self._wrapped = _WithStatistics(model, 2 + n_extras)
        self.device = self._wrapped.statistics.device
        cuda = self.device.type == "cuda"
        self.ddp = DistributedDataParallel(self._wrapped, process_group=group,
                                           device_ids=[self.device] if cuda else None,
                                           bucket_cap_mb=bucket_cap_mb)
        self._reductions = 0
        self._last_ready = 0.0
        # The futures DDP waits on are completed by a thread of ours, never by a Python
        # callback on gloo's (collectives/completion.py says why).
        self._completer = CompletionThread("stragglers-dd-buckets")
        self.ddp.register_comm_hook(group, self._sum_hook)
        self._host = torch.zeros(1 + n_extras, pin_memory=cuda)

    def _sum_hook(self, group, bucket):
        """Sum (not average) each bucket: the weighting is done with the global count."""
        self._reductions += 1
        self._last_ready = time.perf_counter()
        return reduce_bucket(self._completer, bucket, group, average=False)

    def close(self) -> None:
        """Join the thread that completes the buckets' futures (after the last step)."""
        self._completer.stop()

    def step(self, sum_loss: Callable, inputs: torch.Tensor, targets: torch.Tensor,
             micro_sizes: Sequence[int], optimizer: torch.optim.Optimizer,
             extras: Sequence[float] = (),
             on_micro_batch: Callable[[int], None] | None = None) -> StepResult:
        """Accumulate over `micro_sizes`, reduce once, apply the global-batch update.

        `sum_loss(outputs, targets)` must return the loss *summed* over samples
        (reduction="sum"). `extras` (exactly n_extras numbers) are summed over ranks in the
        same reduction, e.g. flags. A rank with no samples still takes part (empty batch).
        """
        if len(extras) != self.n_extras:
            raise ValueError(f"expected {self.n_extras} extras, got {len(extras)}")
        for p in self.ddp.parameters():
            p.grad = None
        sizes = [m for m in micro_sizes if m > 0] or [0]
        count = sum(sizes)
        self._host[0] = float(count)
        for i, x in enumerate(extras):
            self._host[1 + i] = float(x)
        host_values = self._host.to(self.device, non_blocking=True)
        reductions_before = self._reductions
        start = time.perf_counter()
        loss_sum = torch.zeros((), device=self.device)
        offset = 0
        for j, m in enumerate(sizes):
            xs, ys = inputs[offset:offset + m], targets[offset:offset + m]
            if j < len(sizes) - 1:
                with self.ddp.no_sync():
                    loss = sum_loss(self.ddp(xs), ys)
                    _simulate(on_micro_batch, m)
                    loss.backward()  # gradients add up locally: no communication
                loss_sum = loss_sum + loss.detach()
            else:
                loss = sum_loss(self.ddp(xs), ys)
                _simulate(on_micro_batch, m)
                loss_sum = loss_sum + loss.detach()
                # d/d(statistics) of this zero-valued term is [count, loss sum, extras]: the
                # statistics ride with the gradients in the last, synchronised backward.
                values = torch.cat([host_values[:1], loss_sum.reshape(1).float(), host_values[1:]])
                (loss + (self._wrapped.statistics * values).sum()).backward()
            offset += m
        # Up to the last bucket becoming ready: the time waiting for slower ranks is excluded.
        compute_s = self._last_ready - start
        stats = self._wrapped.statistics.grad
        if stats is None:   # the last micro-batch's backward always reaches the statistics
            raise RuntimeError("DataParallelStep: the reduction carried no statistics")
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if grads:
            torch._foreach_div_(grads, stats[0].clamp(min=1.0).to(grads[0].dtype))
        total, global_loss, *summed = stats.tolist()  # the one read back per step
        if total > 0:
            optimizer.step()
        return StepResult(int(round(total)), global_loss / total if total else 0.0, compute_s,
                          self._reductions - reductions_before, summed)


def _simulate(on_micro_batch: Callable[[int], None] | None, samples: int) -> None:
    """Injected device time of a micro-batch (heterogeneity.py), before its backward."""
    if on_micro_batch is not None and samples:
        on_micro_batch(samples)
