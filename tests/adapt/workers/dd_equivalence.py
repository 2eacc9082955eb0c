"""2 ranks, unequal batches with accumulation on DDP: the update must equal one global-batch update."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from stragglers.adapt.policies import micro_batches
from stragglers.adapt.step import DataParallelStep
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from launch import exit_without_finalizing  # noqa: E402  (examples/launch.py)

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
B = 24
x, y = torch.randn(2 * B, 8), torch.randint(0, 4, (2 * B,))


def make_model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


model = make_model()
opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
dd = DataParallelStep(model, n_extras=1)
splits = [[5, 19], [24, 0]]  # k = 2 and 5 micro-steps; then rank 1 has nothing (still one reduction)
cap = 4
collectives, flags = 0, []
for step, sizes in enumerate(splits):
    lo = step * B + sum(sizes[:rank])
    xs, ys = x[lo:lo + sizes[rank]], y[lo:lo + sizes[rank]]
    res = dd.step(torch.nn.CrossEntropyLoss(reduction="sum"), xs, ys,
                  micro_batches(sizes[rank], cap), opt, extras=[rank + 1.0])
    collectives += res.collectives
    flags.append(res.extras[0])
    assert res.global_count == B

if rank == 0:
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    naive = make_model()  # equal-weight average of per-rank mean gradients: biased
    naive_opt = torch.optim.SGD(naive.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for step, sizes in enumerate(splits):
        ref_opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ref(x[step * B:(step + 1) * B]), y[step * B:(step + 1) * B])
        loss.backward()
        losses.append(loss.item())
        ref_opt.step()
        naive_opt.zero_grad()
        lo, parts = step * B, [s for s in sizes if s > 0]
        for s in sizes:
            if s:
                (torch.nn.functional.cross_entropy(naive(x[lo:lo + s]), y[lo:lo + s]) / len(parts)).backward()
            lo += s
        naive_opt.step()
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    naive_diff = max((a - b).abs().max().item() for a, b in zip(naive.parameters(), ref.parameters()))
    with open(sys.argv[1], "w") as f:
        json.dump({"max_abs_diff": diff, "naive_diff": naive_diff, "collectives": collectives,
                   "flags": flags, "last_mean_loss": res.mean_loss, "ref_last_loss": losses[-1]}, f)
dd.close()
dist.destroy_process_group()
exit_without_finalizing()  # torch's gloo threads can abort a finished process at exit
