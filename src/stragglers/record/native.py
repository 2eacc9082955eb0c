"""Native (C++) recording hooks for attach: built once with torch's extension builder, then loaded.

    python -m stragglers.record.native      # build (~30 s; `make` and `stragglers record` do it)

attach() uses them when they are built and the run is timed on the host clock (CPU): the
backward pass's start and end and DDP's bucket all-reduces are then stamped in C++ (native.cpp)
instead of by Python hooks, which is most of what recording costs the training thread; and the
Recorder's p2p transfers are waited and stamped by a C++ thread (`waiter()`), without the GIL.
When they are not built, attach records with Python hooks (the same rows, at a higher cost per
op) and says so once. STRAGGLERS_RECORD_NATIVE=0 turns them off; =build builds them on first use.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import numpy as np

SOURCE = Path(__file__).with_name("native.cpp")
ENV = "STRAGGLERS_RECORD_NATIVE"
BWD_START, BWD_END, BUCKET_READY, BUCKET_DONE, FWD = 1, 2, 3, 4, 5  # event kinds (native.cpp)
SLOW, FAST, SKIP = 0, 1, 2  # a Forward's modes in a step (native.cpp: Forward::Mode)
_told = False


class _Loaded:
    """The extension once loaded (module), or why it was not (error)."""

    module: Any = None
    error = ""


_loaded = _Loaded()


class RowColumns(NamedTuple):
    """Op rows as columns, one array each: the step, then StepBuffer.ops' fields (code, start
    and end marks, mb, mc, gmc, attn, tokens, bytes), without the pauses."""

    step: np.ndarray
    code: np.ndarray
    start: np.ndarray
    end: np.ndarray
    mb: np.ndarray
    mc: np.ndarray
    gmc: np.ndarray
    attn: np.ndarray
    tokens: np.ndarray
    bytes: np.ndarray


def module_name() -> str:
    """The extension's name: tied to its source, torch and Python, so a change rebuilds it."""
    import torch

    tag = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() +
                         sys.version.encode()).hexdigest()[:12]
    return f"stragglers_native_{tag}"


def build_directory() -> Path:
    """Where it is built and cached: under TORCH_EXTENSIONS_DIR, as torch's own extensions, or
    torch's default (~/.cache/torch_extensions)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / module_name()


def load(build: bool = False):
    """The extension module, or None with the reason in `last_error()`; builds it if `build`."""
    if _loaded.module is not None:
        return _loaded.module
    name, where = module_name(), build_directory()
    library = where / f"{name}.so"
    try:
        if library.exists():
            module = _import(name, library)
        elif build:
            module = _build(name, where)
        else:
            _loaded.error = (f"not built (run `{Path(sys.executable).name} -m "
                                "stragglers.record.native` once)")
            return None
        _check_clock(module)
    except Exception as exc:  # a compiler or torch mismatch: attach falls back to Python hooks
        _loaded.error = _reason(exc)
        return None
    _loaded.module = module
    return module


def last_error() -> str:
    """Why load() returned None."""
    return _loaded.error


def stamps():
    """A fresh native event log for one attach, or None (switched off, or not built: said once)."""
    global _told
    if _switched_off():
        return None
    module = _load_as_switched()
    if module is None:
        if not _told:
            _told = True
            warnings.warn(f"stragglers.record.attach: native hooks unavailable ({last_error()}); "
                          "recording with Python hooks (the same rows, 6-20x the cost per op)",
                          stacklevel=3)
        return None
    return module.Stamps()


def waiter():
    """A native p2p completion waiter (native.cpp: Waiter), or None where the native module is
    switched off or not built (the recorder then waits on a Python thread: the same rows, with
    end stamps late by however long that thread waited for the GIL)."""
    module = None if _switched_off() else _load_as_switched()
    return module.Waiter() if module is not None else None


def _switched_off() -> bool:
    """STRAGGLERS_RECORD_NATIVE=0 (or off/false/no)."""
    return os.environ.get(ENV, "").strip().lower() in ("0", "off", "false", "no")


def _load_as_switched():
    """load(), building first where STRAGGLERS_RECORD_NATIVE=build."""
    return load(build=os.environ.get(ENV, "").strip().lower() == "build")


def last_stamp(stamps: list[bytes]) -> int | None:
    """The latest instant among drained stamps (None if none)."""
    import numpy as np

    flat = np.frombuffer(b"".join(stamps), np.int64).reshape(-1, 4)
    if not len(flat):
        return None
    ends = np.where(flat[:, 0] == FWD, flat[:, 3], flat[:, 2])  # a forward's end is its value
    return int(ends.max())


def stamp_rows(stamps: list[bytes], seq: dict, gc: list, stage: int) -> list[tuple]:
    """A step's native stamps as op rows (stamp_columns' rows, the rows the Python hooks make),
    for a step with something to place: `seq` (mb → (attn_cost, tokens)) goes on its compute
    rows, and the GC pauses inside a compute span go with it (taken out of `gc`; the writer
    places them before the span).
    """
    from stragglers.trace.model import OPTYPE_CODES

    ar_code = OPTYPE_CODES["grads-all-reduce"]
    c = stamp_columns([0], [stamps], stage)
    rows = []
    for code, s, e, mb, gmc, nbytes in zip(*(v.tolist() for v in (
            c.code, c.start, c.end, c.mb, c.gmc, c.bytes))):
        attn, tok = seq.get(mb, (math.nan, -1))
        pauses = ()
        inside = [p for p in gc if s <= p[0] and p[1] <= e] if code != ar_code else ()
        if inside:
            gc[:] = [p for p in gc if not (s <= p[0] and p[1] <= e)]
            pauses = tuple(pe - ps for ps, pe in inside)
        rows.append((code, s, e, mb, 0, gmc, attn, tok, nbytes, pauses))
    return rows


def stamp_columns(steps: list[int], stamps: list[list[bytes]], stage: int) -> RowColumns:
    """Many steps' stamps as op-table columns at once, without a Python loop per event.

    Compute rows first. Per
    step, the boundary events of the backward pass (start, a bucket ready, end) cut it into
    spans: a bucket's all-reduce depends on the compute before it (docs/whatif.md §3). A
    bucket's all-reduce runs from its ready instant, or from the end of the bucket before it
    when it was queued behind that one (one stream, as Recorder.ddp_comm_hook stamps them), to
    its done instant.
    """
    import numpy as np

    from stragglers.trace.model import OPTYPE_CODES

    fwd_code, bwd_code = OPTYPE_CODES["forward-compute"], OPTYPE_CODES["backward-compute"]
    ar_code = OPTYPE_CODES["grads-all-reduce"]
    parts = [np.frombuffer(b"".join(s), np.int64).reshape(-1, 4) for s in stamps]
    ev = np.concatenate(parts) if parts else np.zeros((0, 4), np.int64)
    st = np.repeat(np.asarray(steps, np.int64), [len(p) for p in parts])
    order = np.lexsort((np.arange(len(ev)), ev[:, 2], st))  # by step, then time, stably
    ev, st = ev[order], st[order]
    kind, ident, t, value = ev[:, 0], ev[:, 1], ev[:, 2], ev[:, 3]
    # step, code, start, end, mb, gmc, bytes: the parts of each
    out: list[list[np.ndarray]] = [[] for _ in range(7)]

    def add(step, code, start, end, mb, gmc, nbytes):
        for parts, v in zip(out, (step, code, start, end, mb, gmc, nbytes)):
            parts.append(np.broadcast_to(v, len(start)))

    fwd = kind == FWD  # (mb, start, end)
    add(st[fwd], fwd_code, t[fwd], value[fwd], ident[fwd], 0, -1)
    # backward spans: between a boundary inside an open pass and the next boundary of its step
    b = np.flatnonzero((kind == BWD_START) | (kind == BWD_END) | (kind == BUCKET_READY))
    bk, bst, bt = kind[b], st[b], t[b]
    idx = np.arange(len(b))
    last_start = np.maximum.accumulate(np.where(bk == BWD_START, idx, -1)) if len(b) else idx
    last_end = np.maximum.accumulate(np.where(bk == BWD_END, idx, -1)) if len(b) else idx
    open_after = (last_start > last_end) & (bk != BWD_END)
    open_after &= bst[np.maximum(last_start, 0)] == bst  # a pass of this step
    nxt = idx[:-1][open_after[:-1] & (bst[1:] == bst[:-1])]
    add(bst[nxt], bwd_code, bt[nxt], bt[nxt + 1], ident[b][last_start[nxt]], 0, -1)
    # buckets: each done pairs with the ready just before it of the same bucket in its step
    q = np.flatnonzero((kind == BUCKET_READY) | (kind == BUCKET_DONE))
    q = q[np.lexsort((np.arange(len(q)), ident[q], st[q]))]  # by step, bucket, then time
    pair = (kind[q[:-1]] == BUCKET_READY) & (kind[q[1:]] == BUCKET_DONE) & \
        (st[q[:-1]] == st[q[1:]]) & (ident[q[:-1]] == ident[q[1:]])
    ready, done = q[:-1][pair], q[1:][pair]
    by_done = np.lexsort((t[done], st[done]))  # in the order they completed, per step
    ready, done = ready[by_done], done[by_done]
    # one stream: a bucket queued behind the previous one starts when that one ends
    prev_end = np.r_[0, t[done][:-1]]
    prev_end[np.r_[True, st[done][1:] != st[done][:-1]]] = 0
    start = np.minimum(np.maximum(t[ready], prev_end), t[done])
    add(st[done], ar_code, start, t[done], -1, stage, value[ready])
    step, code, begin, finish, mb, gmc, nbytes = (
        np.concatenate(parts) if parts else np.zeros(0, np.int64) for parts in out)
    n = len(begin)
    return RowColumns(step, code, begin, finish, mb, np.zeros(n, np.int64), gmc,
                      np.full(n, math.nan), np.full(n, -1, np.int64), nbytes)


def _import(name: str, library: Path):
    import importlib.util

    import torch  # noqa: F401  (the extension links against torch's libraries)

    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"{library} is not a loadable extension")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reason(exc: Exception) -> str:
    """One line on why loading or building failed: the compiler's first error where there is
    one (torch's message starts with the whole command line)."""
    text = str(exc)
    errors = [ln.strip() for ln in text.splitlines() if "error:" in ln.lower()]
    line = " ".join((errors[0] if errors else text).split())
    return (line[:300] or type(exc).__name__)


def _build(name: str, where: Path):
    from torch.utils.cpp_extension import load as load_extension

    path = os.environ.get("PATH", "")
    try:  # the ninja wheel's binary, found even when the venv's bin/ is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
    except ImportError:
        pass
    where.mkdir(parents=True, exist_ok=True)
    # torch logs its compiler checks as multi-line banners; a failure is reported in one line
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return load_extension(name, [str(SOURCE)], extra_cflags=["-O2"],
                              build_directory=str(where), verbose=False)
    finally:  # the caller's process as it was
        log.setLevel(level)
        os.environ["PATH"] = path


def _check_clock(module) -> None:
    """The stamps must be on time.perf_counter_ns's clock, which the other rows are on."""
    gap = min(abs(module.now_ns() - time.perf_counter_ns()) for _ in range(5))
    if gap > 50_000_000:
        raise RuntimeError(f"its clock is {gap / 1e9:.3f} s from time.perf_counter_ns")


def main() -> int:
    """Build the hooks (or find them built) and say where; 1 with a one-line reason if not."""
    t0 = time.perf_counter()
    module = load(build=True)
    if module is None:
        print(f"stragglers.record.native: could not build the native hooks: {last_error()}",
              file=sys.stderr)
        return 1
    print(f"stragglers.record.native: ready in {build_directory()} "
          f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
