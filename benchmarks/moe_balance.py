"""Expert imbalance on a real MoE job: the diagnosis's predicted gain of balanced routing against
the measured gain, running both.

Pairs of `examples/train_moe.py` runs under torchrun (`--ranks` gloo ranks, one expert each, EP
over all of them), one with a hot expert (`--hot-expert R/2 --routing-skew P`), one with balanced
routing (`--balanced`), same seed, alternated (which of the two runs first alternates too). The
first WARMUP steps of every run are left out of everything (analysis and measurement). The
skewed run is analysed: its `expert_imbalance` finding predicts the speedup of balanced routing
(`speedup_if_fixed`, on the replay's basis without launch delays, and the measured step with
those seconds taken off, as `stragglers advise` prices it). Measured: the skewed run's step
time over the balanced one's (mean, and median over steps, which a load spike on the shared
machine moves less), and the same on the replay's basis (each run's replay without launch
delays). The verdict is the median over pairs of the gain error
|predicted gain − measured gain| / measured gain (gain = speedup − 1).

    .venv/bin/python benchmarks/moe_balance.py [--pairs 3] [--steps 16] [--skew 0.6] [--ranks 4]
        [--device-us-per-row 0] [--alternate] [--keep DIR [--reuse]]

The runs import the package from this checkout's src/ (PYTHONPATH), so the command measures
the code beside it on a fresh clone too (after `make venv`). `--keep DIR --reuse` analyses the
runs kept in DIR again instead of running them (a changed analysis on the same runs); the load
and date each run was recorded at come back from DIR.

The prediction assumes what the analysis assumes of every job, a device per rank. With more
ranks than cores (4 ranks on this 2-core VM, shared with other work) the ranks share CPUs: the
waiting ranks give theirs to the busy one, and the measured gain of balanced routing is smaller
than on dedicated devices (or a loss) — not a measurement of the prediction. `--device-us-per-row
U` emulates a device per rank instead (the example's expert also waits U µs per row it computes,
2U in backward, without holding a CPU, as a host waits for its accelerator): the expert compute
of the ranks then runs side by side as on dedicated devices, and the gain is measurable on a
loaded machine. The diagnosis is not told U: it fits time per row from the trace as on any job.

Two runs minutes apart meet different loads on a shared machine, and the load moves the balanced
step (where the work routing does not touch is a larger share) more than the skewed one.
`--alternate` removes that by method: each pair is ONE run whose even steps are skewed and odd
steps balanced (train_moe.py --alternate), so the load falls on neighbouring steps alike. The
skewed steps are analysed; measured: mean skewed step over mean balanced step, the median of
the neighbours' ratios, and the replay basis. Both modes record the load during every run
(1-minute load average, sampled each second: min/median/max) and, from the traces, how fast the
work routing does not change ran in the balanced steps against the skewed ones (the compute
outside the experts, its per-step median: 1.00 when both met the same machine). Each pair's
gap between the predicted and the measured balanced step is then accounted op class by op
class: the typical (per-op median) predicted step replayed with the balanced run's typical
costs put in one class at a time (expert compute, all-to-alls' transfer, other compute, other
collectives).

Where the ranks outnumber the host's CPUs (the layout's `cpus`), the analysis gives the balanced
expert pieces the run delay that the ranks computing beside them imply, fitted over the run's
compute pieces (whatif/causes/host_cores.py); each pair says whether that fit applied (on a
heavily loaded machine the run delay does not grow with the ranks computing at once: not
applied).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from results import Figure, Run, write  # noqa: E402

from stragglers.trace.load import load_trace  # noqa: E402
from stragglers.trace.model import OPTYPE_CODES  # noqa: E402
from stragglers.whatif import analyze  # noqa: E402
from stragglers.whatif._replay import replay  # noqa: E402
from stragglers.whatif.causes.base import Context  # noqa: E402
from stragglers.whatif.causes.experts import _fit, _run_delay, expert_imbalance, relative  # noqa: E402
from stragglers.whatif.config import DEFAULT  # noqa: E402
from stragglers.whatif.grid import build_grid  # noqa: E402
from stragglers.whatif.metrics import WhatIf  # noqa: E402

# The first steps of a run (the allocator, gloo's first connections, FSDP2's first gathers) run
# slower than the rest whatever the routing: left out of both runs in both modes.
WARMUP = 2
RUN_FILE = "moe_balance_run.json"  # beside a kept run: when, at which commit and load it ran
CLASSES = ("expert compute", "all-to-all", "other compute", "other collectives")
COMPUTE = [OPTYPE_CODES[n] for n in ("forward-compute", "backward-compute",
                                     "backward-weight-compute", "optimizer")]


class LoadSampler:
    """The 1-minute load average, sampled every second on a thread while a run goes on."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "LoadSampler":
        self.samples.append(os.getloadavg()[0])
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            self.samples.append(os.getloadavg()[0])


def run(out: Path, steps: int, args: list[str], ranks: int = 4, reuse: bool = False) -> dict:
    """One run of the MoE example on `ranks` gloo ranks; returns when it ran and the load it met
    (`reuse`: a run already in `out` is kept as it is, and what was written of it comes back)."""
    if reuse and (out / "meta.json").exists():
        kept = out / RUN_FILE
        return json.loads(kept.read_text()) if kept.exists() else {}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}",
           str(REPO / "examples" / "train_moe.py"), "--steps", str(steps),
           "--out", str(out), *args]
    # this checkout's package first: an editable install may point at another one
    path = os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": path}
    began = time.time()
    with LoadSampler() as load:
        subprocess.run(cmd, check=True, env=env, cwd=REPO, capture_output=True, timeout=900)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=REPO, check=False).stdout.strip()
    facts = {"recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(began)),
             "seconds": round(time.time() - began, 1), "commit": head,
             "load": [min(load.samples), statistics.median(load.samples), max(load.samples)]}
    (out / RUN_FILE).write_text(json.dumps(facts))
    return facts


def gain_error(predicted: float | None, measured: float) -> float | None:
    """|predicted gain − measured gain| / measured gain (None: nothing predicted or no gain)."""
    if not predicted or measured <= 1:
        return None
    return abs((predicted - 1) - (measured - 1)) / (measured - 1)


def later_steps(trace) -> list[int]:
    """The trace's steps from WARMUP on."""
    return sorted(int(s) for s in set(trace.ops["step"].tolist()) if s >= WARMUP)


def compare(t_hot, hot_steps: list[int], t_even, even_steps: list[int],
            neighbours: bool) -> dict:
    """The skewed steps analysed against the balanced ones: prediction, measurement, the
    untouched work's speed ratio and the gap accounted by op class (`neighbours`: steps s and
    s + 1 of one run, the measured median is the median of their ratios)."""
    result = analyze(t_hot, steps=hot_steps)
    finding = next((f for f in result.diagnosis if f.cause == "expert_imbalance"), None)
    predicted = finding.speedup_if_fixed if finding else None
    w_hot = WhatIf.build(build_grid(t_hot, hot_steps))
    w_even = WhatIf.build(build_grid(t_even, even_steps))
    base_h, base_e = w_hot.t_base, w_even.t_base
    nodelay_h = float(w_hot.t_nodelay.mean())
    # advise's footing: the seconds the replay saves, off the measured step
    saved = nodelay_h - nodelay_h / predicted if predicted else 0.0
    if neighbours:  # step s skewed beside step s + 1 balanced
        at = {int(s): k for k, s in enumerate(w_even.grid.steps)}
        ratios = [base_h[k] / base_e[at[int(s) + 1]] for k, s in enumerate(w_hot.grid.steps)
                  if int(s) + 1 in at]
        median = float(np.median(ratios))
    else:
        median = float(np.median(base_h) / np.median(base_e))
    ctx = Context.build(w_hot, t_hot, DEFAULT)
    row = {"first": result.diagnosis[0].cause, "ranks": result.diagnosis[0].where.ranks,
           "sent": "sent" in t_hot.ops, "transfer": transfer_priced(finding),
           "transfer_corr": ctx.expert_load.transfer_corr if ctx.expert_load else None,
           "contention": contention(ctx),
           "predicted": predicted,
           "predicted_measured": float(base_h.mean()) / (float(base_h.mean()) - saved),
           "measured": float(base_h.mean() / base_e.mean()), "measured_median": median,
           "measured_nodelay": nodelay_h / float(w_even.t_nodelay.mean())}
    row.update(account(ctx, w_even))
    row.update(host_waits(ctx, w_even, t_even))
    row.update(transfer_waits(ctx, w_even, t_even))
    return row


def contention(ctx: Context) -> list[float] | None:
    """The run delay's fit on a host whose ranks outnumber its CPUs, [base, per other rank
    computing] (s per s of CPU time), where the prediction applied one (host_cores.py)."""
    load = ctx.expert_load
    fit = load.host.contention if load is not None and load.host is not None else None
    return None if fit is None else [fit.base, fit.per_rank]


def account(ctx: Context, w_even: WhatIf) -> dict:
    """The untouched compute's speed ratio (balanced / skewed) and the gap between the
    predicted and the measured typical balanced step by op class, in seconds."""
    w_hot = ctx.w
    g = w_hot.grid
    candidates = expert_imbalance(ctx)
    if not candidates or not np.array_equal(g.node_optype, w_even.grid.node_optype) \
            or w_hot.cost.shape[1] != w_even.cost.shape[1]:
        return {}
    expert = np.zeros(len(g.node_optype), dtype=bool)
    expert[[e for _, e in ctx.expert_load.pairs]] = True
    a2a = g.node_optype == OPTYPE_CODES["all-to-all"]
    compute = np.isin(g.node_optype, COMPUTE) & ~expert
    masks = dict(zip(CLASSES, (expert, a2a, compute, ~(expert | a2a | compute))))

    def typical(cost: np.ndarray) -> np.ndarray:
        """Every op at its median over steps, in every step."""
        return np.broadcast_to(np.median(cost, axis=2, keepdims=True), w_hot.cost.shape).copy()

    def step(cost: np.ndarray) -> float:
        return float(replay(w_hot.plan, cost, w_hot.step_start).mean())

    cost, even = typical(candidates[0].cost), typical(w_even.cost)
    out = {"typical_predicted": step(cost), "typical_balanced": step(even)}
    previous = out["typical_predicted"]
    for name, mask in masks.items():
        cost[mask] = even[mask]
        now = step(cost)
        out[f"gap {name}"] = now - previous
        previous = now
    hot_work = np.median(w_hot.cost[compute], axis=2).sum(axis=0).mean()
    out["untouched"] = float(np.median(w_even.cost[compute], axis=2).sum(axis=0).mean()
                             / hot_work)
    return out


def host_waits(ctx: Context, w_even: WhatIf, t_even) -> dict:
    """Where the expert pieces recorded their run delay (our recorder on CPU): their own time
    (the rest: CPU time, and an emulated device's; summed over a step's expert pieces, mean
    over ranks) that the rows fit gives at balanced rows against the balanced steps' measured
    one, and the run delay per second of own time of the hot rank's and the other ranks'
    pieces in the skewed steps and of every rank's in the balanced steps."""
    load = ctx.expert_load
    if load is None or load.host is None \
            or not np.array_equal(ctx.w.grid.node_optype, w_even.grid.node_optype):
        return {}
    g, ge = ctx.w.grid, w_even.grid
    experts = [e for _, e in load.pairs]
    waits = [_run_delay(ge, t_even.ops, e, ge.duration) for e in experts]
    if any(w is None for w in waits):
        return {}
    own = g.duration[experts] - load.host.wait                              # [K, D, T]
    predicted = 0.0
    for k in range(len(experts)):
        fit = _fit(load.rows[k], own[k])
        slope = fit[0] if fit is not None else 0.0
        predicted += float((own[k] - slope * (load.rows[k] - load.mean[k])).mean())
    wait_even = np.array(waits)
    own_even = ge.duration[experts] - wait_even
    hot = np.zeros(own.shape[1], dtype=bool)
    hot[int(np.argmax(relative(load.rows, load.mean).mean(axis=(0, 2))))] = True

    def rate(wait: np.ndarray, cpu: np.ndarray) -> float:
        return float(wait.sum() / cpu.sum()) if cpu.sum() > 0 else float("nan")

    out = {"expert_cpu_predicted": predicted,
           "expert_cpu_balanced": float(own_even.mean(axis=(1, 2)).sum()),
           "wait_rate_hot": rate(load.host.wait[:, hot], own[:, hot]),
           "wait_rate_cold": rate(load.host.wait[:, ~hot], own[:, ~hot]),
           "wait_rate_balanced": rate(wait_even, own_even)}
    return out


def transfer_waits(ctx: Context, w_even: WhatIf, t_even) -> dict:
    """Where the all-to-all rows recorded their threads' run delay (`cpu_wait`, our recorder
    on CPU): that run delay, at most each row's transfer (end − the group's last arrival), per
    step (summed over the dispatches, and over the other all-to-alls; mean over ranks and
    steps), in the skewed and the balanced steps (the k-th all-to-all of one against the k-th
    of the other). The prediction keeps the skewed steps'."""
    load = ctx.expert_load
    g, ge = ctx.w.grid, w_even.grid
    a2a = np.flatnonzero(g.node_optype == OPTYPE_CODES["all-to-all"])
    a2a_even = np.flatnonzero(ge.node_optype == OPTYPE_CODES["all-to-all"])
    if load is None or "cpu_wait" not in ctx.trace.ops or "cpu_wait" not in t_even.ops \
            or len(a2a) != len(a2a_even) or g.row.shape[1] != ge.row.shape[1]:
        return {}
    dispatch = np.isin(a2a, [n for n, _ in load.pairs])

    def per_step(grid, nodes, table, cost) -> list[float] | None:
        rows = grid.row[nodes]
        if (rows < 0).any():
            return None
        wait = np.minimum(table["cpu_wait"][rows].astype(np.float64), cost[nodes])
        if not np.isfinite(wait).all():
            return None
        wait = wait.mean(axis=(1, 2))                                       # [M]
        return [float(wait[dispatch].sum()), float(wait[~dispatch].sum())]

    skewed = per_step(g, a2a, ctx.trace.ops, ctx.w.cost)
    balanced = per_step(ge, a2a_even, t_even.ops, w_even.cost)
    if skewed is None or balanced is None:
        return {}
    return {"a2a_wait_dispatch": [skewed[0], balanced[0]],
            "a2a_wait_other": [skewed[1], balanced[1]]}


def pair(i: int, root: Path, args, device: list[str]) -> dict:
    """One pair: its runs (or the kept ones), compared."""
    skew = ["--hot-expert", str(args.ranks // 2), "--routing-skew", str(args.skew)]
    if args.alternate:
        both = root / f"alt{i}"
        facts = run(both, args.steps, [*skew, "--alternate", "--seed", str(i), *device],
                    args.ranks, args.reuse)
        trace = load_trace(both)
        steps = later_steps(trace)
        row = compare(trace, [s for s in steps if s % 2 == 0], trace,
                      [s for s in steps if s % 2 == 1], neighbours=True)
        row["runs"] = {"skewed and balanced": facts}
        return row
    hot, even = root / f"hot{i}", root / f"even{i}"
    runs = [(hot, skew, "skewed"), (even, ["--balanced"], "balanced")]
    facts = {}
    for out, flags, name in (runs if i % 2 == 0 else runs[::-1]):
        facts[name] = run(out, args.steps, [*flags, "--seed", str(i), *device], args.ranks,
                          args.reuse)
    t_hot, t_even = load_trace(hot), load_trace(even)
    row = compare(t_hot, later_steps(t_hot), t_even, later_steps(t_even), neighbours=False)
    row["runs"] = {name: facts[name] for name in ("skewed", "balanced")}
    return row


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
    ap.add_argument("--name", default=None, help="write the result as this name (a path: "
                    "there, e.g. /tmp/x) instead of results/moe_balance*.json")
    args = ap.parse_args()
    if args.reuse and not args.keep:
        raise SystemExit("--reuse needs --keep DIR (the folder holding the runs)")
    if args.steps < WARMUP + 2:
        raise SystemExit(f"--steps {args.steps}: expected at least {WARMUP + 2} (the first "
                         f"{WARMUP} are left out as warm-up)")
    device = ["--d-expert", str(args.d_expert)] + (
        ["--device-us-per-row", str(args.device_us_per_row)] if args.device_us_per_row else [])
    rows = []
    with tempfile.TemporaryDirectory(prefix="moe-balance-") as tmp:
        root = Path(args.keep or tmp)
        for i in range(args.pairs):
            rows.append(pair(i, root, args, device))
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
    untouched = [r["untouched"] for r in rows if "untouched" in r]
    if untouched:
        figures.append(Figure(
            name="untouched compute, balanced over skewed steps (median over pairs)",
            value=f"{statistics.median(untouched):.2f}", anchor="1.00: both met the same machine",
            note="the compute outside the experts, which routing does not change: away from "
                 "1.00, the two kinds of steps met different loads"))
    command = ".venv/bin/python benchmarks/moe_balance.py " + " ".join(
        f"--{k.replace('_', '-')}" + ("" if v is True else f" {v:g}" if isinstance(v, float)
                                      else f" {v}")
        for k, v in vars(args).items() if k not in ("keep", "reuse", "name") and v is not False)
    mode = "alternating steps, " if args.alternate else ""
    write(Run(benchmark=f"MoE balanced routing, predicted vs measured ({mode}EP {args.ranks}"
                        + (f", emulated device {args.device_us_per_row:g} µs/row)"
                           if args.device_us_per_row else ", CPU)"),
              issue="30", command=command, figures=figures, table=[cells(i, r) for i, r in
                                                                    enumerate(rows)],
              note=run_note(rows, args.reuse), text=texts(rows, args.alternate)),
          name=args.name or "moe_balance" + (f"_device_{args.device_us_per_row:g}us" if args.device_us_per_row
                                else "") + ("_alternate" if args.alternate else ""))


def cells(i: int, r: dict) -> dict[str, str]:
    """One pair's row of the results table."""
    out = {"pair": str(i), "first": r["first"], "ranks": str(list(r["ranks"])),
           "rows sent in trace": "yes" if r["sent"] else "no", "all-to-all transfer": r["transfer"],
           "run delay fit, crowded host": ("not applied" if not r.get("contention") else
                                           "{:.2f} + {:.2f}/rank".format(*r["contention"]))}
    for name, facts in r["runs"].items():
        load = facts.get("load")
        out[f"load, {name} run"] = ("/".join(f"{x:.1f}" for x in load) if load
                                    else "not recorded")
    for k in ("predicted", "predicted_measured", "measured", "measured_median",
              "measured_nodelay"):
        out[k] = f"{r[k]:.3f}" if r[k] else "-"
    out["untouched compute, balanced/skewed"] = f"{r['untouched']:.2f}" if "untouched" in r else "-"
    if "typical_predicted" in r:
        out["typical step, predicted/balanced (ms)"] = (
            f"{1e3 * r['typical_predicted']:.1f}/{1e3 * r['typical_balanced']:.1f}")
        out["gap by class (ms)"] = ", ".join(f"{name} {1e3 * r[f'gap {name}']:+.1f}"
                                            for name in CLASSES)
    if "expert_cpu_predicted" in r:
        out["expert own time per step, predicted/balanced (ms)"] = (
            f"{1e3 * r['expert_cpu_predicted']:.1f}/{1e3 * r['expert_cpu_balanced']:.1f}")
        out["run delay per s of own time, hot/other ranks skewed, all balanced"] = (
            f"{r['wait_rate_hot']:.2f}/{r['wait_rate_cold']:.2f}/{r['wait_rate_balanced']:.2f}")
    if "a2a_wait_dispatch" in r:
        out["all-to-all threads' run delay per step, dispatches / others, skewed→balanced (ms)"] = (
            "{:.1f}→{:.1f} / {:.1f}→{:.1f}".format(*(1e3 * x for x in r["a2a_wait_dispatch"]
                                                     + r["a2a_wait_other"])))
    return out


def run_note(rows: list[dict], reuse: bool) -> str:
    """The run's one line: where the runs come from (recorded now, or kept and analysed again)."""
    facts = [f for r in rows for f in r["runs"].values() if f]
    if not reuse:
        return "the load columns: 1-minute load average during each run, min/median/max"
    if not facts:
        return ("the runs kept by an earlier run of this command (--keep), analysed again "
                "(--reuse); when and at what load they ran was not kept")
    dates = sorted(f["recorded"] for f in facts)
    commits = sorted({f["commit"] for f in facts})
    return (f"the runs kept by an earlier run of this command (--keep), recorded {dates[0]} to "
            f"{dates[-1]} at commit {', '.join(commits)}, analysed again (--reuse) at this "
            "commit; the load columns: the load during each recorded run, min/median/max")


def texts(rows: list[dict], alternate: bool) -> list[str]:
    """The paragraphs under the table, from this run's figures."""
    out = [("Each pair is one run whose even steps are skewed and odd steps balanced; "
            if alternate else "Each pair is two runs, skewed and balanced, one after the "
            "other; ") + f"the first {WARMUP} steps of every run are left out."]
    kept = [r["transfer_corr"] for r in rows if r["transfer"] == "as measured"
            and r["transfer_corr"] is not None]
    if kept:
        out.append(f"The all-to-alls' transfer was kept as measured in {len(kept)} of "
                   f"{len(rows)} pairs: its fit with the rows each rank moved reached "
                   f"correlation {min(kept):.2f} to {max(kept):.2f}, below expert_corr "
                   f"{DEFAULT.expert_corr:.2f}.")
    gaps = [r for r in rows if "typical_predicted" in r]
    if gaps:
        total = statistics.median(r["typical_balanced"] - r["typical_predicted"] for r in gaps)
        parts = ", ".join(f"{name} {1e3 * statistics.median(r[f'gap {name}'] for r in gaps):+.1f}"
                          for name in CLASSES)
        out.append(f"Measured typical balanced step less the predicted one, median over pairs: "
                   f"{1e3 * total:+.1f} ms; by op class (each class's balanced costs put into "
                   f"the prediction in turn): {parts} ms. The compute outside the experts ran "
                   f"at {statistics.median(r['untouched'] for r in gaps):.2f}× its skewed-step "
                   "time in the balanced steps (median over pairs).")
    fits = [r["contention"] for r in rows if r.get("contention")]
    out.append(f"Ranks outnumbering their host's CPUs, the expert pieces' run delay fitted to "
               f"the ranks computing beside them (host_cores.py) in {len(fits)} of {len(rows)} "
               "pairs" + (": run delay per s of CPU time " + ", ".join(
                   f"{a:.2f} + {b:.2f} per other rank" for a, b in fits) if fits else "")
               + "; in the others it did not grow with them (or the layout has a core per "
               "rank) and the rows fit alone prices the expert compute.")
    host = [r for r in rows if "expert_cpu_predicted" in r]
    if host:
        def span(key: str, scale: float = 1.0) -> str:
            values = [scale * r[key] for r in host]
            return f"{min(values):.2f}–{max(values):.2f}"
        errors = [r["expert_cpu_predicted"] / r["expert_cpu_balanced"] - 1 for r in host]
        out.append(f"The expert pieces recorded their run delay (time runnable without a core) "
                   f"in {len(host)} of {len(rows)} pairs. Their own time (the rest: CPU time; "
                   f"with an emulated device, CPU and device time) at balanced rows, from the "
                   f"rows fit of the skewed steps, against the balanced steps' measured one: "
                   f"{100 * min(errors):+.0f}% to {100 * max(errors):+.0f}%. Run delay per "
                   f"second of own time in the skewed steps: the hot rank's pieces "
                   f"{span('wait_rate_hot')}, the other ranks' {span('wait_rate_cold')}; in the "
                   f"balanced steps every rank's {span('wait_rate_balanced')}.")
    waits = [r for r in rows if "a2a_wait_dispatch" in r]
    if waits:
        def ms(key: str, k: int) -> str:
            values = [1e3 * r[key][k] for r in waits]
            return f"{min(values):.1f}–{max(values):.1f}"
        out.append(f"The all-to-alls' threads waited for a core (their rows' run delay, at most "
                   f"the transfer) in {len(waits)} of {len(rows)} pairs, per step: the dispatches "
                   f"{ms('a2a_wait_dispatch', 0)} ms in the skewed steps, "
                   f"{ms('a2a_wait_dispatch', 1)} ms in the balanced; the other all-to-alls "
                   f"{ms('a2a_wait_other', 0)} and {ms('a2a_wait_other', 1)} ms. The prediction "
                   f"keeps the skewed steps' waits (the finding says so: an upper bound beyond "
                   f"perfect routing).")
    return out


def transfer_priced(finding) -> str:
    """How the finding priced the all-to-alls' transfer: at balanced volume, or as measured."""
    if finding is None:
        return "-"
    return "as measured" if "transfer kept as measured" in finding.evidence else "balanced"


def show(i: int, r: dict) -> None:
    """One pair's line."""
    shown = f"×{r['predicted']:.3f}" if r["predicted"] else "none (no expert_imbalance finding)"
    loads = "; ".join(f"load {name} " + ("/".join(f"{x:.1f}" for x in f["load"])
                                         if f.get("load") else "-")
                      for name, f in r["runs"].items())
    gap = ("; gap ms " + ", ".join(f"{n} {1e3 * r[f'gap {n}']:+.1f}" for n in CLASSES)
           + f"; untouched compute ×{r['untouched']:.2f}") if "untouched" in r else ""
    if "expert_cpu_predicted" in r:
        gap += (f"; expert own ms predicted/balanced {1e3 * r['expert_cpu_predicted']:.1f}/"
                f"{1e3 * r['expert_cpu_balanced']:.1f}; run delay per s own hot/other skewed "
                f"{r['wait_rate_hot']:.2f}/{r['wait_rate_cold']:.2f}, balanced "
                f"{r['wait_rate_balanced']:.2f}")
    if "a2a_wait_dispatch" in r:
        gap += ("; all-to-all threads' run delay per step, dispatches / others, skewed→balanced "
                "ms " + "{:.1f}→{:.1f} / {:.1f}→{:.1f}".format(
                    *(1e3 * x for x in r["a2a_wait_dispatch"] + r["a2a_wait_other"])))
    print(f"pair {i}: first finding {r['first']} {r['ranks']}; predicted {shown} "
          f"(replay basis), ×{r['predicted_measured']:.3f} (off the measured step); "
          f"measured ×{r['measured']:.3f} (mean step), ×{r['measured_median']:.3f} "
          f"(median step), ×{r['measured_nodelay']:.3f} (replay basis); transfer "
          f"{r['transfer']}; run delay fit {cells(i, r)['run delay fit, crowded host']}; "
          f"{loads}{gap}", flush=True)


if __name__ == "__main__":
    main()
