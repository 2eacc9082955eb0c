"""DDP step time with the completion-thread comm hook vs DDP's own Python hook (fut.then), side by side.

    .venv/bin/torchrun --standalone --nproc-per-node 2 benchmarks/ddp_hook_completion.py
        [--steps 60] [--layers 8] [--width 512] [--bucket-mb 1]

The recorder, the advise hook and AntDT's DataParallelStep complete DDP's bucket futures on a
thread of the library (collectives/completion.py) instead of a Python callback on gloo's future
(the shutdown abort, record/README.md). That adds a thread hand-off per bucket; this measures
what it costs. One job, one hook that switches between the two ways every step (same buckets,
same load), a barrier before each step; reported: median step time of each and the median of
neighbour ratios t(completion thread) / t(fut.then). Parameters are checked equal across ranks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from results import Figure, Run, write  # noqa: E402

from stragglers.collectives.completion import CompletionThread, reduce_bucket  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--bucket-mb", type=float, default=1.0)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width)
                                      for _ in range(args.layers)]), bucket_cap_mb=args.bucket_mb)
    completer = CompletionThread("bench-buckets")
    mode = ["then"]
    buckets = [0]

    def hook(state, bucket):
        buckets[0] += 1
        if mode[0] == "thread":
            return reduce_bucket(completer, bucket, state)
        tensor = bucket.buffer()
        tensor.div_(dist.get_world_size())
        fut = dist.all_reduce(tensor, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, args.width)
    times = {"then": [], "thread": []}
    pairs = []
    for step in range(args.steps + 4):
        mode[0] = "thread" if step % 2 else "then"
        dist.barrier()
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        dt = time.perf_counter() - t0
        if step >= 4:  # warm-up and DDP's bucket rebuild left out
            times[mode[0]].append(dt)
            if mode[0] == "thread":
                pairs.append(dt / times["then"][-1])
    flat = torch.cat([q.detach().flatten() for q in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(g, gathered[0]) for g in gathered), "ranks diverged"
    completer.stop()
    if dist.get_rank() == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"buckets per step {buckets[0] // (args.steps + 4)}; median step: fut.then "
              f"{med['then']:.2f} ms, completion thread {med['thread']:.2f} ms; median neighbour "
              f"ratio thread/then {statistics.median(pairs):.3f} over {len(pairs)} pairs "
              f"(quartiles {statistics.quantiles(pairs, n=4)[0]:.3f}–"
              f"{statistics.quantiles(pairs, n=4)[2]:.3f})", flush=True)
        ratio = statistics.median(pairs)
        quart = statistics.quantiles(pairs, n=4)
        write(Run(benchmark="DDP bucket futures completed by a library thread", issue="10, 15",
                  command=" ".join([".venv/bin/torchrun --standalone --nproc-per-node",
                                    str(dist.get_world_size()),
                                    "benchmarks/ddp_hook_completion.py", *sys.argv[1:]]),
                  figures=[Figure(name="median neighbour-step ratio, completion thread / `fut.then`",
                                  value=f"{ratio:.3f} (quartiles "
                                        f"{statistics.quantiles(pairs, n=4)[0]:.2f}–"
                                        f"{statistics.quantiles(pairs, n=4)[2]:.2f})",
                                  anchor=f"DDP's own `fut.then`, alternated step by step: median "
                                         f"step {med['then']:.1f} vs {med['thread']:.1f} ms",
                                  goal="no measurable cost (1.0 within the quartiles)",
                                  met=quart[0] <= 1.0 <= quart[2],
                                  note=f"one run of {len(pairs)} neighbour pairs; parameters "
                                       "equal across ranks after the run")]),
              "ddp_hook_completion")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
