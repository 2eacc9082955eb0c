"""A transfer that completes while the training thread holds the GIL (test_record_waiter.py).

argv: OUT. Rank 0 posts `rec.irecv`, meets rank 1 at a barrier, then computes in pure Python for
HOLD_S without letting go of the GIL (a switch interval longer than that), then waits; rank 1
sends SEND_AFTER_S after the barrier, while rank 0 computes. The receive's row must end then.
"""

import sys
import time

import torch
import torch.distributed as dist

from stragglers.record import Recorder, native
from stragglers.trace.model import JobMeta

HOLD_S, SEND_AFTER_S = 3.0, 1.0

dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {rank} native waiter: {native.waiter() is not None}", flush=True)
meta = JobMeta(name="gil", dp_size=1, pp_size=2)
with Recorder(sys.argv[1], meta, dp_rank=0, stage=rank, flush_interval_s=0.05) as rec:
    for step in range(2):
        with rec.step(step):
            buf = torch.zeros(16)
            if rank == 0:
                work = rec.irecv(buf, src=1)
                dist.barrier()
                sys.setswitchinterval(10.0)  # no other Python thread runs during the loop
                end = time.perf_counter() + HOLD_S
                while time.perf_counter() < end:
                    pass
                sys.setswitchinterval(0.005)
                work.wait()
                assert float(buf.sum()) == 16.0 * (step + 1)
            else:
                dist.barrier()
                time.sleep(SEND_AFTER_S)  # rank 0 is inside its loop by then
                rec.isend(torch.full((16,), float(step + 1)), dst=0).wait()
dist.destroy_process_group()
