"""Coded data-parallel training of an MLP on the scikit-learn digits (bundled, no download).

Rank 0 is the aggregator, ranks 1..n are workers (5 processes: n = 4 workers); each step every
worker is delayed by a draw from a heavy-tailed distribution. With a gradient code the aggregator
needs only n − s arrivals. Rank 0 prints its progress and ends with a verdict line.

    torchrun --standalone --nproc-per-node 5 examples/train_coded.py \
        --scheme cyclic-mds --stragglers 1 --delay-dist pareto --delay-scale 0.02 --seed 0 --compare
"""

import argparse
import time
import warnings

import torch
import torch.distributed as dist

from stragglers.coding import SCHEMES, make_code
from stragglers.coding.data import load_digits_parts
from stragglers.coding.delays import DISTRIBUTIONS, DelaySampler
from stragglers.coding.training import set_seed, train_coded

from launch import main_once, require_torchrun  # examples/launch.py (on sys.path)


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


class Progress:
    """Rank 0's progress line every `every` steps, through the evaluation hook (every 5 steps)."""

    EVAL_EVERY = 5

    def __init__(self, label: str, steps: int, loss_of, every: int):
        self.label, self.steps, self.loss_of, self.every = label, steps, loss_of, every
        self.calls, self.t0 = 0, time.perf_counter()

    def __call__(self, model: torch.nn.Module) -> float:
        loss = self.loss_of(model)
        self.calls += 1
        step = min(self.calls * self.EVAL_EVERY, self.steps)
        if step % self.every == 0 or step == self.steps:
            print(f"  {self.label}: step {step}/{self.steps}, loss {loss:.4f} "
                  f"({time.perf_counter() - self.t0:.1f} s)", flush=True)
        return loss


def verdict(results: list, steps: int) -> str:
    """One line: how the requested scheme did, against wait-for-all when it ran too."""
    final = lambda r: [rec.eval_loss for rec in r.records if rec.eval_loss is not None][-1]  # noqa: E731
    coded = results[-1]
    line = (f"verdict: {coded.code} (s={coded.s}) trained {len(coded.records)} steps in "
            f"{coded.seconds:.2f} s to loss {final(coded):.4f}")
    base = next((r for r in results if r.code == "wait-for-all"), None)
    if base is None or base is coded:
        return line + " (run with --compare for wait-for-all under the same delays)"
    return (line + f"; wait-for-all took {base.seconds:.2f} s to loss {final(base):.4f}: "
            f"{base.seconds / coded.seconds:.2f}× as fast")


def main() -> None:
    """Train each requested scheme in the same process group and print a comparison."""
    args = parse_args()
    require_torchrun(3)
    dist.init_process_group("gloo")
    n = dist.get_world_size() - 1  # rank 0 aggregates
    rank0 = dist.get_rank() == 0
    data = load_digits_parts(n, batch_size=args.batch_size, seed=args.seed)
    X, y = data.all()
    loss_fn = torch.nn.functional.cross_entropy
    delays = DelaySampler(args.delay_dist, args.delay_scale, seed=args.seed)

    runs = [(args.scheme, args.stragglers)]
    if args.compare:
        runs = [("wait-for-all", 0), ("ignore-stragglers", args.stragglers)] + runs
    if rank0:
        print(f"{n + 1} processes: rank 0 aggregates, ranks 1-{n} are the n={n} workers; delays "
              f"{delays.describe()}; {len(runs)} scheme(s) x {args.steps} steps", flush=True)
    results = []
    for k, (scheme, s) in enumerate(runs, 1):
        with warnings.catch_warnings(record=True) as notes:
            warnings.simplefilter("always")
            # d applies to the expander only (other schemes refuse it); the guard runs again
            # inside train_coded for the float32 messages actually sent
            code = make_code(scheme, n, s, d=args.degree if scheme == "expander" else None,
                             seed=args.seed)
        if rank0:
            for note in notes:
                print(f"note: {note.message}", flush=True)
            print(f"[{k}/{len(runs)}] {code.name} (s={s})", flush=True)
        set_seed(args.seed)  # every scheme starts from the same weights
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        progress = Progress(code.name, args.steps, lambda m: float(loss_fn(m(X), y)),
                            every=max(Progress.EVAL_EVERY, args.steps // 4 // 5 * 5))
        result = train_coded(model, optimizer, loss_fn, data, code, args.steps, delays=delays,
                             evaluate=progress, eval_every=Progress.EVAL_EVERY,
                             target_loss=args.target_loss)
        if result is not None:
            results.append(result)

    if rank0:
        print(f"{'scheme':<22}{'s':>3}{'steps':>7}{'seconds':>10}{'loss':>9}{'late':>6}")
        for r in results:
            last = [rec.eval_loss for rec in r.records if rec.eval_loss is not None][-1]
            print(f"{r.code:<22}{r.s:>3}{len(r.records):>7}{r.seconds:>10.2f}{last:>9.4f}"
                  f"{r.late_total:>6}")
        print(verdict(results, args.steps), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main_once(main))
