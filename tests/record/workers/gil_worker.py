"""A transfer that completes while the training thread holds the GIL (test_record_waiter.py).

argv: OUT. Rank 0 posts `rec.irecv`, then a "go" message to rank 1, then computes in pure Python
for HOLD_S without letting go of the GIL (a switch interval longer than that), then waits. Rank
1 sends once it has the "go": the transfer completes while rank 0 computes, whatever the load,
and its row must end then, not when the loop lets go of the GIL.
"""

import sys
import time

import torch
import torch.distributed as dist

from stragglers.record import Recorder, native
from stragglers.trace.model import JobMeta

HOLD_S, GO_TAG = 3.0, 7

dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {rank} native waiter: {native.waiter() is not None}", flush=True)
meta = JobMeta(name="gil", dp_size=1, pp_size=2)
with Recorder(sys.argv[1], meta, dp_rank=0, stage=rank, flush_interval_s=0.05) as rec:
    for step in range(2):
        with rec.step(step):
            if rank == 0:
                buf = torch.zeros(16)
                work = rec.irecv(buf, src=1)
                sys.setswitchinterval(10.0)  # no other Python thread runs during the loop
                go = dist.isend(torch.ones(1), dst=1, tag=GO_TAG)  # gloo moves it, not Python
                end = time.perf_counter() + HOLD_S
                while time.perf_counter() < end:
                    pass
                sys.setswitchinterval(0.005)
                go.wait()
                work.wait()
                assert float(buf.sum()) == 16.0 * (step + 1)
            else:
                dist.recv(torch.zeros(1), src=0, tag=GO_TAG)
                time.sleep(0.2)  # rank 0 is past its isend and in the loop (holding the GIL)
                rec.isend(torch.full((16,), float(step + 1)), dst=0).wait()
dist.destroy_process_group()
