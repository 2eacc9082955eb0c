"""schedstat run delay: a thread's own counter, and the process's summed over its threads."""

import math
import os
import subprocess
import sys
import threading

import pytest

from stragglers.record.schedstat import RunDelay

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"),
                                reason="this kernel exposes no schedstat")


def test_run_delay_reads_the_calling_threads_counter():
    main = RunDelay()
    first = main.read()
    assert isinstance(first, int) and main.read() >= first >= 0
    seen = {}

    def other():
        mine = RunDelay()
        seen["path"] = os.readlink(f"/proc/self/fd/{mine._fd}")
        mine.close()

    t = threading.Thread(target=other)
    t.start()
    t.join()
    # each RunDelay reads its own thread's counters, not the process's
    assert seen["path"] != os.readlink(f"/proc/self/fd/{main._fd}")
    main.close()
    assert main.read() == 0  # closed: reads nothing, corrects nothing


PROBE = """
import os, subprocess, sys, tempfile, time
import torch.distributed as dist
from stragglers.record.schedstat import CommWaitProbe, TransportRunDelay

dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
transport = TransportRunDelay(rescan_s=0.05)
deadline = time.monotonic() + 60   # each thread names itself once it runs: on a busy host, later
while transport.read() is None and time.monotonic() < deadline:
    time.sleep(0.05)
assert transport.read() is not None, "gloo's threads not found by name"
cpu = min(os.sched_getaffinity(0))
burn = "import os, time\\nos.sched_setaffinity(0, {%d})\\nt = time.time()\\n" \\
       "while time.time() - t < 30: pass" % cpu
burners = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(2)]
try:
    os.sched_setaffinity(0, {cpu})   # this thread only; gloo's threads keep their CPUs
    time.sleep(0.5)                  # the burners are running
    probe = CommWaitProbe()
    mark, t0 = probe.mark(), time.perf_counter()
    while time.perf_counter() - t0 < 0.6:
        pass
    waited, wall = probe.waited_s(mark), time.perf_counter() - t0
finally:
    for b in burners:
        b.kill()
        b.wait()
print(waited, wall)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_communicating_thread_sharing_its_cpu_with_two_burners_waits_for_it():
    # This thread and two busy processes on one CPU: the scheduler gives it about a third of
    # it, and it waits (runnable, not running) for the rest, which the probe reports.
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    waited, wall = map(float, proc.stdout.split()[-2:])
    assert waited >= 0.25 * wall, (waited, wall)


def test_a_probe_without_readable_counters_reports_nan_not_zero():
    from stragglers.record.schedstat import CommWaitProbe

    probe = CommWaitProbe()
    probe.transport.available = False  # as on a kernel without schedstat
    assert math.isnan(probe.waited_s(probe.mark()))
    probe.close()


def test_a_thread_named_after_a_scan_is_followed_from_the_next_scan():
    # gloo's threads name themselves once they run; a scan that saw one before that must not
    # forget it (on a busy host the name can come long after the group was made)
    import ctypes

    from stragglers.record.schedstat import TransportRunDelay

    libc = ctypes.CDLL(None)
    started, go, named, done = (threading.Event() for _ in range(4))
    tid = []

    def worker():
        tid.append(str(threading.get_native_id()))
        started.set()
        go.wait()
        libc.prctl(15, b"gloo_tcp_loop", 0, 0, 0)  # PR_SET_NAME, as the thread itself does
        named.set()
        done.wait()

    t = threading.Thread(target=worker)
    t.start()
    probe = TransportRunDelay(rescan_s=0)
    try:
        started.wait()
        probe.read()
        assert tid[0] not in probe._fds       # not named yet: not followed
        go.set()
        named.wait()
        assert probe.read() is not None
        assert tid[0] in probe._fds           # named now: followed from this scan on
    finally:
        done.set()
        t.join()
        probe.close()
