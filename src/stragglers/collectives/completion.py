"""DDP comm-hook futures that gloo never calls back into Python.

DDP's own Python hooks end with `fut.then(fn)`: `fn` runs, and is freed, on a gloo worker
thread, which then has to take the GIL. One that must do so while the interpreter is finalizing
is ended by `pthread_exit` inside a noexcept C++ frame, and the process aborts with "terminate
called without an active exception" after the job's work is done. Here a thread of ours waits
for the collective and completes a Future made in Python, so gloo is never handed a Python
object and its threads never need the GIL.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

import torch
import torch.distributed as dist


class CompletionThread:
    """Waits submitted works in submission order and completes a Future for each.

    The thread starts on first use and again after `stop()` (a hook DDP keeps calling after its
    owner closed); while idle it blocks in a queue without the GIL, which is safe at exit.
    """

    def __init__(self, name: str):
        self.name = name
        self._jobs: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def complete(self, waitable, result: Callable[[], object],
                 on_done: Callable[[], None] | None = None,
                 device: torch.device | None = None) -> torch.futures.Future:
        """A Future of `result()`, set once `waitable.wait()` returns; `on_done()` runs first."""
        cuda = device if device is not None and device.type == "cuda" else None
        # On CUDA the future records the waiting thread's stream, so DDP's use of the result
        # is ordered after the collective (waiting made that stream wait on it).
        fut: torch.futures.Future = (torch.futures.Future(devices=[cuda]) if cuda is not None
                                     else torch.futures.Future())
        self._queue().put((waitable, result, on_done, cuda, fut))
        return fut

    def stop(self) -> None:
        """Finish the submitted works, end the thread and join it."""
        with self._lock:
            jobs, thread = self._jobs, self._thread
            self._jobs = self._thread = None
        if thread is not None and jobs is not None:     # set and cleared together
            jobs.put(None)
            thread.join()

    def _queue(self) -> queue.SimpleQueue:
        with self._lock:
            if self._thread is None or self._jobs is None:
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._run, args=(self._jobs,),
                                                name=self.name, daemon=True)
                self._thread.start()
            return self._jobs

    @staticmethod
    def _run(jobs: queue.SimpleQueue) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            waitable, result, on_done, device, fut = job
            try:
                if device is not None:
                    torch.cuda.set_device(device)  # the current device is per thread
                waitable.wait()
                if on_done is not None:
                    on_done()
                fut.set_result(result())
            except Exception as exc:  # surfaces in the backward pass through the future
                fut.set_exception(exc)


def reduce_bucket(completer: CompletionThread, bucket: dist.GradBucket, group=None,
                  average: bool = True,
                  on_done: Callable[[], None] | None = None) -> torch.futures.Future:
    """DDP's default all-reduce of one bucket (mean, or sum), completed by `completer`."""
    tensor = bucket.buffer()
    group_to_use = group if group is not None else dist.group.WORLD
    if average:
        tensor.div_(dist.get_world_size(group_to_use))
    work = dist.all_reduce(tensor, group=group_to_use, async_op=True)
    return completer.complete(work, lambda: tensor, on_done, tensor.device)
