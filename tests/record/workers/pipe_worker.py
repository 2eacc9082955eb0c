"""Several examples/train_pipeline.py runs in one torchrun job (one process group, one launch).

    torchrun ... pipe_worker.py '<json list of argument lists>'
"""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
import train_pipeline  # noqa: E402

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo")
    for argv in json.loads(sys.argv[1]):
        train_pipeline.train(train_pipeline.parse_args(argv))
        dist.barrier()
    dist.destroy_process_group()
