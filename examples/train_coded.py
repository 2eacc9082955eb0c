"""Coded data-parallel training of an MLP on the scikit-learn digits (bundled, no download).

Rank 0 is the aggregator, ranks 1..n are workers; each step every worker is delayed by a draw
from a heavy-tailed distribution. With a gradient code the aggregator needs only n − s arrivals.

    torchrun --standalone --nproc-per-node 9 examples/train_coded.py \
        --scheme cyclic-mds --stragglers 1 --delay-dist pareto --delay-scale 0.02 --seed 0 --compare
"""

import argparse
import warnings

import torch
import torch.distributed as dist

from stragglers.coding import SCHEMES, make_code
from stragglers.coding.data import load_digits_parts
from stragglers.coding.delays import DISTRIBUTIONS, DelaySampler
from stragglers.coding.training import set_seed, train_coded

from launch import require_torchrun  # examples/launch.py (the script's folder is on sys.path)


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheme", default="cyclic-mds", choices=SCHEMES)
    ap.add_argument("--stragglers", type=int, default=1, help="stragglers tolerated (s)")
    ap.add_argument("--degree", type=int, default=None, help="expander degree d (default s+1)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=32, help="per part and step")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--target-loss", type=float, default=None, help="stop when reached")
    ap.add_argument("--delay-dist", default="pareto", choices=DISTRIBUTIONS)
    ap.add_argument("--delay-scale", type=float, default=0.02, help="seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare", action="store_true",
                    help="also run wait-for-all and ignore-stragglers under the same delays")
    return ap.parse_args()


def make_model() -> torch.nn.Module:
    """A small MLP for 8×8 digit images."""
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def main() -> None:
    """Train each requested scheme in the same process group and print a comparison."""
    args = parse_args()
    require_torchrun(3)
    dist.init_process_group("gloo")
    n = dist.get_world_size() - 1  # rank 0 aggregates
    data = load_digits_parts(n, batch_size=args.batch_size, seed=args.seed)
    X, y = data.all()
    loss_fn = torch.nn.functional.cross_entropy
    delays = DelaySampler(args.delay_dist, args.delay_scale, seed=args.seed)

    runs = [(args.scheme, args.stragglers)]
    if args.compare:
        runs = [("wait-for-all", 0), ("ignore-stragglers", args.stragglers)] + runs
    results = []
    for scheme, s in runs:
        with warnings.catch_warnings(record=True) as notes:
            warnings.simplefilter("always")
            # d applies to the expander only (other schemes refuse it); the guard runs again
            # inside train_coded for the float32 messages actually sent
            code = make_code(scheme, n, s, d=args.degree if scheme == "expander" else None,
                             seed=args.seed)
        set_seed(args.seed)  # every scheme starts from the same weights
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        result = train_coded(model, optimizer, loss_fn, data, code, args.steps, delays=delays,
                             evaluate=lambda m: float(loss_fn(m(X), y)), eval_every=5,
                             target_loss=args.target_loss)
        if result is not None:
            for note in notes:
                print(f"note: {note.message}")
            results.append(result)

    if dist.get_rank() == 0:
        print(f"n={n} workers, delays {delays.describe()}")
        print(f"{'scheme':<22}{'s':>3}{'steps':>7}{'seconds':>10}{'loss':>9}{'late':>6}")
        for r in results:
            last = [rec.eval_loss for rec in r.records if rec.eval_loss is not None][-1]
            print(f"{r.code:<22}{r.s:>3}{len(r.records):>7}{r.seconds:>10.2f}{last:>9.4f}"
                  f"{r.late_total:>6}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
