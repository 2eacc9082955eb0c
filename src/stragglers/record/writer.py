"""Background flusher: turns recorded steps into op-table parts of our run format, off the step."""

from __future__ import annotations

import math
import queue
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from stragglers.record.native import RowColumns, stamp_columns, stamp_rows
from stragglers.trace.model import OPTYPE_CODES
from stragglers.trace.runformat import write_rank

GC_CODE = OPTYPE_CODES["gc"]


@dataclass(slots=True)
class StepBuffer:
    """What one sampled step recorded: op rows (with unresolved marks) and GC pauses (host ns).

    Slots, and containers only where a step has something to hold: thousands of steps a second
    each allocating a few more objects make Python's collector run more often in the training
    thread.
    """

    step: int
    anchor: object
    # (optype code, start mark, end mark, mb_id, mc, gmc, attn_cost, tokens, bytes, pauses inside)
    ops: list = field(default_factory=list)
    gc: list = field(default_factory=list)  # (start ns, end ns) of pauses not yet placed
    pending: list | None = None  # posted, not yet waited works
    # (optype code, end mark) of a communication row → s its threads waited for a CPU during it
    # (record/schedstat.py); rows not in it get NaN. Keyed by the end: placing GC pauses may
    # move a row's start, never its end.
    cpu_waits: dict[tuple[int, object], float] | None = None
    # (optype code, end mark) of a compute piece between two model-parallel collectives → s it
    # ran on a CPU (record/modelparallel.py); the cpu_time column of a part that has one
    cpu_times: dict[tuple[int, object], float] | None = None
    # native hooks (attach on CPU, record/native.py): raw stamps, made into rows here, off the
    # training thread; seq: mb → (attn_cost, tokens) for their rows
    stamps: list[bytes] | None = None
    seq: dict[int, tuple[float, int]] | None = None
    # (optype code, end mark) of a collective row → its process group's job-wide id
    # (record/modelparallel.py: GroupIds); rows not in it get the writer's default for their code
    pgs: dict[tuple[int, object], int] | None = None
    # (optype code, end mark) of an all-to-all row → the rows this rank sent in it
    # (record/modelparallel.py): the sent column of a part that has one, -1 on other rows
    sent: dict[tuple[int, object], int] | None = None
    # the process's CPU time (every thread's: the training thread, gloo's, the writer's) when
    # the step began, then its CPU seconds over the step: the step_cpu column. A host's ranks
    # cannot do their steps' CPU work faster than their CPUs allow (whatif/causes/host_cores.py)
    cpu: float = math.nan

    def add_stamps(self, stamps: bytes) -> None:
        """Native stamps drained from the hooks (b"" when there were none)."""
        if stamps:
            if self.stamps is None:
                self.stamps = [stamps]
            else:
                self.stamps.append(stamps)

    def add_cpu_wait(self, code: int, end, seconds: float) -> None:
        """The CPU waits of the communication row (code, end)."""
        if self.cpu_waits is None:
            self.cpu_waits = {}
        self.cpu_waits[(code, end)] = seconds

    def add_cpu_time(self, code: int, end, seconds: float) -> None:
        """The on-CPU time of the compute row (code, end)."""
        if self.cpu_times is None:
            self.cpu_times = {}
        self.cpu_times[(code, end)] = seconds

    def add_pg(self, code: int, end, pg: int) -> None:
        """The process group of the collective row (code, end)."""
        if self.pgs is None:
            self.pgs = {}
        self.pgs[(code, end)] = pg

    def add_sent(self, code: int, end, rows: int) -> None:
        """The rows this rank sent in the all-to-all row (code, end)."""
        if self.sent is None:
            self.sent = {}
        self.sent[(code, end)] = rows


MAX_HELD_ROWS = 250_000  # converted rows held for the next part (~30 MB) before it is written


class RankWriter:
    """Owns one rank's output: a thread that resolves marks and writes numbered Parquet parts."""

    def __init__(self, directory: Path, rank: int, dp_rank: int, stage: int, timer,
                 offset_ns: int, origin_ns: int, flush_every: int = 64,
                 flush_interval_s: float = 1.0, uploader=None):
        self.directory = Path(directory)
        self.uploader = uploader  # a stragglers.record.upload.PartUploader, or None
        self.rank, self.dp_rank, self.stage = rank, dp_rank, stage
        self.timer = timer
        self.offset_ns, self.origin_ns = offset_ns, origin_ns
        # Pending steps are converted every flush_interval_s, or earlier when flush_every are
        # pending (bounded memory); a part is written every flush_interval_s (or at flush and
        # close, or when MAX_HELD_ROWS are held): few files and little CPU — writing a Parquet
        # file costs the same for 10 rows as for 10,000, and this thread's work is taken from
        # the training thread's (the GIL, the cores) — yet a crash loses at most
        # ~flush_interval_s.
        self.flush_every = max(1, int(flush_every))
        self.flush_interval_s = float(flush_interval_s)
        self.parts_written = 0
        self.steps_written = 0
        self.error: BaseException | None = None
        # the pg column (job-wide process-group ids) is written once the recorder asks for it
        # (a model-parallel layout, or the first model-parallel collective): per row from the
        # step's pgs, else pg_defaults[code] (DDP's group for its buckets), else -1
        self.records_pg = False
        self.pg_defaults: dict[int, int] = {}
        # The training thread only appends to a deque (atomic, no lock, no thread wake-up per
        # step): waking the writer for every step made it take the GIL in the middle of the
        # step and stall the training thread for its conversion work. The writer wakes on its
        # own every flush_interval_s, or early when flush_every steps are pending.
        self._pending: deque[StepBuffer] = deque()
        self._wake: queue.SimpleQueue = queue.SimpleQueue()
        self._held: list[dict[str, np.ndarray]] = []
        self._held_steps = self._held_rows = 0
        self._thread = threading.Thread(target=self._run, name=f"stragglers-writer-{rank}",
                                        daemon=True)
        self._thread.start()

    def submit(self, buf: StepBuffer) -> None:
        """Hand a finished step to the background thread (never blocks, rarely wakes it)."""
        self._pending.append(buf)
        if len(self._pending) == self.flush_every:
            self._wake.put(True)

    def flush(self, timeout: float = 30.0) -> bool:
        """Write the steps queued so far now; True once they are on disk (the thread goes on)."""
        done = threading.Event()
        self._wake.put(done)
        deadline = time.monotonic() + timeout
        while not done.wait(0.05):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                return False
        return True

    def close(self) -> None:
        """Write everything still queued and stop the thread (joined before returning)."""
        self._wake.put(None)
        self._thread.join()
        if self.error is not None:
            warnings.warn(f"stragglers recorder: writing rank {self.rank}'s trace failed: "
                          f"{self.error!r}; the run directory misses those steps", stacklevel=2)

    def _run(self) -> None:
        written = time.monotonic()
        while True:
            try:
                msg = self._wake.get(timeout=self.flush_interval_s)
            except queue.Empty:
                msg = True  # the interval passed: write what is pending
            try:
                bufs = []
                while self._pending:
                    bufs.append(self._pending.popleft())
                if bufs:  # converted together: numpy's cost per call is paid once, not per step
                    held = self.columns(*bufs)
                    self._held.append(held)
                    self._held_steps += len(bufs)
                    self._held_rows += len(held["step"])
                if msg is not True or self._held_rows >= MAX_HELD_ROWS or \
                        time.monotonic() - written >= self.flush_interval_s:
                    self._write_held()
                    written = time.monotonic()
            except BaseException as exc:  # keep training alive; report at close
                self.error = exc
                self._held.clear()
                self._held_steps = self._held_rows = 0
            if isinstance(msg, threading.Event):  # flush(): its caller waits for this
                msg.set()
            elif msg is None:
                return

    def _write_held(self) -> None:
        if not self._held:
            return
        parts, self._held = self._held, []
        ops = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        path = write_rank(self.directory, self.rank, ops, part=self.parts_written)
        if self.uploader is not None:  # non-blocking: a bounded buffer and its own thread
            self.uploader.submit(self.parts_written, path.read_bytes())
        self.parts_written += 1
        self.steps_written += self._held_steps
        self._held_steps = self._held_rows = 0

    def columns(self, *bufs: StepBuffer) -> dict[str, np.ndarray]:
        """Steps' rows as op-table columns on the common clock, with seq_id filled in."""
        rows: list[tuple] = []
        step_of: list[tuple[int, int]] = []
        # (step, optype code, end mark) of a row → its CPU wait / its process group
        waits: dict[tuple[int, int, object], float] = {}
        cpu: dict[tuple[int, int, object], float] = {}
        pgs: dict[tuple[int, int, object], int] = {}
        sent: dict[tuple[int, int, object], int] = {}
        batch: list[StepBuffer] = []
        for buf in bufs:
            step_rows = self._rows(buf, batch)
            rows.extend(step_rows)
            step_of.append((buf.step, len(step_rows)))
            for (row_code, row_end), wait in (buf.cpu_waits or {}).items():
                waits[(buf.step, row_code, row_end)] = wait
            for (row_code, row_end), on_cpu in (buf.cpu_times or {}).items():
                cpu[(buf.step, row_code, row_end)] = on_cpu
            for (row_code, row_end), pg in (buf.pgs or {}).items():
                pgs[(buf.step, row_code, row_end)] = pg
            for (row_code, row_end), rows_sent in (buf.sent or {}).items():
                sent[(buf.step, row_code, row_end)] = rows_sent
        # Column-wise conversion in C (zip, np.array): the writer holds the GIL for less time.
        cols = list(zip(*rows)) if rows else [()] * 10
        c = RowColumns(np.repeat(np.array([s for s, _ in step_of], np.int64),
                                 np.array([k for _, k in step_of], np.int64)),
                       *(np.array(cols[i], dtype) for i, dtype in enumerate(ROW_DTYPES)))
        if batch:  # native stamps of steps with nothing to place: decoded together
            more = stamp_columns([b.step for b in batch], [b.stamps or [] for b in batch],
                                 self.stage)
            c = RowColumns(*(np.concatenate([v, m.astype(v.dtype)]) for v, m in zip(c, more)))
        n = len(c.step)
        order = np.lexsort((c.end, c.start, c.step))
        c = RowColumns(*(v[order] for v in c))
        step, code, start, end = c.step, c.code, c.start, c.end
        # seq_id: the row's place among its step's rows of its op type, in time order
        by_kind = np.lexsort((np.arange(n), code, step))
        seq_id = np.zeros(n, np.int32)
        if n:
            key_sorted = step[by_kind] * 256 + code[by_kind]
            first = np.flatnonzero(np.r_[True, key_sorted[1:] != key_sorted[:-1]])
            group_start = np.repeat(first, np.diff(np.r_[first, n]))
            seq_id[by_kind] = (np.arange(n) - group_start).astype(np.int32)
        out: dict[str, np.ndarray] = {
            "rank": np.full(n, self.rank, np.int32),
            "dp_rank": np.full(n, self.dp_rank, np.int32),
            "stage": np.full(n, self.stage, np.int32),
            "step": step,
            "optype": code,
            "start_ts": (start + self.offset_ns - self.origin_ns) / 1e9,
            "duration": (end - start) / 1e9,
            "seq_id": seq_id,
            "mb_id": c.mb.astype(np.int32),
            "mc": c.mc.astype(np.int32),
            "gmc": c.gmc.astype(np.int32),
            "attn_cost": c.attn,
            "tokens": c.tokens,
            "bytes": c.bytes,
            "cpu_wait": _cpu_waits(waits, step, code, end),
        }
        if self.records_pg:
            out["pg"] = _pgs(pgs, self.pg_defaults, step, code, end)
        if cpu:  # reading fills the column with NaN in parts without it (runformat)
            out["cpu_time"] = _cpu_waits(cpu, step, code, end)
        used = {b.step: b.cpu for b in bufs if math.isfinite(b.cpu)}
        if used:  # reading fills the column with NaN in parts without it (runformat)
            out["step_cpu"] = np.array([used.get(s, math.nan) for s in step.tolist()], np.float64)
        if sent:  # reading fills the column with -1 in parts without it (runformat)
            out["sent"] = np.array([sent.get(key, -1) for key in
                                    zip(step.tolist(), code.tolist(), end.tolist())], np.int64)
        return out

    def _rows(self, buf: StepBuffer, batch: list) -> list:
        """One step's rows on the host clock, native stamps made rows, GC pauses placed; a step
        whose native stamps need nothing placed goes to `batch` (decoded with the others)."""
        timer, anchor = self.timer, buf.anchor
        rows = buf.ops
        if timer.is_cuda:
            rows = [(r[0], timer.resolve(r[1], anchor), timer.resolve(r[2], anchor), *r[3:])
                    for r in rows]
        timer.release(anchor)
        if buf.stamps and buf.gc:
            # the native hooks begin a step as the last one ends: pauses before its first op
            # fell between the steps (the Python hooks begin it at its first forward)
            starts = [int(np.frombuffer(b, np.int64)[2::4].min()) for b in buf.stamps if b]
            starts += [r[1] for r in rows]
            first = min(starts, default=None)
            buf.gc = [p for p in buf.gc if first is not None and p[0] >= first]
        pauses = buf.gc or any(r[9] for r in rows)
        if buf.stamps:
            if not pauses and not buf.seq and not buf.pgs:
                batch.append(buf)
                return rows
            rows = rows + stamp_rows(buf.stamps, buf.seq or {}, buf.gc, self.stage)
            if buf.pgs:  # collectives inside natively timed compute: cut it there
                rows = cut_compute_at_collectives(rows)
            pauses = pauses or any(r[9] for r in rows)
        if pauses:  # GC pauses to place (rare): row by row
            rows = [list(r) for r in rows]
            rows.extend(place_gc_pauses(rows, buf.gc, self.stage))
        return rows


# The dtypes of a StepBuffer.ops row's fields (code, start, end, mb, mc, gmc, attn, tokens,
# bytes: RowColumns after the step)
ROW_DTYPES = (np.int8, np.int64, np.int64, np.int32, np.int32, np.int32, np.float64, np.int64,
              np.int64)


def _cpu_waits(waits: dict, step: np.ndarray, code: np.ndarray, end: np.ndarray) -> np.ndarray:
    """The cpu_wait (or cpu_time) column: each row's measured seconds, NaN where none was."""
    out = np.full(len(code), np.nan)
    if waits:
        for i, key in enumerate(zip(step.tolist(), code.tolist(), end.tolist())):
            out[i] = waits.get(key, np.nan)
    return out


def _pgs(pgs: dict, defaults: dict, step: np.ndarray, code: np.ndarray,
         end: np.ndarray) -> np.ndarray:
    """The pg column: each row's recorded group, else its op type's default, else -1."""
    out = np.full(len(code), -1, np.int32)
    for c, pg in defaults.items():
        out[code == c] = pg
    if pgs:
        for i, key in enumerate(zip(step.tolist(), code.tolist(), end.tolist())):
            pg = pgs.get(key)
            if pg is not None:
                out[i] = pg
    return out


FWD_BWD = (OPTYPE_CODES["forward-compute"], OPTYPE_CODES["backward-compute"])
BLOCKING_CUTS = tuple(OPTYPE_CODES[n] for n in ("all-reduce", "all-gather", "reduce-scatter",
                                                "all-to-all"))


def cut_compute_at_collectives(rows: list[tuple]) -> list[tuple]:
    """Compute rows that hold blocking collectives (native forward/backward spans, timed in C++
    around the whole call) become the pieces between them, and the collectives take the
    piece's microbatch; a piece's GC pauses (durations only) stay with the first piece. Rows
    are StepBuffer.ops tuples."""
    colls = sorted((r for r in rows if r[0] in BLOCKING_CUTS), key=lambda r: r[1])
    if not colls:
        return rows
    out = [r for r in rows if r[0] not in FWD_BWD and r[0] not in BLOCKING_CUTS]
    placed = set()
    for r in rows:
        if r[0] not in FWD_BWD:
            continue
        inside = [c for c in colls if r[1] <= c[1] and c[2] <= r[2]]
        start, pauses = r[1], r[9]
        for c in inside:
            out.append((r[0], start, max(c[1], start), *r[3:9], pauses))
            out.append((*c[:3], r[3] if c[3] < 0 else c[3], *c[4:]))
            placed.add(id(c))
            start, pauses = c[2], ()
        out.append((r[0], start, max(r[2], start), *r[3:9], pauses))
    out.extend(c for c in colls if id(c) not in placed)
    return out


TAIL = tuple(OPTYPE_CODES[n] for n in (
    "params-all-gather", "grads-reduce-scatter", "separate-grads-all-reduce", "grads-all-reduce",
    "layernorm-grads-all-reduce", "embedding-grads-all-reduce", "optimizer-clip-main-grad",
    "optimizer"))


def place_gc_pauses(rows: list[list], free: list[tuple[int, int]], gmc: int = 0) -> list[list]:
    """Turn GC pauses into `gc` rows, one per compute slot, and move op starts past their pauses.

    The dependency model (docs/whatif.md §3) has one gc op per slot between consecutive
    forward/backward ops, and one between the last of them and the step tail. A pause inside an
    op moves before it (the op's start shifts by the pause, so its duration is its own), and the
    pauses of one slot merge into one row: it starts at the slot's first pause and lasts their
    sum, which still ends before the op that closes the slot. Pauses after the first tail op
    (all-reduce, clip, optimizer) have no slot: they stay inside their op, or, between ops,
    show as launch delay. Rows are [code, start, end, ..., pauses] and are changed in place.
    """
    comp_ends = sorted(r[2] for r in rows if r[0] in FWD_BWD)
    last_comp_end = comp_ends[-1] if comp_ends else None
    tail_start = min((r[1] for r in rows if r[0] in TAIL and
                      (last_comp_end is None or r[1] >= last_comp_end)), default=None)
    pauses = [(s, e - s) for s, e in free]  # (start, duration)
    for r in rows:
        if not r[9]:
            continue
        if tail_start is not None and r[1] > tail_start:
            r[9] = ()
            continue  # past the first tail op: the pause stays inside this op
        t = r[1]
        for d in r[9]:
            pauses.append((t, d))
            t += d
        r[1] = min(t, r[2])
        r[9] = ()
    if tail_start is not None:
        pauses = [(s, d) for s, d in pauses if s <= tail_start]
    comp_starts = np.sort(np.fromiter((r[1] for r in rows if r[0] in FWD_BWD), np.int64))
    merged: dict[int, list[int]] = {}
    for s, d in sorted(pauses):
        slot = int(np.searchsorted(comp_starts, s, side="right"))
        if slot in merged:
            merged[slot][1] += d
        else:
            merged[slot] = [s, d]
    return [[GC_CODE, s, s + d, -1, 0, gmc, np.nan, -1, -1, ()] for s, d in merged.values()]
