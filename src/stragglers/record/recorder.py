"""The recorder a training loop uses: step and op spans, recorded communication, GC pauses."""

from __future__ import annotations

import gc
import hashlib
import math
import queue
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from stragglers.collectives.completion import CompletionThread, reduce_bucket
from stragglers.errors import InputError, StragglersError
from stragglers.record import native as native_hooks
from stragglers.record.clock import (ClockEstimate, clock_record, common_origin_ns,
                                     control_channel, gather_objects, measure_offset,
                                     release_control_channel, same_host_as_rank0)
from stragglers.record.settings import RecorderConfig, recorder_config
from stragglers.record.schedstat import CommWaitProbe, RunDelay, TransportRunDelay
from stragglers.record.signals import FlushOnTerm
from stragglers.record.timers import CpuTimer, CudaTimer
from stragglers.record.writer import RankWriter, StepBuffer
from stragglers.trace.model import OPTYPE_CODES, JobMeta
from stragglers.trace.runformat import META_FILE, RANK_FILE, write_meta

if TYPE_CHECKING:
    from stragglers.record.upload import PartUploader


class _NullSpan:
    """The span used outside sampled steps: does nothing, costs one attribute lookup."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NULL = _NullSpan()


class _OpSpan:
    """A foreground op: GC pauses inside it are moved before it, so its duration is its own."""

    __slots__ = ("rec", "buf", "row", "i0", "start", "end")

    def __init__(self, rec: "Recorder", buf: StepBuffer, row: tuple):
        self.rec, self.buf, self.row = rec, buf, row

    def __enter__(self):
        self.i0 = len(self.buf.gc)
        self.start = self.rec.mark()
        return self

    def __exit__(self, *exc):
        self.end = end = self.rec.mark()
        self.rec.add_op(self.buf, self.i0, self.row, self.start, end)
        return False


class _CompletionWaiter:
    """A thread that waits posted works in order and stamps when each completed.

    gloo completes a send only inside wait() (no futures for p2p), and a send completes when the
    peer has posted the matching recv; waiting here keeps the training thread free while the
    row still ends at the real completion time.
    """

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._last_end = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, work: "RecordedWork") -> None:
        """Queue a work; its `completed` event is set when it is done."""
        work.completed = threading.Event()
        self._queue.put(work)

    @staticmethod
    def result(rw: "RecordedWork") -> None:
        """Block until this thread has stamped the work."""
        rw.completed.wait()

    def stop(self) -> None:
        """Let the queued works finish, then end the thread and join it."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        delay, transport = RunDelay(), TransportRunDelay()
        while True:
            rw = self._queue.get()
            if rw is None:
                delay.close()
                transport.close()
                return
            waited_from, transport_from = delay.read(), transport.read()
            try:
                rw.work.wait()
            except BaseException as exc:  # re-raised in the training thread by wait()
                rw.error = exc
            # This thread sleeps inside wait() until the transfer completes; time it then spent
            # runnable but without a CPU (its run delay) is the wake-up of a busy host, not the
            # transfer: the stamp moves back by it (a loaded host otherwise shows a slow link).
            late = delay.read() - waited_from
            rw.end_ns = max(time.perf_counter_ns() - late, rw.start)
            # gloo's threads that moved it may have waited too: the diagnosis weighs that wait
            # against the transfer's lateness (cpu_contention); the row keeps its duration
            transport_to = transport.read()
            rw.cpu_wait = math.nan if transport_from is None or transport_to is None \
                else max(0, transport_to - transport_from) / 1e9
            # Transfers of one direction go out in order: a send posted while the previous one
            # was still in flight starts when that one ends (a stream, as in the model).
            rw.start = max(rw.start, self._last_end)
            self._last_end = rw.end_ns
            rw.completed.set()


class _NativeCompletionWaiter:
    """_CompletionWaiter's work done by a C++ thread (native.cpp: Waiter) that needs no GIL to
    take a posted work, wait for it and stamp its completion."""

    def __init__(self, native):
        self._native = native

    def watch(self, work: "RecordedWork") -> None:
        """Queue a work; its wait() then takes the result by ticket."""
        work.ticket = self._native.watch(work.work)

    def result(self, rw: "RecordedWork") -> None:
        """Block (without the GIL) until the work is done; fill its end, start and cpu_wait."""
        end, prev_end, cpu_wait, error = self._native.result(rw.ticket)
        if error is not None:
            rw.error = getattr(dist, "DistBackendError", RuntimeError)(error)
        rw.end_ns = max(end, rw.start)
        # in order on one direction: a send posted while the previous was in flight starts
        # when that one ended
        rw.start = min(max(rw.start, prev_end), rw.end_ns)
        rw.cpu_wait = math.nan if cpu_wait < 0 else cpu_wait / 1e9

    def stop(self) -> None:
        """Let the queued works finish, then end the thread and join it."""
        self._native.stop()


def _completion_waiter(name: str) -> _CompletionWaiter | _NativeCompletionWaiter:
    """The native waiter where it is built, else the Python one."""
    native = native_hooks.waiter()
    return _NativeCompletionWaiter(native) if native is not None else _CompletionWaiter(name)


class RecordedWork:
    """A posted p2p op: its row spans from the post to the completion of the transfer."""

    __slots__ = ("work", "rec", "buf", "row", "start", "done", "waiter", "completed", "ticket",
                 "end_ns", "error", "cpu_wait")
    # set by the waiter's watch() (Python waiter: completed; native: ticket) and by its result
    completed: threading.Event
    ticket: int
    waiter: "_CompletionWaiter | _NativeCompletionWaiter | None"
    end_ns: int | None
    error: BaseException | None

    def __init__(self, work, rec: "Recorder", buf: StepBuffer | None, row: tuple, start,
                 waiter: "_CompletionWaiter | _NativeCompletionWaiter | None" = None):
        self.work, self.rec, self.buf, self.row, self.start = work, rec, buf, row, start
        self.done = False
        self.waiter = self.error = self.end_ns = None
        self.cpu_wait = math.nan
        if buf is not None:
            if buf.pending is None:
                buf.pending = []
            buf.pending.append(self)
            if waiter is not None:
                self.waiter = waiter
                waiter.watch(self)

    def wait(self) -> None:
        """Wait for the transfer and close the row."""
        if self.done:
            return
        if self.waiter is not None:
            self.waiter.result(self)
            if self.error is not None:
                raise self.error
            end = self.end_ns
        else:
            self.work.wait()
            end = self.rec.mark() if self.buf is not None else None
        self.done = True
        if self.buf is not None:
            code, mb, mc, gmc, nbytes = self.row
            self.buf.ops.append((code, self.start, end, mb, mc, gmc, math.nan, -1, nbytes, ()))
            if self.cpu_wait == self.cpu_wait:  # measured (not NaN)
                self.buf.add_cpu_wait(code, end, self.cpu_wait)

    def is_completed(self) -> bool:
        """Whether the underlying work has finished (does not close the row)."""
        return self.work.is_completed()


class Recorder:
    """Record one rank's ops into a run directory (our format), sampling one step in k.

    Use as a context manager around the training loop; every rank of the job creates one.
    `start()` (called by `__enter__`) is a collective: it measures the clock offset to rank 0
    and rank 0 writes meta.json with the rank layout. `close()` re-checks the clock and records
    the error estimate in meta.extra["clock"]. Settings: a RecorderConfig (record/settings.py),
    or its fields by name.
    """

    def __init__(self, trace_dir: str | Path, meta: JobMeta, *, dp_rank: int, stage: int,
                 config: RecorderConfig | None = None, device: torch.device | str | None = None,
                 group=None, **settings: Any):
        """`config` holds the settings (RecorderConfig); each may also be given by name
        (`sample_every=2, overwrite=True, monitor=URL`), overriding `config`."""
        self.config = cfg = recorder_config(config, settings)
        self.trace_dir = Path(trace_dir)
        self.meta = meta
        self.dp_rank, self.stage = int(dp_rank), int(stage)
        self.sample_every, self.flush_every = int(cfg.sample_every), int(cfg.flush_every)
        self.flush_interval_s = float(cfg.flush_interval_s)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.group = group
        self.clock_rounds = int(cfg.clock_rounds)
        self.gc_min_ns = int(cfg.gc_min_s * 1e9)
        self.enabled = cfg.enabled
        self.overwrite = cfg.overwrite
        # The live monitor (stragglers.monitor): parts are also uploaded there, off the step.
        self.monitor, self.monitor_token = cfg.monitor, cfg.monitor_token
        self.monitor_job = cfg.monitor_job or self.trace_dir.name
        self.monitor_close_timeout_s = float(cfg.monitor_close_timeout_s)
        self.flush_on_sigterm = cfg.flush_on_sigterm  # record/signals.py
        self._uploader: PartUploader | None = None
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self._timer = CudaTimer(self.device) if self.device.type == "cuda" else CpuTimer()
        # the hook interface attach's recorders use (record/_attach.py, fsdp.py,
        # modelparallel.py, pipelining.py): `mark()` a timestamp of this recorder's clock
        # (perf_counter_ns itself on CPU: the hooks call it per op), `on_gpu`, `buffer`,
        # `add_op`, `begin_step`/`end_step`/`drop_step`, `closed`
        self.mark = self._timer.mark if self._timer.is_cuda else time.perf_counter_ns
        self.on_gpu = self._timer.is_cuda
        self._buf: StepBuffer | None = None
        self._gc_t0 = 0
        self._writer: RankWriter | None = None
        self.clock_start: ClockEstimate | None = None
        self.clock_end: ClockEstimate | None = None
        # rank 0: every rank's estimate at start and at end (meta.extra["clock"])
        self._clock_starts: list[ClockEstimate] = []
        self._clock_ends: list[ClockEstimate] = []
        self.offset_applied = False
        self._closed = False
        self._waiters: dict[str, _CompletionWaiter | _NativeCompletionWaiter] = {}
        self._ddp_completer = CompletionThread("stragglers-ddp-buckets")
        self._probes = threading.local()  # per calling thread: its CommWaitProbe
        # what a caller adds to this rank's entry of meta.extra["layout"] (attach: tp_rank...),
        # and a function that sees every rank's entry once gathered (on every rank, before
        # rank 0 writes meta.json; it may take keys out: attach's process groups)
        self.layout_extra: dict = {}
        self.on_layout = None
        self.layout: list[dict] | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> "Recorder":
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # After a failure the peers may be gone: flush what we have, skip the collectives.
        self.close(collective=exc_type is None)

    def start(self) -> None:
        """Measure the clock offset, write meta.json (rank 0), start the background writer."""
        if self.world_size != self.meta.world_size:
            raise StragglersError(f"Recorder: meta.world_size is {self.meta.world_size} but the "
                                  f"process group has {self.world_size} ranks")
        if not self.enabled:  # every rank is off together, so skipping the collectives is safe
            self._closed = True
            return
        offset, origin = 0, time.perf_counter_ns()
        layout: list[Any]  # every rank's entry (all_gather_object fills the list)
        if self.distributed:
            # Control traffic on gloo (or the backend's device): never CPU tensors into NCCL.
            self._ctl = control_channel(self.group)
            self._check_output_dir(self._ctl.group)
            self.clock_start = measure_offset(self.clock_rounds, channel=self._ctl)
            # One host reads one CLOCK_MONOTONIC: the true offset is 0, and applying a measured
            # value would only add its error. Across hosts the measured offset is applied.
            self.offset_applied = not same_host_as_rank0(self._ctl.group)
            offset = self.clock_start.offset_ns if self.offset_applied else 0
            origin = common_origin_ns(offset, channel=self._ctl)
            layout = [None] * self.world_size
            dist.all_gather_object(layout, self._layout_entry(), group=self._ctl.group)
        else:
            self._check_output_dir(None)
            self.clock_start = ClockEstimate(0, 0, 0, 0)
            layout = [self._layout_entry()]
        if self.on_layout is not None:
            self.on_layout(layout)
        self.layout = layout
        self._offset_ns, self._origin_ns = offset, origin
        # One token a run, the same on every rank (rank 0's start time, broadcast): the monitor
        # tells this run's uploads from another run's under the same job name by it
        self.run_token = hashlib.sha256(f"{self.meta.run_id}:{origin}".encode()).hexdigest()[:16]
        if self.monitor:
            from stragglers.record.upload import PartUploader
            self._uploader = PartUploader(self.monitor, self.monitor_token, self.monitor_job,
                                          self.rank, run=self.run_token)
        if self.rank == 0:
            # started: when the run began by the wall clock, so the monitor refuses a stale
            # run's meta.json (begun before the current run) however many runs replaced it
            recorder = {"sample_every": self.sample_every,
                        "timer": "cuda-events" if self._timer.is_cuda else "perf_counter_ns",
                        "clock_offset_applied": self.offset_applied,
                        "gc_min_s": self.gc_min_ns / 1e9}
            self.meta.extra.update(run=self.run_token, started=time.time(), layout=layout,
                                   recorder=recorder, clock={"start": [None] * self.world_size})
            write_meta(self.trace_dir, self.meta)
            if self._uploader is not None:
                self._uploader.submit_meta(self.meta.to_dict())
        self._writer = RankWriter(self.trace_dir, self.rank, self.dp_rank, self.stage, self._timer,
                                  offset, origin, self.flush_every,
                                  self.flush_interval_s, uploader=self._uploader)
        # Only the training thread's collections are pauses of the step: one run by a waiter
        # thread can sit in a finalizer that releases the GIL while training computes (seen: a
        # 57 ms "gc" row across a forward).
        self._gc_thread = threading.get_ident()
        gc.callbacks.append(self._on_gc)
        self._on_term = FlushOnTerm(self._write_out) if self.flush_on_sigterm else None
        if self.distributed:
            self._gather_clock("start", self.clock_start)

    def close(self, collective: bool = True) -> None:
        """Flush everything, re-check the clock against rank 0 and record the error in meta."""
        if self._closed:
            return
        self._closed = True
        on_term = getattr(self, "_on_term", None)
        if on_term is not None:
            on_term.remove()
        if self._buf is not None:
            self.end_step(failed=not collective)
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        # Every thread the recorder started is joined here, before the caller may destroy the
        # process group: a thread still inside a gloo/NCCL call at teardown aborts the process.
        for waiter in self._waiters.values():
            waiter.stop()
        self._waiters.clear()
        self._ddp_completer.stop()  # a DDP hook called after close starts it again, idle at exit
        probe = getattr(self._probes, "probe", None)
        if probe is not None:
            probe.close()
        if self._writer is not None:
            self._writer.close()
        if collective and self.distributed:
            self.clock_end = measure_offset(self.clock_rounds, channel=self._ctl)
            self._gather_clock("end", self.clock_end)
        ctl = getattr(self, "_ctl", None)
        if ctl is not None:  # the gloo side group (NCCL jobs only) goes with the recorder
            release_control_channel(ctl)
        if self._uploader is not None:  # bounded: a monitor that is away cannot hold us here
            self._uploader.close(self.monitor_close_timeout_s)

    def _write_out(self) -> None:
        """On SIGTERM: put the steps recorded so far on disk and deliver them to the monitor
        (the step under way is incomplete and left out)."""
        if self._writer is not None:
            self._writer.flush()
        if self._uploader is not None:
            self._uploader.drain(self.monitor_close_timeout_s)

    def _check_output_dir(self, ctl_group) -> None:
        """Refuse a directory holding another run unless overwrite=True (then clear our files).

        Decided together: every rank looks before any rank writes (rank 0 writes meta.json only
        after the collectives that follow), and all ranks raise if any one saw files, so no
        rank is left waiting in a collective.
        """
        d = self.trace_dir
        ours = [p for p in d.iterdir() if p.name == META_FILE or RANK_FILE.match(p.name)
                or p.name.endswith(".parquet.tmp")] if d.is_dir() else []
        busy = d.is_dir() and any(d.iterdir())
        seen: list[Any] = [busy]
        if self.distributed:
            seen = [None] * dist.get_world_size(ctl_group)
            dist.all_gather_object(seen, busy, group=ctl_group)
        if any(seen) and not self.overwrite:
            raise InputError(d, None, "is not empty (it holds an earlier run's files); choose a "
                             "new directory or pass overwrite=True to replace the run")
        if self.overwrite and self.rank == 0:
            for p in ours:  # only the run format's files; the user's other files stay
                p.unlink(missing_ok=True)
        if self.overwrite and self.distributed:
            dist.barrier(group=ctl_group)  # nobody writes before the old run is gone

    def _layout_entry(self) -> dict:
        return {"rank": self.rank, "dp_rank": self.dp_rank, "stage": self.stage,
                "host": socket.gethostname(), "cpus": usable_cpus(),
                # torch's intra-op threads: how many cores one computing rank can keep busy
                # (the analysis bounds how much a rank computing beside another delays it)
                "threads": torch.get_num_threads(), **self.layout_extra}

    def record_pg(self, defaults: dict[int, int] | None = None) -> None:
        """Write the pg column (process-group ids) from now on; `defaults`: the group of every
        row of an op type whose rows carry none (DDP's bucket all-reduces)."""
        if self._writer is not None:
            self._writer.pg_defaults.update(defaults or {})
            self._writer.records_pg = True

    def _gather_clock(self, when: str, est: ClockEstimate) -> None:
        entries: list[ClockEstimate] = gather_objects(est, self._ctl)
        if self.rank != 0:
            return
        if when == "start":
            self._clock_starts = entries
        else:
            self._clock_ends = entries
        self.meta.extra.update(clock=clock_record(self._clock_starts, self._clock_ends))
        write_meta(self.trace_dir, self.meta)
        if self._uploader is not None:  # the end clock is the monitor's close marker
            self._uploader.submit_meta(self.meta.to_dict())

    # ---- steps and ops ---------------------------------------------------------------------

    def sampled(self, step: int) -> bool:
        """Whether this step is recorded (one in `sample_every`, while the recorder is open)."""
        return self.enabled and step % self.sample_every == 0 and not self._closed

    @property
    def buffer(self) -> StepBuffer | None:
        """The rows of the sampled step in progress (None outside sampled steps)."""
        return self._buf

    @property
    def closed(self) -> bool:
        """Whether close() ran (or the recorder was never enabled)."""
        return self._closed

    def step(self, step: int):
        """Context manager around one training step; ops are recorded only in sampled steps."""
        return _StepSpan(self, step)

    def op(self, optype: str, mb_id: int = -1, *, seq_lens: Sequence[int] | None = None,
           attn_cost: float = math.nan, tokens: int = -1, nbytes: int = -1, mc: int = 0,
           gmc: int | None = None):
        """Context manager timing one compute op (forward-compute, backward-compute, optimizer)."""
        buf = self._buf
        if buf is None:
            return _NULL
        if seq_lens is not None:
            attn_cost = float(sum(int(s) * int(s) for s in seq_lens))
            tokens = int(sum(int(s) for s in seq_lens))
        gmc = mc * self.meta.pp_size + self.stage if gmc is None else gmc  # global model chunk
        row = (OPTYPE_CODES[optype], mb_id, mc, gmc, attn_cost, tokens, nbytes)
        return _OpSpan(self, buf, row)

    def add_op(self, buf: StepBuffer, i0: int, row: tuple, start, end) -> None:
        """A foreground op's row (code, mb, mc, gmc, attn, tokens, bytes) from `start` to `end`
        into `buf`; the GC pauses `buf` got since it held `i0` move before the op."""
        code, mb, mc, gmc, attn, tok, nbytes = row
        pauses = ()
        if len(buf.gc) > i0 and not self._timer.is_cuda:
            # The pauses stalled this op: the writer places them before it (see writer.py).
            inside = buf.gc[i0:]
            del buf.gc[i0:i0 + len(inside)]
            pauses = tuple(e - s for s, e in inside)
        buf.ops.append((code, start, end, mb, mc, gmc, attn, tok, nbytes, pauses))

    def _on_gc(self, phase: str, info: dict) -> None:
        if threading.get_ident() != self._gc_thread:
            return
        if phase == "start":
            self._gc_t0 = time.perf_counter_ns()
            return
        buf = self._buf
        if buf is not None and self._gc_t0:
            t1 = time.perf_counter_ns()
            if t1 - self._gc_t0 >= self.gc_min_ns:
                buf.gc.append((self._gc_t0, t1))
        self._gc_t0 = 0

    def begin_step(self, step: int) -> bool:
        """Begin step `step` (ending one in progress); whether it is sampled (recorded)."""
        if self._buf is not None:
            self.end_step()
        if not self.sampled(step):
            return False
        self._buf = StepBuffer(step, self._timer.begin_step(), cpu=time.process_time())
        return True

    def drop_step(self) -> None:
        """Forget the step in progress (cut by close(): it has no end)."""
        self._buf = None

    def end_step(self, failed: bool = False) -> None:
        """Hand the step in progress to the writer (`failed`: drop it)."""
        buf, self._buf = self._buf, None
        if buf is None:
            return
        if failed:
            # The step raised (a peer died, say): its rows are incomplete and its posted works
            # may never finish, so it is dropped; the steps before it are already queued.
            return
        if buf.pending:
            for work in list(buf.pending):
                if not work.done:
                    work.wait()  # a row needs its end; an unwaited send at step end is waited
            buf.pending.clear()
        buf.cpu = time.process_time() - buf.cpu
        if self._writer is not None:
            self._writer.submit(buf)

    # ---- communication ---------------------------------------------------------------------

    def isend(self, tensor: torch.Tensor, dst: int, optype: str = "forward-send", group=None,
              tag: int = 0) -> RecordedWork:
        """dist.isend, recorded from its post to the return of its wait()."""
        return self._p2p(dist.isend, tensor, dst, optype, group, tag)

    def irecv(self, tensor: torch.Tensor, src: int, optype: str = "forward-recv", group=None,
              tag: int = 0) -> RecordedWork:
        """dist.irecv, recorded from its post to the return of its wait()."""
        return self._p2p(dist.irecv, tensor, src, optype, group, tag)

    def recv(self, tensor: torch.Tensor, src: int, optype: str = "forward-recv", group=None,
             tag: int = 0) -> None:
        """A recv posted and waited at once (a foreground op: GC pauses inside move before it)."""
        def receive() -> None:
            work = dist.irecv(tensor, src, group=group, tag=tag)
            if work is not None:  # None: this rank is not in `group` (torch receives nothing)
                work.wait()

        self.collective(optype, receive, nbytes=tensor.numel() * tensor.element_size())

    def _p2p(self, fn, tensor, peer, optype, group, tag) -> RecordedWork:
        buf = self._buf
        start = self.mark() if buf is not None else None
        work = fn(tensor, peer, group=group, tag=tag)
        row = (OPTYPE_CODES[optype], -1, 0, self.stage, tensor.numel() * tensor.element_size())
        waiter = None
        if buf is not None and not self._timer.is_cuda:
            waiter = self._waiters.get(optype)
            if waiter is None:  # one per op type: transfers in one direction complete in order
                waiter = self._waiters[optype] = _completion_waiter(f"stragglers-{optype}")
        return RecordedWork(work, self, buf, row, start, waiter)

    def collective(self, optype: str, fn, *args, nbytes: int = -1, **kwargs):
        """Run a blocking torch.distributed call (or any callable) as one recorded op."""
        buf = self._buf
        if buf is None:
            return fn(*args, **kwargs)
        code = OPTYPE_CODES[optype]
        probe, mark = self.comm_wait_mark()
        with _OpSpan(self, buf, (code, -1, 0, self.stage, math.nan, -1, nbytes)) as span:
            out = fn(*args, **kwargs)
            if hasattr(out, "wait"):  # async_op=True callers still get a completed op
                out.wait()
        self.note_comm_wait(buf, code, span.end, probe, mark)
        return out

    def comm_wait_mark(self) -> tuple:
        """(this thread's CommWaitProbe, its counters now) before a communication op; (None,
        None) on CUDA, where the host does not wait for the transfer."""
        if self._timer.is_cuda:
            return None, None
        probe = getattr(self._probes, "probe", None)
        if probe is None:
            probe = self._probes.probe = CommWaitProbe()
        return probe, probe.mark()

    @staticmethod
    def note_comm_wait(buf: StepBuffer, code: int, end, probe, mark) -> None:
        """Put the CPU waits since `comm_wait_mark` on the row (code, end) of `buf`."""
        if probe is not None:
            buf.add_cpu_wait(code, end, probe.waited_s(mark))

    def all_reduce(self, tensor: torch.Tensor, optype: str = "grads-all-reduce",
                   op=dist.ReduceOp.SUM, group=None) -> None:
        """dist.all_reduce, recorded as `optype`."""
        self.collective(optype, dist.all_reduce, tensor, op=op, group=group,
                        nbytes=tensor.numel() * tensor.element_size())

    def ddp_comm_hook(self, inner=None, optype: str = "grads-all-reduce"):
        """Wrap a DDP communication hook (default: allreduce) so each bucket is a recorded op.

        The bucket's end is stamped, and the future DDP waits on is completed, by a thread of
        the recorder (collectives/completion.py), never by a Python callback on gloo's future.
        """
        code = OPTYPE_CODES[optype]
        last_end = [0]
        completer = self._ddp_completer

        def hook(state, bucket):
            buf = self._buf
            start = None
            if buf is not None:
                ops = buf.ops  # the step's rows (done() runs only for a sampled step)
                start = self.mark()
                flat = bucket.buffer()
                nbytes = flat.numel() * flat.element_size()

            def done():
                # The bucket's collective has completed; the op ends here. Buckets go out in
                # order on one stream: one queued behind the previous starts when that ends.
                end = self.mark()
                s = start
                if isinstance(s, int):
                    s = min(max(s, last_end[0]), end)
                    last_end[0] = max(last_end[0], end)
                ops.append((code, s, end, -1, 0, self.stage, math.nan, -1, nbytes, ()))

            on_done = done if buf is not None else None
            if inner is None:
                return reduce_bucket(completer, bucket, state, on_done=on_done)
            fut = inner(state, bucket)
            return completer.complete(fut, fut.value, on_done, bucket.buffer().device)

        return hook


class _StepSpan:
    """Context manager for one step; yields whether the step is sampled."""

    __slots__ = ("rec", "step_no")

    def __init__(self, rec: Recorder, step: int):
        self.rec, self.step_no = rec, step

    def __enter__(self) -> bool:
        return self.rec.begin_step(self.step_no)

    def __exit__(self, exc_type, exc, tb):
        if self.rec._buf is not None:
            self.rec.end_step(failed=exc_type is not None)
        return False


def usable_cpus() -> str:
    """The CPUs this process may run on, as the kernel lists them ("0-3,8"; its affinity, or
    every CPU where there is none): the reader notes hosts whose ranks outnumber the CPUs they
    may use together (trace/runformat.py, crowded_hosts)."""
    import os

    ids = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else list(range(os.cpu_count() or 1))
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
