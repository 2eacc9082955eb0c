"""Each mitigation on examples/train_gpt.py: predicted speedup (diagnosis) vs measured speedup.

    .venv/bin/python benchmarks/record_fixes.py [--only gc,sequence,stage] [--steps 16] [--reps 1]

For each fix: run the job with the injection (before), analyse it and read the diagnosis's
`speedup_if_fixed` for the cause; run it again with the fix on (after); both runs record, so both
pay the same recorder cost. Before/after runs alternate order over repetitions. Also printed:
the what-if gain of fixing the cause's ops (the mask the diagnosis uses) even when the cause is
not diagnosed, labelled as such — it is not the diagnosis's prediction. Measured speedup =
mean step time before / after (rank 0's wall clock per step, first 2 steps skipped), also from the
traces (T_base before / after). Goal: measured within 25% of predicted.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

# name: (processes, injection args, fix args, diagnosed cause)
FIXES = {
    "gc": (4, ["--pp", "1", "--gc-garbage", "40"], ["--planned-gc", "5"], "gc"),
    "sequence": (2, ["--pp", "1", "--seq-len-dist", "lognormal", "--max-seq-len", "1024",
                     "--microbatches", "2"],
                 ["--balance-sequences"], "sequence_imbalance"),
    # dp 1 x pp 2: one core per rank on the 2-core machine (4 ranks share cores, see BENCHMARKS.md)
    "stage": (2, ["--pp", "2", "--extra-last-stage-layers", "4"], ["--balance-stages"],
              "stage_imbalance"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(nproc: int, args: list[str], out: Path, steps: int) -> dict:
    """One torchrun job; returns its summary (step times)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           str(REPO / "examples" / "train_gpt.py"), *args, "--steps", str(steps),
           "--trace-dir", str(out / "trace"), "--summary", str(out / "summary.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"training failed:\n{proc.stderr[-3000:]}")
    for line in proc.stdout.splitlines():
        if line.startswith("balance-stages"):
            print(f"  {line}", flush=True)
    return json.loads((out / "summary.json").read_text())


def analyse(trace_dir: Path, cause: str):
    """The analysis, and the what-if gain of fixing the cause's ops whether or not it is diagnosed."""
    import numpy as np

    from stragglers.trace.runformat import read_run
    from stragglers.whatif import analyze_with_model
    from stragglers.whatif.grid import BWD, FWD, GC

    result, w = analyze_with_model(read_run(trace_dir))
    g = w.grid
    mask = np.zeros(w.cost.shape[:2], bool)
    if cause == "sequence_imbalance":        # the mask the diagnosis uses for this cause
        mask[np.isin(g.node_optype, (FWD, BWD))] = True
    elif cause == "gc":
        mask[g.node_optype == GC] = True
    else:                                    # stage_imbalance: the last (heavy) stage
        mask[g.node_stage == g.pp_size - 1] = True
    whatif = float(w.t_nodelay.mean()) / w.fix_fraction(mask)[1] if mask.any() else 1.0
    return result, whatif


def main() -> None:
    from stragglers.whatif.result import plain

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(FIXES))
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            nproc, inject, fix, cause = FIXES[name]
            rows = []
            for rep in range(args.reps):
                order = ("before", "after") if rep % 2 == 0 else ("after", "before")
                runs = {}
                for which in order:
                    out = Path(tmp) / f"{name}-{which}-{rep}"
                    summary = train(nproc, inject + (fix if which == "after" else []), out, args.steps)
                    runs[which] = (summary, *analyse(out / "trace", cause))
                (sb, rb, whatif), (sa, ra, _) = runs["before"], runs["after"]
                entry = next((d for d in rb.diagnosis if d.cause == cause), None)
                predicted = entry.speedup_if_fixed if entry else None
                measured = sb["mean_step_s"] / sa["mean_step_s"]
                measured_trace = rb.t_base / ra.t_base
                rows.append({"predicted": predicted, "whatif": whatif, "measured": measured,
                             "where": plain(entry.where) if entry else None,
                             "evidence": entry.evidence if entry else None,
                             "measured_trace": measured_trace,
                             "before_ms": sb["mean_step_s"] * 1e3, "after_ms": sa["mean_step_s"] * 1e3,
                             "S_before": rb.slowdown, "S_after": ra.slowdown,
                             "diagnosed_before": [d.cause for d in rb.diagnosis],
                             "diagnosed_after": [d.cause for d in ra.diagnosis]})
                r = rows[-1]
                pred = f"{predicted:.3f} at {plain(entry.where)}" if predicted else "not diagnosed"
                print(f"{name} rep {rep}: step {r['before_ms']:.0f} → {r['after_ms']:.0f} ms; "
                      f"measured ×{measured:.3f} (traces ×{measured_trace:.3f}), predicted ×{pred} "
                      f"(what-if of fixing those ops regardless ×{whatif:.3f}); "
                      f"S {r['S_before']:.3f} → {r['S_after']:.3f}; diagnosis {r['diagnosed_before']} → "
                      f"{r['diagnosed_after']}", flush=True)
            preds = [r["predicted"] for r in rows if r["predicted"]]
            meas = statistics.median(r["measured"] for r in rows)
            if preds:
                # compare on the pairs whose before run was diagnosed, not on every pair
                meas = statistics.median(r["measured"] for r in rows if r["predicted"])
                print(f"{name}: diagnosed in {len(preds)} of {len(rows)} before runs", flush=True)
                pred = statistics.median(preds)
                rel = abs(meas - pred) / pred
                gain = (meas - 1) / (pred - 1) if pred > 1 else float("nan")
                print(f"{name}: predicted ×{pred:.3f}, measured ×{meas:.3f}: |Δ|/pred = {100 * rel:.1f}% "
                      f"({'within' if rel <= 0.25 else 'NOT within'} 25%); measured gain / predicted "
                      f"gain = {gain:.2f}", flush=True)
            else:
                wi = statistics.median(r["whatif"] for r in rows)
                print(f"{name}: never diagnosed; measured ×{meas:.3f} vs what-if of fixing the "
                      f"cause's ops ×{wi:.3f} ({100 * abs(meas - wi) / wi:.1f}% apart)", flush=True)
            report[name] = rows
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    write_results(report, args)


def write_results(report: dict[str, list[dict]], args: argparse.Namespace) -> None:
    """Per fix: the pairs whose measured gain is within 25% of the prediction; every pair below."""
    from results import Figure, Run, write

    figures, table = [], []
    for name, rows in report.items():
        scored = [r for r in rows if r["predicted"]]
        within = sum(abs(r["measured"] - r["predicted"]) / r["predicted"] <= 0.25 for r in scored)
        figures.append(Figure(
            name=f"{name}: pairs whose measured gain is within 25% of the predicted",
            value=f"{within} of {len(scored)} (diagnosed in {len(scored)} of {len(rows)} before runs)",
            goal="within 25%", met=bool(scored) and within == len(scored)))
        table += [{"fix": name, "step before → after": f"{r['before_ms']:.0f} → {r['after_ms']:.0f} ms",
                   "measured (traces)": f"×{r['measured']:.3f} (×{r['measured_trace']:.3f})",
                   "predicted": f"×{r['predicted']:.3f}" if r["predicted"] else "not diagnosed",
                   "S before → after": f"{r['S_before']:.3f} → {r['S_after']:.3f}"} for r in rows]
    write(Run(benchmark="Mitigations: predicted vs measured gain of each fix", issue="3",
              command=f".venv/bin/python benchmarks/record_fixes.py --only {args.only} --steps "
                      f"{args.steps} --reps {args.reps}", figures=figures, table=table))


if __name__ == "__main__":
    main()
