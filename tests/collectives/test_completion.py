"""The comm-hook completion thread: DDP-exact averages, no Python on gloo's threads, joined on stop."""

from pathlib import Path

import pytest
from conftest import torchrun

WORKER = Path(__file__).parent / "workers" / "completion_ddp_worker.py"


@pytest.mark.distributed
def test_completion_hook_trains_like_ddp_and_runs_only_on_its_thread():
    proc = torchrun(WORKER, 2, timeout=240)
    assert proc.stdout.count("completion ok") == 2


def test_run_delay_reads_the_calling_threads_schedstat():
    import os
    import threading

    from stragglers.collectives.completion import RunDelay

    if not os.path.exists("/proc/thread-self/schedstat"):
        pytest.skip("this kernel exposes no schedstat")
    main = RunDelay()
    first = main.read()
    sum(range(200_000))
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
