"""torchrun worker: the embedded service, its URL and the job token shared through the store.

argv: workdir out.json {single|multi}; "multi" pretends every rank is on a host of its own.
"""

import json
import os
import stat
import sys
from pathlib import Path

import torch.distributed as dist

from stragglers.adapt.client import ShardClient
from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.launch import init_distributed, job_service
from stragglers.adapt.shards import Forbidden

workdir, out, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
init_distributed("gloo")
if mode == "multi":
    os.environ["LOCAL_WORLD_SIZE"] = "1"
rank = dist.get_rank()
svc = job_service("embedded", workdir / "shards.db", workdir / "job.token")
result = {"rank": rank, "url": svc.url, "token": svc.token}
if rank == 0:
    # Without the service token (here: the job token) nothing can be created on a public bind.
    try:
        ShardClient(svc.url, "d", "r0", token=svc.token).create_dataset(DatasetConfig("d", 40, 10))
        result["create_without_service_token"] = "accepted"
    except Forbidden:
        result["create_without_service_token"] = "refused"
    ShardClient(svc.url, "d", "r0", token=svc.token, service_token=svc.token).create_dataset(
        DatasetConfig("d", 40, 10))
    result["token_file_mode"] = oct(stat.S_IMODE((workdir / "job.token").stat().st_mode))
dist.barrier()
client = ShardClient(svc.url, "d", f"rank{rank}", token=svc.token)
client.join()
result["leased"] = client.lease().status
results = [None] * dist.get_world_size()
dist.all_gather_object(results, result)
dist.barrier()
if rank == 0:
    out.write_text(json.dumps(results))
    svc.server.stop()
dist.destroy_process_group()
