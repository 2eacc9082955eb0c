"""Records steps in one process, then waits for SIGTERM (test_record_sigterm.py).

argv: OUT MODE. MODE "default": 5 steps, "ready", then sleep until killed. MODE "handler": the
program has its own SIGTERM handler (installed before the Recorder) that asks the loop to stop;
it records until then, records 2 more steps and ends normally, printing how many it recorded.
"""

import signal
import sys
import time

from stragglers.record import Recorder
from stragglers.trace.model import JobMeta

out, mode = sys.argv[1], sys.argv[2]
stop = []
if mode == "handler":
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))


def one_step(rec: Recorder, step: int) -> None:
    with rec.step(step):
        for optype in ("forward-compute", "backward-compute", "optimizer"):
            with rec.op(optype, 0 if optype != "optimizer" else -1):
                time.sleep(0.001)


# flush_interval_s of an hour: nothing reaches the disk before close() unless SIGTERM flushes it
with Recorder(out, JobMeta(name="term", dp_size=1, pp_size=1), dp_rank=0, stage=0,
              flush_interval_s=3600, flush_every=10_000) as rec:
    step = 0
    while step < 5 or (mode == "handler" and not stop):
        one_step(rec, step)
        step += 1
        if step == 5:
            print("ready", flush=True)
    if mode == "default":
        time.sleep(120)
    for _ in range(2):
        one_step(rec, step)
        step += 1
print(f"recorded {step}", flush=True)
