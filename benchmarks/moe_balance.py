"""Expert imbalance on a real MoE job: the diagnosis's predicted gain of balanced routing against
the measured gain, running both.

Pairs of `examples/train_moe.py` runs under torchrun (`--ranks` gloo ranks, one expert each, EP
over all of them), one with a hot expert (`--hot-expert R/2 --routing-skew P`), one with balanced
routing (`--balanced`), same seed, alternated (which of the two runs first alternates too) so
the machine's load falls on both alike. The skewed run is analysed: its `expert_imbalance`
finding predicts the speedup of balanced routing (`speedup_if_fixed`, on the replay's basis
without launch delays, and the measured step with those seconds taken off, as `stragglers
advise` prices it). Measured: the skewed run's step time over the balanced one's (warm-up steps
left out, as the analysis leaves them; mean, and median over steps, which a load spike on the
shared machine moves less), and the same on the replay's basis (each run's replay without
launch delays). The verdict is the median over pairs of the gain error
|predicted gain − measured gain| / measured gain (gain = speedup − 1).

    .venv/bin/python benchmarks/moe_balance.py [--pairs 3] [--steps 16] [--skew 0.6] [--ranks 4]
        [--device-us-per-row 0] [--alternate] [--keep DIR [--reuse]]

The runs import the package from this checkout's src/ (PYTHONPATH), so the command measures
the code beside it on a fresh clone too (after `make venv`). `--keep DIR --reuse` analyses the
runs kept in DIR again instead of running them (a changed analysis on the same runs).

The prediction assumes what the analysis assumes of every job, a device per rank. With more
ranks than cores (4 ranks on this 2-core VM, shared with other work) the ranks share CPUs: the
waiting ranks give theirs to the busy one, and the measured gain of balanced routing is smaller
than on dedicated devices (or a loss) — not a measurement of the prediction. `--device-us-per-row
U` emulates a device per rank instead (the example's expert also waits U µs per row it computes,
2U in backward, without holding a CPU, as a host waits for its accelerator): the expert compute
of the ranks then runs side by side as on dedicated devices, and the gain is measurable on a
loaded machine. The diagnosis is not told U: it fits time per row from the trace as on any job.
`--alternate` runs each pair as ONE run whose even steps are skewed and odd steps balanced
(train_moe.py --alternate): the load falls on neighbouring steps alike. The skewed steps (from
step 2 on) are analysed; measured: mean skewed step over mean balanced step, and the median of
the neighbours' ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from results import Figure, Run, write  # noqa: E402

from stragglers.trace.load import load_trace  # noqa: E402
from stragglers.whatif import analyze  # noqa: E402
from stragglers.whatif.grid import build_grid  # noqa: E402
from stragglers.whatif.metrics import WhatIf  # noqa: E402


def run(out: Path, steps: int, args: list[str], ranks: int = 4, reuse: bool = False) -> None:
    """One run of the MoE example on `ranks` gloo ranks (`reuse`: a run already in `out` is
    kept as it is)."""
    if reuse and (out / "meta.json").exists():
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}",
           str(REPO / "examples" / "train_moe.py"), "--steps", str(steps),
           "--out", str(out), *args]
    # this checkout's package first: an editable install may point at another one
    path = os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": path}
    subprocess.run(cmd, check=True, env=env, cwd=REPO, capture_output=True, timeout=900)


def step_times(trace, warmup: list[int]):
    """(mean measured step time, its median over steps, mean replayed step time without launch
    delays)."""
    grid = build_grid(trace)
    grid = grid.select_steps(~np.isin(grid.steps, warmup))
    w = WhatIf.build(grid)
    return float(w.t_base.mean()), float(np.median(w.t_base)), float(w.t_nodelay.mean())


def gain_error(predicted: float | None, measured: float) -> float | None:
    """|predicted gain − measured gain| / measured gain (None: nothing predicted or no gain)."""
    if not predicted or measured <= 1:
        return None
    return abs((predicted - 1) - (measured - 1)) / (measured - 1)


def alternating(trace, predicted_of) -> dict:
    """One --alternate run: the skewed (even) steps analysed, measured against their balanced
    (odd) neighbours."""
    steps = sorted(int(s) for s in set(trace.ops["step"].tolist()) if s >= 2)
    result = analyze(trace, steps=[s for s in steps if s % 2 == 0])
    grid = build_grid(trace, steps)
    w = WhatIf.build(grid)
    at = {int(s): k for k, s in enumerate(grid.steps)}
    pairs = [(at[s], at[s + 1]) for s in at if s % 2 == 0 and s + 1 in at]
    hot, even = [i for i, _ in pairs], [j for _, j in pairs]
    base, nodelay = w.t_base, w.t_nodelay
    predicted = predicted_of(result)
    finding = next((f for f in result.diagnosis if f.cause == "expert_imbalance"), None)
    hot_nodelay = float(nodelay[hot].mean())
    saved = hot_nodelay - hot_nodelay / predicted if predicted else 0.0
    hot_base = float(base[hot].mean())
    return {"first": result.diagnosis[0].cause, "ranks": result.diagnosis[0].where.ranks,
            "sent": "sent" in trace.ops, "transfer": transfer_priced(finding),
            "predicted": predicted, "predicted_measured": hot_base / (hot_base - saved),
            "measured": hot_base / float(base[even].mean()),
            "measured_median": float(np.median(base[hot] / base[even])),
            "measured_nodelay": hot_nodelay / float(nodelay[even].mean())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--skew", type=float, default=0.6)
    ap.add_argument("--ranks", type=int, default=4,
                    help="EP ranks (one expert each); more ranks than cores share them, and "
                         "the machine then measures total work, not the slowest rank")
    ap.add_argument("--device-us-per-row", type=float, default=0.0,
                    help="emulate a device per rank (train_moe.py --device-us-per-row)")
    ap.add_argument("--d-expert", type=int, default=1024, help="hidden size of an expert's MLP")
    ap.add_argument("--keep", type=Path, help="keep the runs in this folder")
    ap.add_argument("--reuse", action="store_true",
                    help="analyse the runs already in --keep again instead of running them")
    ap.add_argument("--alternate", action="store_true",
                    help="one run per pair, skewed and balanced steps alternating")
    args = ap.parse_args()
    if args.reuse and not args.keep:
        raise SystemExit("--reuse needs --keep DIR (the folder holding the runs)")
    device = ["--d-expert", str(args.d_expert)] + (
        ["--device-us-per-row", str(args.device_us_per_row)] if args.device_us_per_row else [])
    rows = []
    with tempfile.TemporaryDirectory(prefix="moe-balance-") as tmp:
        root = args.keep or Path(tmp)
        for i in range(args.pairs):
            if args.alternate:
                both = Path(root) / f"alt{i}"
                run(both, args.steps, ["--hot-expert", str(args.ranks // 2), "--routing-skew",
                                       str(args.skew), "--alternate", "--seed", str(i), *device],
                    args.ranks, args.reuse)
                rows.append(alternating(load_trace(both), lambda res: next(
                    (f.speedup_if_fixed for f in res.diagnosis if f.cause == "expert_imbalance"),
                    None)))
                show(i, rows[-1])
                continue
            hot, even = Path(root) / f"hot{i}", Path(root) / f"even{i}"
            hot_rank = args.ranks // 2
            runs = [(hot, ["--hot-expert", str(hot_rank), "--routing-skew", str(args.skew)]),
                    (even, ["--balanced"])]
            for out, flags in (runs if i % 2 == 0 else runs[::-1]):
                run(out, args.steps, [*flags, "--seed", str(i), *device], args.ranks, args.reuse)
            t_hot, t_even = load_trace(hot), load_trace(even)
            result = analyze(t_hot)
            warmup = [int(s) for s in result.warmup_steps]
            finding = next((f for f in result.diagnosis if f.cause == "expert_imbalance"), None)
            hot_base, hot_median, hot_nodelay = step_times(t_hot, warmup)
            even_base, even_median, even_nodelay = step_times(t_even, warmup)
            predicted = finding.speedup_if_fixed if finding else None
            # advise's footing: the seconds the replay saves, off the measured step
            saved = hot_nodelay - hot_nodelay / predicted if predicted else 0.0
            rows.append({"first": result.diagnosis[0].cause,
                         "ranks": result.diagnosis[0].where.ranks, "sent": "sent" in t_hot.ops,
                         "transfer": transfer_priced(finding),
                         "predicted": predicted, "predicted_measured": hot_base / (hot_base - saved),
                         "measured": hot_base / even_base, "measured_median": hot_median / even_median,
                         "measured_nodelay": hot_nodelay / even_nodelay})
            show(i, rows[-1])
    figures = []
    for key, against in (("predicted", "measured_nodelay"), ("predicted_measured", "measured"),
                         ("predicted_measured", "measured_median")):
        errors = [e for e in (gain_error(r[key], r[against]) for r in rows) if e is not None]
        median = statistics.median(errors) if errors else None
        print(f"{key} vs {against}: gain error per pair "
              + ", ".join(f"{100 * e:.0f}%" for e in errors)
              + (f"; median {100 * median:.0f}% (goal ≤ 15%)" if errors else " (none measurable)"))
        figures.append(Figure(
            name=f"gain error, {key} vs {against} (median over {len(errors)} of {len(rows)} pairs)",
            value=f"{100 * median:.0f}%" if median is not None else "not measurable",
            goal="<= 15%", met=None if median is None else median <= 0.15,
            note="" if median is not None else "no pair had a measurable gain of balanced routing"))
    firsts = sum(r["first"] == "expert_imbalance" for r in rows)
    figures.append(Figure(name="expert_imbalance the first finding", value=f"{firsts} of {len(rows)} pairs",
                          goal="every pair", met=firsts == len(rows)))
    command = ".venv/bin/python benchmarks/moe_balance.py " + " ".join(
        f"--{k.replace('_', '-')}" + ("" if v is True else f" {v:g}" if isinstance(v, float)
                                      else f" {v}")
        for k, v in vars(args).items() if k not in ("keep", "reuse") and v is not False)
    table = [{"pair": str(i), "first": r["first"], "ranks": str(list(r["ranks"])),
              "rows sent in trace": "yes" if r["sent"] else "no",
              "all-to-all transfer": r["transfer"],
              **{k: f"{r[k]:.3f}" if r[k] else "-" for k in ("predicted", "predicted_measured",
                                                              "measured", "measured_median",
                                                              "measured_nodelay")}}
             for i, r in enumerate(rows)]
    mode = "alternating steps, " if args.alternate else ""
    write(Run(benchmark=f"MoE balanced routing, predicted vs measured ({mode}EP {args.ranks}"
                        + (f", emulated device {args.device_us_per_row:g} µs/row)"
                           if args.device_us_per_row else ", CPU)"),
              issue="30", command=command, figures=figures, table=table,
              note="the runs kept by an earlier run of this command (--keep), analysed again "
                   "(--reuse)" if args.reuse else ""),
          name="moe_balance" + (f"_device_{args.device_us_per_row:g}us" if args.device_us_per_row
                                else "") + ("_alternate" if args.alternate else ""))


def transfer_priced(finding) -> str:
    """How the finding priced the all-to-alls' transfer: at balanced volume, or as measured."""
    if finding is None:
        return "-"
    return "as measured" if "transfer kept as measured" in finding.evidence else "balanced"


def show(i: int, r: dict) -> None:
    """One pair's line."""
    shown = f"×{r['predicted']:.3f}" if r["predicted"] else "none (no expert_imbalance finding)"
    print(f"pair {i}: first finding {r['first']} {r['ranks']}; predicted {shown} "
          f"(replay basis), ×{r['predicted_measured']:.3f} (off the measured step); "
          f"measured ×{r['measured']:.3f} (mean step), ×{r['measured_median']:.3f} "
          f"(median step), ×{r['measured_nodelay']:.3f} (replay basis); transfer "
          f"{r['transfer']}", flush=True)


if __name__ == "__main__":
    main()
