"""Background flusher: turns recorded steps into op-table parts of our run format, off the step."""

from __future__ import annotations

import queue
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from stragglers.trace.model import OPTYPE_CODES
from stragglers.trace.runformat import write_rank

GC_CODE = OPTYPE_CODES["gc"]


@dataclass
class StepBuffer:
    """What one sampled step recorded: op rows (with unresolved marks) and GC pauses (host ns)."""

    step: int
    anchor: object
    # (optype code, start mark, end mark, mb_id, mc, gmc, attn_cost, tokens, bytes, start shift ns)
    ops: list = field(default_factory=list)
    gc: list = field(default_factory=list)  # (start ns, end ns) of pauses not yet placed
    pending: list = field(default_factory=list)  # posted, not yet waited works


class RankWriter:
    """Owns one rank's output: a thread that resolves marks and writes numbered Parquet parts."""

    def __init__(self, directory: Path, rank: int, dp_rank: int, stage: int, timer,
                 offset_ns: int, origin_ns: int, flush_every: int = 1):
        self.directory = Path(directory)
        self.rank, self.dp_rank, self.stage = rank, dp_rank, stage
        self.timer = timer
        self.offset_ns, self.origin_ns = offset_ns, origin_ns
        self.flush_every = max(1, int(flush_every))
        self.parts_written = 0
        self.steps_written = 0
        self.error: BaseException | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._held: list[dict[str, np.ndarray]] = []
        self._thread = threading.Thread(target=self._run, name=f"stragglers-writer-{rank}",
                                        daemon=True)
        self._thread.start()

    def submit(self, buf: StepBuffer) -> None:
        """Hand a finished step to the background thread (never blocks the caller)."""
        self._queue.put(buf)

    def close(self) -> None:
        """Write everything still queued and stop the thread."""
        self._queue.put(None)
        self._thread.join()
        if self.error is not None:
            warnings.warn(f"stragglers recorder: writing rank {self.rank}'s trace failed: "
                          f"{self.error!r}; the run directory misses those steps", stacklevel=2)

    def _run(self) -> None:
        while True:
            buf = self._queue.get()
            if buf is None:
                self._write_held()
                return
            try:
                self._held.append(self.columns(buf))
                if len(self._held) >= self.flush_every:
                    self._write_held()
            except BaseException as exc:  # keep training alive; report at close
                self.error = exc
                self._held.clear()

    def _write_held(self) -> None:
        if not self._held:
            return
        parts, self._held = self._held, []
        ops = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        write_rank(self.directory, self.rank, ops, part=self.parts_written)
        self.parts_written += 1
        self.steps_written += len(parts)

    def columns(self, buf: StepBuffer) -> dict[str, np.ndarray]:
        """One step's rows as op-table columns on the common clock, with seq_id filled in."""
        timer, anchor = self.timer, buf.anchor
        rows = []
        for code, s, e, mb, mc, gmc, attn, tok, nbytes, shift in buf.ops:
            start = timer.resolve(s, anchor)
            end = timer.resolve(e, anchor)
            rows.append((code, min(start + shift, end), end, mb, mc, gmc, attn, tok, nbytes))
        for s, e in buf.gc:
            rows.append((GC_CODE, s, e, -1, 0, 0, np.nan, -1, -1))
        timer.release(anchor)
        n = len(rows)
        code = np.fromiter((r[0] for r in rows), np.int8, n)
        start = np.fromiter((r[1] for r in rows), np.int64, n)
        end = np.fromiter((r[2] for r in rows), np.int64, n)
        order = np.lexsort((end, start))
        code, start, end = code[order], start[order], end[order]
        seq_id = np.zeros(n, np.int32)
        for c in np.unique(code):
            idx = np.flatnonzero(code == c)
            seq_id[idx] = np.arange(len(idx), dtype=np.int32)

        def col(i, dtype):
            return np.fromiter((rows[j][i] for j in order), dtype, n)

        return {
            "rank": np.full(n, self.rank, np.int32),
            "dp_rank": np.full(n, self.dp_rank, np.int32),
            "stage": np.full(n, self.stage, np.int32),
            "step": np.full(n, buf.step, np.int64),
            "optype": code,
            "start_ts": (start + self.offset_ns - self.origin_ns) / 1e9,
            "duration": (end - start) / 1e9,
            "seq_id": seq_id,
            "mb_id": col(3, np.int32),
            "mc": col(4, np.int32),
            "gmc": col(5, np.int32),
            "attn_cost": col(6, np.float64),
            "tokens": col(7, np.int64),
            "bytes": col(8, np.int64),
        }
