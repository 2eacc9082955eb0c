"""The job of examples/train_advised.py under coded training: the measured side of advise's
gradient-coding prediction (run by benchmarks/advise_remedies.py under torchrun, n + 1 ranks).

    python -m torch.distributed.run --standalone --nproc-per-node 5 benchmarks/coded_remedy.py \
        --scheme frc --stragglers 1 --slow-rank 3 --slow-factor 2.5 --sample-time 0.004 --summary out.json

The same model (train_advised's MLP), the same global batch split into n parts of B/n samples,
the same simulated device (each part's samples sleep --sample-time each, × --slow-factor on
worker --slow-rank) and the same host stall (--stall-rank/--stall-s per step). Two runs in one
process group, one after the other: wait-for-all (s = 0, every worker computes its own part:
the uncoded job) and the code (every worker computes s + 1 parts, the aggregator needs n − s
arrivals). Rank 0 writes the mean step time of each, the first --skip steps left out.
The coded trainer is master/worker (stragglers.coding.train_coded), not DDP: advise_remedies.py
sets the coded step against the DDP job's (what switching would buy) and prints the uncoded step
on this trainer beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from train_advised import global_batch, make_model  # noqa: E402  (the job being advised)

from stragglers.coding import make_code  # noqa: E402
from stragglers.coding.data import PartitionedData  # noqa: E402
from stragglers.coding.training import set_seed, train_coded  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scheme", default="frc")
    p.add_argument("--stragglers", type=int, default=1, help="s")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--sample-time", type=float, default=0.002)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-factor", type=float, default=1.0)
    p.add_argument("--stall-rank", type=int, default=-1)
    p.add_argument("--stall-s", type=float, default=0.0)
    p.add_argument("--summary", type=Path, required=True)
    return p.parse_args()


class DeviceTime:
    """Per (step, worker): the simulated device time of the worker's parts, plus its stall."""

    def __init__(self, code, part_batch: int, args):
        self.code, self.part_batch, self.args = code, part_batch, args

    def __call__(self, step: int, worker: int) -> float:
        a = self.args
        factor = a.slow_factor if worker == a.slow_rank else 1.0
        stall = a.stall_s if worker == a.stall_rank else 0.0
        return len(self.code.parts(worker)) * self.part_batch * a.sample_time * factor + stall


def step_times(result, skip: int) -> list[float]:
    """Each step's duration from the aggregator's cumulative clock."""
    ends = [r.seconds for r in result.records]
    return [b - a for a, b in zip(ends, ends[1:])][max(skip - 1, 0):]


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    n = dist.get_world_size() - 1
    if args.global_batch % n:
        raise SystemExit(f"--global-batch {args.global_batch} must split into {n} equal parts")
    part_batch = args.global_batch // n
    # every step's global batch, as train_advised draws it, laid out as the n parts' streams
    xs, ys = zip(*(global_batch(step, args) for step in range(args.steps)))
    X, y = torch.cat(xs), torch.cat(ys)
    data = PartitionedData(X, y, n, batch_size=part_batch, seed=args.seed)
    summary = {}
    for scheme, s in (("wait-for-all", 0), (args.scheme, args.stragglers)):
        code = make_code(scheme, n, s, seed=args.seed)
        set_seed(args.seed)
        model = make_model(args)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        result = train_coded(model, opt, lambda out, t: (out - t).pow(2).mean(), data, code,
                             args.steps, delays=DeviceTime(code, part_batch, args))
        if result is not None:
            times = step_times(result, args.skip)
            summary[scheme if s == 0 else f"{scheme}-s{s}"] = {
                "mean_step_s": statistics.mean(times), "steps": len(times),
                "late": result.late_total}
    if dist.get_rank() == 0:
        args.summary.parent.mkdir(parents=True, exist_ok=True)
        args.summary.write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
