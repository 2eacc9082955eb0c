"""Measure α (latency) and β (s/byte) of the current backend by ping-pong, and the effective β
when every rank exchanges at once (what a round of StragglAR or Ring does).

Device-safe: the buffers and the reduced timing tensor live on the backend's device (CUDA for
NCCL), and each exchange is timed with CUDA events on the stream there (the host clock on
CPU), never with a host clock around asynchronous NCCL work.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from stragglers.collectives.cost_model import LinkModel
from stragglers.collectives.devices import Stopwatch, backend_of, control_device

DEFAULT_SIZES = (8, 1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24)


def _fit(sizes: list[int], times: list[float]) -> LinkModel:
    """Least-squares t = α + sβ (α clipped at 0)."""
    mx, my = statistics.fmean(sizes), statistics.fmean(times)
    sxx = sum((x - mx) ** 2 for x in sizes)
    beta = sum((x - mx) * (y - my) for x, y in zip(sizes, times)) / sxx
    return LinkModel(max(0.0, my - beta * mx), max(beta, 0.0))


def _one_exchange(buf: torch.Tensor, out: torch.Tensor, peer: int, group) -> None:
    ops = [dist.P2POp(dist.isend, buf, peer, group), dist.P2POp(dist.irecv, out, peer, group)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()


def measure_link(sizes=DEFAULT_SIZES, reps: int = 5, all_pairs: bool = False, group=None) -> LinkModel | None:
    """Collective: time one exchange of each size (median of `reps`) and fit α, β.

    all_pairs=False: ranks 0 and 1 only (the α–β link). True: ranks pair up 0-1, 2-3, … and all
    exchange at once, so β includes the contention of the host (CPU, loopback, NIC).
    Returns the fit on rank 0, None elsewhere.
    """
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    active = rank < (n - n % 2 if all_pairs else 2)
    peer = rank ^ 1
    medians = []
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend_of(group) \
        and torch.cuda.is_available() else torch.device("cpu")
    for size in sizes:
        buf = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
        out = torch.empty_like(buf)
        samples = []
        for _ in range(reps + 1):  # first is warm-up
            dist.barrier(group)
            watch = Stopwatch(device).start()
            if active:
                _one_exchange(buf, out, to_global(peer), group)
            samples.append(watch.stop().seconds())
        t = torch.tensor([statistics.median(samples[1:])], dtype=torch.float64,
                         device=control_device(group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        medians.append(t.item())
    return _fit([max(4, s - s % 4) for s in sizes], medians) if rank == 0 else None


def main(argv: list[str] | None = None) -> None:
    """Entry point under torchrun: print α and β (single pair and all pairs at once)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m stragglers.collectives.calibrate")
    parser.add_argument("--max-size-mb", type=float, default=16.0, help="largest message to time")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    top = int(args.max_size_mb * 2**20)
    sizes = tuple(s for s in DEFAULT_SIZES if s < top) + (top,)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":  # before the group exists, so NCCL binds the right GPU
        import os

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    dist.init_process_group(backend)
    single = measure_link(sizes, args.reps)
    many = measure_link(sizes, args.reps, all_pairs=True)
    if single is not None and many is not None:     # rank 0 holds the fits
        n = dist.get_world_size()
        for name, m in (("one pair", single), (f"{n // 2} pairs at once", many)):
            print(f"{name}: alpha = {m.alpha * 1e6:.1f} us, 1/beta = {1 / m.beta / 2**20:.0f} MiB/s"
                  if m.beta > 0 else f"{name}: alpha = {m.alpha * 1e6:.1f} us, beta ~ 0", flush=True)
        print(f"backend: {backend}, {n} processes", flush=True)
        print(f"ALPHA_BETA {single.alpha} {single.beta} {many.alpha} {many.beta}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
