"""Linux schedstat: how long threads were runnable but waiting for a CPU (their run delay).

A busy host delays work without any op being slow: a thread woken by a finished transfer waits
for a core before it can stamp the end, a gloo thread waits before it moves the bytes. The
recorder reads these counters around each transfer (its waiter thread's own, gloo's
communication threads') so the diagnosis can tell CPU contention from a slow link
(whatif/README.md, `cpu_contention`).
"""

from __future__ import annotations

import os
import time

_TASKS = "/proc/self/task"


class RunDelay:
    """The calling thread's run delay: ns it was runnable but waiting for a CPU (Linux schedstat).

    Create it on the thread it measures (/proc/thread-self names the opening thread); where the
    kernel does not expose schedstat, every read is 0 and nothing is corrected.
    """

    def __init__(self):
        self._fd: int | None
        # the on-CPU time (ns, schedstat's first field) at the last `read`: parsed from the
        # same read, no syscall of its own (record/modelparallel.py splits a compute piece)
        self.on_cpu = 0
        try:
            self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    @property
    def readable(self) -> bool:
        """Whether the kernel exposes the thread's schedstat (else every read is 0)."""
        return self._fd is not None

    def read(self) -> int:
        """Run delay so far (ns); fields: on-CPU time, run delay, time slices."""
        if self._fd is None:
            return 0
        try:
            fields = os.pread(self._fd, 96, 0).split()
            self.on_cpu = int(fields[0])
            return int(fields[1])
        except (OSError, IndexError, ValueError):
            return 0

    def close(self) -> None:
        """Release the file."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class TransportRunDelay:
    """Run delay summed over this process's communication threads (gloo's, by thread name).

    gloo moves a transfer's bytes on its transport loop (`gloo_tcp_loop`) and runs collectives
    on `pt_gloo_runloop` threads. On an idle host those threads sleep until data arrives; on a
    busy one they are woken and then wait for a core: that wait is CPU contention, not the link.
    The thread list is rescanned at most every `rescan_s` (groups made later add threads).
    """

    NAMES = ("gloo_tcp_loop", "pt_gloo_runloop")

    def __init__(self, rescan_s: float = 1.0):
        self.rescan_ns = int(rescan_s * 1e9)
        self._fds: dict[str, int] = {}
        self._scanned: int | None = None
        self.available = os.path.exists("/proc/thread-self/schedstat")

    def read(self) -> int | None:
        """Run delay so far of the communication threads (ns); None where none is readable."""
        if not self.available:
            return None
        now = time.monotonic_ns()
        if self._scanned is None or now - self._scanned > self.rescan_ns:
            self._scan()
            self._scanned = now
        total, found = 0, False
        for tid, fd in list(self._fds.items()):
            try:
                total += int(os.pread(fd, 96, 0).split()[1])
                found = True
            except (OSError, IndexError, ValueError):
                os.close(self._fds.pop(tid))  # the thread ended
        return total if found else None

    def close(self) -> None:
        """Release the files."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _scan(self) -> None:
        try:
            tids = os.listdir(_TASKS)
        except OSError:
            return
        # Every thread not yet followed is looked at again: a thread names itself once it runs,
        # so one listed just after its group was made may still carry its parent's name (on a
        # busy host for a while); remembering it as "not gloo's" would lose it for good.
        for tid in tids:
            if tid in self._fds:
                continue
            try:
                with open(f"{_TASKS}/{tid}/comm") as f:
                    name = f.read().strip()
                if name in self.NAMES:
                    self._fds[tid] = os.open(f"{_TASKS}/{tid}/schedstat", os.O_RDONLY)
            except OSError:
                continue


class CommWaitProbe:
    """What a communication op's threads waited for a CPU: the calling thread's own run delay
    plus gloo's communication threads'. Create and use it on one thread."""

    def __init__(self):
        self.own = RunDelay()
        self.transport = TransportRunDelay()
        # the calling thread's run delay (ns) read at the end of the last `waited_s` (None
        # where schedstat is not readable): where compute resumes after the op, the start of
        # its run delay, read for free (record/modelparallel.py)
        self.own_last: int | None = None
        # the calling thread's on-CPU time (ns) read with `own_last`
        self.own_cpu_last = 0

    def mark(self) -> tuple[int, int | None]:
        """The counters now (pass to `waited_s` after the op)."""
        return self.own.read(), self.transport.read()

    def waited_s(self, mark: tuple[int, int | None]) -> float:
        """Seconds waited since `mark` (NaN where schedstat is not readable)."""
        own0, tr0 = mark
        own1, tr1 = self.own.read(), self.transport.read()
        self.own_last = own1 if self.own.readable else None
        self.own_cpu_last = self.own.on_cpu
        if tr0 is None or tr1 is None:
            return float("nan")
        return (max(0, own1 - own0) + max(0, tr1 - tr0)) / 1e9

    def close(self) -> None:
        """Release the files."""
        self.own.close()
        self.transport.close()
