"""The compute op open on the training thread, cut where a recorded collective blocks it."""

from __future__ import annotations

import math
from contextlib import contextmanager

NO_SEQ = (math.nan, -1)


class ComputeSpan:
    """One recorder's open compute op (forward, backward...): the hooks open and close it, a
    blocking collective recorded inside it closes it before the wait and opens the next piece
    after (`blocked`), so compute rows hold compute and the wait shows in the collective's row.

    `seq` maps a microbatch to its (Σs², tokens) for the compute rows (attach's seq_lens).
    """

    __slots__ = ("recorder", "current", "seq")

    def __init__(self, recorder):
        self.recorder = recorder
        # (code, mb, mc, gmc, start mark, gc index)
        self.current: tuple[int, int, int, int, float, int] | None = None
        self.seq: dict[int, tuple[float, int]] = {}

    def open(self, code: int, mb: int, mc: int = 0, gmc: int = 0) -> None:
        """Begin a compute piece now (the step must be sampled: `recorder.buffer` is set)."""
        rec = self.recorder
        self.current = (code, mb, mc, gmc, rec.mark(), len(rec.buffer.gc))

    def close(self):
        """End the open piece now, as a row of the step; its end mark (None when no piece was
        open or the step was dropped)."""
        cur, self.current = self.current, None
        if cur is None:
            return None
        code, mb, mc, gmc, start, i0 = cur
        rec = self.recorder
        if rec.buffer is None:  # the step was dropped (close() cut it)
            return None
        attn, tok = self.seq.get(mb, NO_SEQ) if self.seq else NO_SEQ
        end = rec.mark()
        rec.add_op(rec.buffer, i0, (code, mb, mc, gmc, attn, tok, -1), start, end)
        return end

    @property
    def mb(self) -> int:
        """The open piece's microbatch (-1 when none is open)."""
        return self.current[1] if self.current is not None else -1

    @contextmanager
    def blocked(self):
        """Around a wait on a recorded collective: the open piece ends, and a new one of the
        same op begins after the wait."""
        cur = self.current
        live = cur is not None and self.recorder.buffer is not None
        if live:
            self.close()
        try:
            yield
        finally:
            if live and cur is not None and self.recorder.buffer is not None:
                self.open(*cur[:4])
