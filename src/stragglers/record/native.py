"""Native (C++) recording hooks for attach: built once with torch's extension builder, then loaded.

    python -m stragglers.record.native      # build (~30 s; `make` and `stragglers record` do it)

attach() uses them when they are built and the run is timed on the host clock (CPU): the
backward pass's start and end and DDP's bucket all-reduces are then stamped in C++ (native.cpp)
instead of by Python hooks, which is most of what recording costs the training thread. When they
are not built, attach records with Python hooks (the same rows, at a higher cost per op) and says
so once. STRAGGLERS_RECORD_NATIVE=0 turns them off; =build builds them on first use.
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

SOURCE = Path(__file__).with_name("native.cpp")
ENV = "STRAGGLERS_RECORD_NATIVE"
BWD_START, BWD_END, BUCKET_READY, BUCKET_DONE = 1, 2, 3, 4  # event kinds (native.cpp)
_loaded: dict = {}
_told = False


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
    if "module" in _loaded:
        return _loaded["module"]
    name, where = module_name(), build_directory()
    library = where / f"{name}.so"
    try:
        if library.exists():
            module = _import(name, library)
        elif build:
            module = _build(name, where)
        else:
            _loaded["error"] = (f"not built (run `{Path(sys.executable).name} -m "
                                "stragglers.record.native` once)")
            return None
        _check_clock(module)
    except Exception as exc:  # a compiler or torch mismatch: attach falls back to Python hooks
        _loaded["error"] = _reason(exc)
        return None
    _loaded["module"] = module
    return module


def last_error() -> str:
    """Why load() returned None."""
    return _loaded.get("error", "")


def stamps():
    """A fresh native event log for one attach, or None (switched off, or not built: said once)."""
    global _told
    mode = os.environ.get(ENV, "").strip().lower()
    if mode in ("0", "off", "false", "no"):
        return None
    module = load(build=mode == "build")
    if module is None:
        if not _told:
            _told = True
            warnings.warn(f"stragglers.record.attach: native hooks unavailable ({last_error()}); "
                          "recording with Python hooks, ~10x the cost per op", stacklevel=3)
        return None
    return module.Stamps()


def stamp_events(stamps: list[bytes]) -> list[tuple[int, int, int, int]]:
    """Drained stamps (Stamps.drain()'s bytes) as (kind, id, ns, bytes) events in time order."""
    import numpy as np

    flat = np.frombuffer(b"".join(stamps), np.int64).reshape(-1, 4)
    return [tuple(e) for e in flat[np.argsort(flat[:, 2], kind="stable")].tolist()]


def last_stamp(stamps: list[bytes]) -> int | None:
    """The latest instant among drained stamps (None if none)."""
    import numpy as np

    flat = np.frombuffer(b"".join(stamps), np.int64)
    return int(flat[2::4].max()) if flat.size else None


def stamp_rows(stamps: list[bytes], seq: dict, gc: list, stage: int) -> list[tuple]:
    """A step's native stamps as op rows, the rows the Python hooks make (run by the writer).

    A backward span is split where a DDP bucket became ready (its all-reduce depends on the
    compute before it, specs/whatif.md §3); GC pauses inside a span go with it (taken out of
    `gc`; the writer places them before the span). `seq`: mb → (attn_cost, tokens).
    """
    from stragglers.trace.model import OPTYPE_CODES

    bwd_code, ar_code = OPTYPE_CODES["backward-compute"], OPTYPE_CODES["grads-all-reduce"]
    comms, spans = [], []
    bwd = None  # (mb, start) of the open backward span
    ready: dict[int, tuple[int, int]] = {}
    last_end = 0
    for kind, ident, t, nbytes in stamp_events(stamps):
        if kind == BWD_START:
            bwd = (ident, t)
        elif kind == BWD_END and bwd is not None:
            spans.append((bwd[0], bwd[1], t))
            bwd = None
        elif kind == BUCKET_READY:
            ready[ident] = (t, nbytes)
            if bwd is not None:
                spans.append((bwd[0], bwd[1], t))
                bwd = (bwd[0], t)
        elif kind == BUCKET_DONE and ident in ready:
            s, nbytes = ready.pop(ident)
            # buckets go out in order on one stream: one queued behind the previous starts
            # when that one ends (as Recorder.ddp_comm_hook stamps them)
            s = min(max(s, last_end), t)
            last_end = max(last_end, t)
            comms.append((ar_code, s, t, -1, 0, stage, math.nan, -1, nbytes, ()))
    rows = []
    for mb, s, e in spans:
        attn, tok = seq.get(mb, (math.nan, -1))
        pauses = ()
        inside = [p for p in gc if s <= p[0] and p[1] <= e]
        if inside:
            gc[:] = [p for p in gc if not (s <= p[0] and p[1] <= e)]
            pauses = tuple(pe - ps for ps, pe in inside)
        rows.append((bwd_code, s, e, mb, 0, 0, attn, tok, -1, pauses))
    # compute first: a bucket's all-reduce starts at the instant its span ends and the next
    # begins, and a stable sort by start then keeps the compute that launched it before it
    return rows + comms


def _import(name: str, library: Path):
    import importlib.util

    import torch  # noqa: F401  (the extension links against torch's libraries)

    spec = importlib.util.spec_from_file_location(name, library)
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

    try:  # the ninja wheel's binary, found even when the venv's bin/ is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    where.mkdir(parents=True, exist_ok=True)
    # torch logs its compiler checks as multi-line banners; a failure is reported in one line
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    return load_extension(name, [str(SOURCE)], extra_cflags=["-O2"], build_directory=str(where),
                          verbose=False)


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
