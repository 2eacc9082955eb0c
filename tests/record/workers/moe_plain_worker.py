"""examples/train_moe.py's model without a data-parallel wrapper, attached: on CPU with the native
hooks built, forward and backward are timed in C++ and the writer cuts them at the all-to-alls."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import train_moe as ex  # noqa: E402

from stragglers.record import attach  # noqa: E402

args = ex.parse_args(["--layers", "1", "--batch", "2", "--seq", "8", "--hot-expert", "1",
                      "--routing-skew", "0.5"])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model = ex.Transformer(args, world, rank)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
with attach(model, opt, sys.argv[1], extra={"native": None}) as att:
    att.recorder.meta.extra["native"] = att._native is not None
    for step in range(4):
        tokens = ex.batch(args, step, rank, 0)
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
del model, opt
dist.destroy_process_group()
