"""A data-parallel worker stand-in: pulls batches, 'trains' (logs the ids), then acknowledges.

argv: url dataset worker log batch delay; env SHARD_TOKEN (the job's token), SHARD_TIMEOUT_S
(the client's per-request timeout). Exit 0 when the data set is done, 3 when fenced off.
"""

import json
import os
import sys
import time

import msgspec

from stragglers.adapt.client import ShardBatchSampler, ShardClient
from stragglers.adapt.shards import Fenced

url, dataset, worker, log_path, batch, delay = sys.argv[1:7]
client = ShardClient(url, dataset, worker, token=os.environ["SHARD_TOKEN"], retry_s=120,
                     timeout_s=float(os.environ.get("SHARD_TIMEOUT_S", "10")))
sampler = ShardBatchSampler(client, int(batch), block=True, poll_s=0.05)
with open(log_path, "a") as log:
    try:
        for ids in sampler:
            log.write(json.dumps({"worker": worker, "ids": ids, "epochs": sampler.last_batch_epochs}) + "\n")
            log.flush()  # a SIGKILL after this line still leaves the ids in the file
            time.sleep(float(delay))
            sampler.ack()
    except Fenced as exc:
        print(json.dumps({"worker": worker, "fenced": str(exc)}), flush=True)
        sys.exit(3)
print(json.dumps({"worker": worker, "lost_samples": sampler.lost_samples,
                  "failed": msgspec.to_builtins(sampler.failed_report)}), flush=True)
