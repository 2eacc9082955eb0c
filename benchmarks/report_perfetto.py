"""Perfetto export speed: write_perfetto vs the naive dict-per-op + json.dump, same run.

Goal: a 1M-op trace in a few seconds (target < 5 s), and well ahead of the naive export.
Run: .venv/bin/python benchmarks/report_perfetto.py [--ops 1000000]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from results import Figure, Run, write

from stragglers.report import write_perfetto
from stragglers.trace.model import COLUMNS, OPTYPES, STREAM_OF_OPTYPE, STREAMS, JobMeta, Trace


def synthetic_trace(n_ops: int, dp: int = 16, pp: int = 8) -> Trace:
    """Per worker: back-to-back compute with p2p and DP collectives on their own streams."""
    rng = np.random.default_rng(0)
    workers = dp * pp
    per = n_ops // workers
    kinds = np.array([OPTYPES.index(k) for k in ("forward-compute", "forward-send",
                                                 "backward-compute", "backward-recv",
                                                 "grads-reduce-scatter", "optimizer")])
    optype = np.tile(kinds[np.arange(per) % len(kinds)], workers)
    dur = rng.uniform(0.001, 0.02, per * workers)
    start = np.empty_like(dur)
    for w in range(workers):  # sequential per stream so the tracks nest properly
        sl = slice(w * per, (w + 1) * per)
        start[sl] = 1.7e9 + np.cumsum(dur[sl]) - dur[sl]
    worker = np.repeat(np.arange(workers), per)
    ops = {
        "rank": worker, "dp_rank": worker // pp, "stage": worker % pp,
        "step": np.tile(np.arange(per) // 48, workers), "optype": optype,
        "start_ts": start, "duration": dur, "seq_id": np.tile(np.arange(per), workers),
        "mb_id": np.tile(np.arange(per) % 8, workers), "mc": 0 * worker, "gmc": worker % pp,
    }
    ops = {k: np.asarray(v, dtype=COLUMNS[k]) for k, v in ops.items()}
    return Trace(ops, JobMeta(name="bench", dp_size=dp, pp_size=pp))


def naive_export(path: Path, trace: Trace, start: np.ndarray, end: np.ndarray) -> None:
    """The obvious implementation: one dict per op through json.dump."""
    o = trace.ops
    events = [{"name": OPTYPES[t], "cat": STREAMS[STREAM_OF_OPTYPE[t]], "ph": "X",
               "pid": int(d) * 8 + int(p) + 1, "tid": int(STREAM_OF_OPTYPE[t]) + 1,
               "ts": round(s * 1e6, 3), "dur": round((e - s) * 1e6, 3),
               "args": {"step": int(st), "mb_id": int(mb)}}
              for t, d, p, s, e, st, mb in zip(o["optype"].tolist(), o["dp_rank"].tolist(),
                                               o["stage"].tolist(), start.tolist(), end.tolist(),
                                               o["step"].tolist(), o["mb_id"].tolist())]
    with open(path, "w") as f:
        json.dump({"traceEvents": events}, f)


def main() -> None:
    """Time both exports on the same trace and print the ratio."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", type=int, default=1_000_000)
    args = parser.parse_args()
    trace = synthetic_trace(args.ops)
    start, end = trace.ops["start_ts"], trace.end_ts
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t, c = time.perf_counter(), time.process_time()
        (ours,) = write_perfetto(tmp, trace, {"measured": (start, end)})
        t_ours, c_ours = time.perf_counter() - t, time.process_time() - c
        t, c = time.perf_counter(), time.process_time()
        naive_export(tmp / "naive.json", trace, start, end)
        t_naive, c_naive = time.perf_counter() - t, time.process_time() - c
        t = time.perf_counter()
        events = json.loads(ours.read_text())["traceEvents"]
        t_parse = time.perf_counter() - t
        n_x = sum(e["ph"] == "X" for e in events)
        assert n_x == len(trace), (n_x, len(trace))
        size = ours.stat().st_size / 1e6
    print(f"ops {len(trace):,}  file {size:.0f} MB  (parses back: {n_x:,} X events, "
          f"json.loads {t_parse:.2f} s)")
    print(f"write_perfetto {t_ours:.2f} s wall / {c_ours:.2f} s CPU   naive dict+json.dump "
          f"{t_naive:.2f} s wall / {c_naive:.2f} s CPU   speed-up ×{t_naive / t_ours:.1f} wall, "
          f"×{c_naive / c_ours:.1f} CPU")
    print(f"goal < 5 s for 1M ops: {'met' if t_ours < 5 else 'MISSED'} (wall), "
          f"{'met' if c_ours < 5 else 'MISSED'} (CPU)")
    command = ".venv/bin/python benchmarks/report_perfetto.py"
    write(Run(benchmark="Perfetto timeline export", issue="2",
              command=command + (f" --ops {args.ops}" if args.ops != 1_000_000 else ""),
              figures=[Figure(name=f"{len(trace):,} ops to Perfetto JSON, wall / CPU",
                              value=f"{t_ours:.2f} s / {c_ours:.2f} s ({size:.0f} MB file)",
                              goal="1M ops in a few seconds (< 5 s)", met=c_ours < 5,
                              note="judged on CPU time: wall time follows the machine's load"),
                       Figure(name="CPU vs the naive export (one dict per op through `json.dump`)",
                              value=f"{c_naive / c_ours:.1f}× less",
                              anchor=f"naive export, same run: {t_naive:.1f} s wall / "
                                     f"{c_naive:.1f} s CPU")]))


if __name__ == "__main__":
    main()
