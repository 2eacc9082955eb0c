"""A data-parallel worker stand-in: pulls batches, 'trains' (logs the ids), then acknowledges."""

import json
import sys
import time

from stragglers.adapt.client import ShardBatchSampler, ShardClient

url, dataset, worker, log_path, batch, delay = sys.argv[1:7]
client = ShardClient(url, dataset, worker)
sampler = ShardBatchSampler(client, int(batch), block=True, poll_s=0.05)
with open(log_path, "a") as log:
    for ids in sampler:
        log.write(json.dumps({"worker": worker, "ids": ids, "epochs": sampler.last_batch_epochs}) + "\n")
        log.flush()  # a SIGKILL after this line still leaves the ids in the file
        time.sleep(float(delay))
        sampler.ack()
print(json.dumps({"worker": worker, "lost_samples": sampler.lost_samples,
                  "failed": sampler.failed_report}), flush=True)
