"""The child process that parses and prepares restore bodies runs at a lower priority than the
service (restore_parse.CHILD_NICE above it): its seconds of pure Python per restore, at the
service's priority, took CPUs the event loop, the commit thread and the jobs' clients wait for
(a loop of restores and deletes on a busy machine: another job's lease + ack 12.7x its quiet
latency). A real child (SnapshotParser), its niceness read from the kernel."""

from __future__ import annotations

import asyncio
import os

import pytest

from stragglers.adapt.restore_parse import CHILD_NICE, SnapshotParser
from stragglers.errors import InputError


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="POSIX priorities")
def test_the_restore_child_runs_below_the_service():
    parser = SnapshotParser(1)
    try:
        # (a body it refuses is enough: the child is started, reads it and answers)
        with pytest.raises(InputError):
            asyncio.run(parser.prepare(b"{}", "d"))
        [pid] = parser.pids()
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, mine + CHILD_NICE)
    finally:
        parser.close()
