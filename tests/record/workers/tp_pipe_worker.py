"""FSDP2 + TP + a multi-stage pipelining schedule (two stages per rank), recorded: 4 ranks as
pp 2 × tp 2, examples/train_tp.py's model split in 4 stages.

    torchrun --nproc-per-node 4 tp_pipe_worker.py OUT SCHEDULE [SCHEDULE ...]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import train_tp as ex  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.pipelining import PipelineStage, schedules  # noqa: E402

from stragglers.record import attach  # noqa: E402

PP, TP, MB = 2, 2, 4
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def loss_fn(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def run(out: str, name: str, mesh, args) -> None:
    rank = mesh["pp"].get_local_rank()
    indices = [rank, 2 * PP - 1 - rank] if name in V_SHAPED else [rank, rank + PP]
    stages, params = [], []
    for index in indices:
        model = ex.parallelize(ex.pipeline_split(ex.Transformer(args), index, 2 * PP), mesh,
                               pipelined=True)
        stages.append(PipelineStage(model, index, 2 * PP, torch.device("cpu"),
                                    group=mesh["pp"].get_group()))
        params += list(model.parameters())
    opt = torch.optim.SGD(params, lr=1e-2)
    schedule = getattr(schedules, name)(stages, MB, loss_fn=loss_fn)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    with attach(schedule, opt, f"{out}/{name}"):
        for step in range(3):
            tokens = torch.cat([ex.batch(args, step, 0, mb) for mb in range(MB)])
            schedule.step(*((tokens[:, :-1],) if first else ()),
                          target=tokens[:, 1:] if last else None)
            opt.step()
            opt.zero_grad()
    dist.barrier()


def main() -> None:
    dist.init_process_group("gloo")
    args = ex.parse_args(["--layers", "4", "--d-model", "32", "--seq", "8", "--batch", "2"])
    mesh = init_device_mesh("cpu", (PP, 1, TP), mesh_dim_names=("pp", "dp", "tp"))
    for name in sys.argv[2:]:
        run(sys.argv[1], name, mesh, args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
