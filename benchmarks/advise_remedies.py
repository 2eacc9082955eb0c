"""Each remedy's predicted speedup (advise on the before run) beside its measured speedup.

    .venv/bin/python benchmarks/advise_remedies.py [--only slow-device,late-host,gc,stage] [--reps 2]

Each row is a real job (examples/train_advised.py under torchrun, gloo, no controller) with one
injected cause. The before run calibrates (`--calibrate`: each rank's compute at three batch
sizes, a full collection on every rank at once) and writes its step timings and calibration as
a run directory; `advise` on it predicts every remedy; then the job runs again with each
measurable remedy that applies switched on from step 0 (the StragglAR hook, the advised per-rank
batches, planned GC with the advised N), and for ND without the injection (what a restart on a
healthy host gives; the restart's own cost is left out of both the prediction and the
measurement), and for gradient coding the job on the coded trainer (benchmarks/coded_remedy.py:
the same model, batch and simulated device, master/worker, n + 1 ranks; its uncoded step on that
trainer is printed beside it). A repetition runs before, the remedies, and a second
before (A/A); the next repetition reverses the order. Measured speedup = mean of the two befores
/ after (steps after the first 2, the slowest rank's end per step). The rows `stage` and
`sequence` are examples/train_gpt.py jobs (recorded, as record_fixes.py runs them) for the
remedies the diagnosis prices: stage split (`--balance-stages`) and sequence balancing. The A/A
spread |before − before2| / mean is the noise floor printed next to each error: an error inside
it cannot be told from noise.
Goals: the first-ranked applicable remedy measures best; each prediction within 15%.
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

# name: (processes, shared args, injection args, note)
ROWS = {
    "slow-device": (4, ["--sample-time", "0.004"], ["--slow-rank", "3", "--slow-factor", "2.5"],
                    "rank 3's device takes 2.5× per sample"),
    "late-host": (4, ["--width", "1024", "--sample-time", "0.01"],
                  ["--stall-rank", "3", "--stall-s", "0.1"],
                  "rank 3 does 100 ms of host work before each step; 12 MB of gradients"),
    "late-host-8": (8, ["--width", "1024", "--sample-time", "0.01"],
                    ["--stall-rank", "7", "--stall-s", "0.15"],
                    "8 ranks; rank 7 does 150 ms of host work before each step; 12 MB of gradients"),
    "gc": (4, ["--sample-time", "0.002"], ["--gc-heap-mb", "30", "--gc-garbage", "0.6"],
           "30 MB live heap, cyclic garbage in each forward: automatic collections at different steps"),
}
# rows on examples/train_gpt.py (the recorder's trace, analysed): name: (processes, injection
# args, note, {remedy: the args that switch it on}); the fixes are those of record_fixes.py
GPT_ROWS = {
    # dp 1 x pp 2: one core per rank on the 2-core machine (4 ranks would share cores)
    "stage": (2, ["--pp", "2", "--extra-last-stage-layers", "4"],
              "dp 1 × pp 2, 4 extra blocks on the last stage",
              {"stage-split": ["--balance-stages"]}),
    "sequence": (2, ["--pp", "1", "--seq-len-dist", "lognormal", "--max-seq-len", "1024",
                     "--microbatches", "2"],
                 "dp 2, lognormal sequence lengths up to 1024 tokens, 2 microbatches",
                 {"sequence-balancing": ["--balance-sequences"]}),
}
# measured in a row even where the plan says it does not apply (the prediction is checked too)
ALWAYS = {"gc": ("planned-gc",)}
# ND is measured as the run without the injection: what a restart on a healthy host gives. A
# restarted worker keeps its heap and its data loader, so that stands for a restart only where
# the injection is the device's
ND_MEASURED = ("slow-device",)
MEASURED = ("stragglar", "antdt-dd", "planned-gc", "antdt-nd")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(nproc: int, args: list[str], out: Path, steps: int, calibrate: bool = False) -> dict:
    """One torchrun job of examples/train_advised.py; returns its summary."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           str(REPO / "examples" / "train_advised.py"), "--no-act", *args, "--steps", str(steps),
           *(["--calibrate"] if calibrate else []),
           "--summary", str(out / "summary.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"training failed:\n{proc.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text())


def train_coded(nproc: int, args: list[str], advice, out: Path, steps: int) -> dict | None:
    """The job under coded training (benchmarks/coded_remedy.py, n + 1 ranks), and uncoded on the
    same trainer for reference. None where the row's injection is not modelled there."""
    if any(a.startswith("--gc") for a in args):
        return None
    out.mkdir(parents=True, exist_ok=True)
    scheme, s = advice.details.scheme, advice.details.s
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc + 1}", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           str(REPO / "benchmarks" / "coded_remedy.py"), *args, "--scheme", scheme,
           "--stragglers", str(s), "--steps", str(steps), "--summary", str(out / "summary.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"coded training failed:\n{proc.stderr[-3000:]}")
    runs = json.loads((out / "summary.json").read_text())
    coded, plain = runs[f"{scheme}-s{s}"], runs["wait-for-all"]
    return {"mean_step_s": coded["mean_step_s"], "uncoded_step_s": plain["mean_step_s"]}


def remedy_args(name: str, plan, inject: list[str]) -> tuple[list[str], list[str]] | None:
    """(extra args, injection args) that switch `name` on; None when it cannot be measured here."""
    advice = plan.get(name)
    if name == "stragglar":
        return ["--stragglar"], inject
    if name == "antdt-dd":
        sizes = getattr(advice.details, "new_batch_sizes", None) if advice else None
        return (["--batch-sizes", ",".join(map(str, sizes))], inject) if sizes else None
    if name == "planned-gc":
        every = getattr(advice.details, "every", None) if advice else None
        if not isinstance(every, int):  # refused, or unset (UNSET)
            return None
        return ["--planned-gc", str(every)], inject
    if name == "antdt-nd":
        return [], []  # the restarted worker runs on a healthy host: no injection
    return None


def predicted(name: str, plan) -> float | None:
    """The predicted speedup compared with the measurement (ND: the step after the restart)."""
    advice = plan.get(name)
    if advice is None:
        return None
    if name == "antdt-nd":
        fixed = getattr(advice.details, "fixed_step_s", None) or advice.predicted_step_s
        return plan.baseline_step_s / fixed if fixed else None
    return advice.predicted_speedup


def uncalibrated(trace):
    """The same trace without the calibration step's numbers (advise then assumes compute ∝
    batch and prices planned GC from the recorded automatic collections)."""
    from dataclasses import replace

    from stragglers.trace.model import Trace

    extra = {k: v for k, v in (trace.meta.extra or {}).items() if k != "calibration"}
    return Trace(trace.ops, replace(trace.meta, extra=extra), trace.source)


def run_row(name: str, steps: int, reps: int, tmp: Path, measure_all: bool = False) -> list[dict]:
    from stragglers.advice import advise
    from stragglers.trace.runformat import read_run

    nproc, common, inject, note = ROWS[name]
    rows = []
    for rep in range(reps):
        before_dir = tmp / f"{name}-before-{rep}"
        runs = {}
        # the plan is needed to switch remedies on: a before run always comes first; the
        # repetition's second before (the A/A pair) closes it, on the other side of the remedies
        b = train(nproc, common + inject + ["--trace-dir", str(before_dir / "trace")],
                  before_dir, steps, calibrate=True)
        trace = read_run(before_dir / "trace")
        plan = advise(trace, remaining_steps=steps)
        plain = advise(uncalibrated(trace), remaining_steps=steps)  # what the model alone says
        runs["before"] = b
        todo = [m for m in MEASURED if (m == "antdt-nd" and name in ND_MEASURED) or measure_all
                or m in ALWAYS.get(name, ()) or (plan.get(m) is not None and plan.get(m).applies)]
        todo += [r.name for r in plan.remedies if r.name.startswith("gradient-coding")
                 and (r.applies or measure_all)]
        if rep % 2:
            todo = todo[::-1]
        for which in todo:
            if which.startswith("gradient-coding"):
                coded = train_coded(nproc, common + inject, plan.get(which),
                                    tmp / f"{name}-{which}-{rep}", steps)
                if coded is not None:
                    runs[which] = coded
                continue
            spec = remedy_args(which, plan, inject)
            if spec is None:
                continue
            extra, inj = spec
            runs[which] = train(nproc, common + inj + extra, tmp / f"{name}-{which}-{rep}", steps)
        before2_dir = tmp / f"{name}-before2-{rep}"
        runs["before2"] = train(nproc, common + inject + ["--trace-dir", str(before2_dir / "trace")],
                                before2_dir, steps, calibrate=True)
        # the same prediction from the A′ run: how much of an error is the predicting run's noise
        plan2 = advise(read_run(before2_dir / "trace"), remaining_steps=steps)
        rows.append(finish_row(name, rep, note, runs, plan, plain, plan2,
                               runs["before"].get("calibration")))
    return rows


def run_gpt_row(name: str, steps: int, reps: int, tmp: Path, measure_all: bool = False
                ) -> list[dict]:
    """A train_gpt row: before (recorded, advised), each fix that applies, a second before."""
    from record_fixes import train as train_gpt  # the same job runner as the fixes benchmark

    from stragglers.advice import advise
    from stragglers.trace.runformat import read_run

    nproc, inject, note, fixes = GPT_ROWS[name]
    rows = []
    for rep in range(reps):
        runs = {"before": train_gpt(nproc, inject, tmp / f"{name}-before-{rep}", steps)}
        plan = advise(read_run(tmp / f"{name}-before-{rep}" / "trace"), remaining_steps=steps)
        todo = [k for k in fixes if measure_all or (plan.get(k) is not None and plan.get(k).applies)]
        for which in todo[::-1] if rep % 2 else todo:
            runs[which] = train_gpt(nproc, inject + fixes[which], tmp / f"{name}-{which}-{rep}",
                                    steps)
        runs["before2"] = train_gpt(nproc, inject, tmp / f"{name}-before2-{rep}", steps)
        plan2 = advise(read_run(tmp / f"{name}-before2-{rep}" / "trace"), remaining_steps=steps)
        rows.append(finish_row(name, rep, note, runs, plan, None, plan2, None))
    return rows


def finish_row(name, rep, note, runs, plan, plain, plan2, calibration) -> dict:
    """The row's record (befores, A/A, each remedy's predictions and measurement), printed."""
    befores = [runs[k]["mean_step_s"] for k in ("before", "before2") if k in runs]
    before = statistics.mean(befores)
    row = {"row": name, "rep": rep, "note": note, "before_ms": [1e3 * b for b in befores],
           "aa_spread": abs(befores[0] - befores[-1]) / before, "calibration": calibration,
           "ranking": [r.name for r in plan.remedies if r.applies], "remedies": {}}
    for r in plan.remedies:
        entry = {"applies": r.applies, "why_not": r.why_not, "predicted": predicted(r.name, plan),
                 "predicted_uncalibrated": predicted(r.name, plain) if plain else None,
                 "predicted_a2": predicted(r.name, plan2)}
        if r.name in runs:
            entry["after_ms"] = 1e3 * runs[r.name]["mean_step_s"]
            entry["measured"] = before / runs[r.name]["mean_step_s"]
            if "uncoded_step_s" in runs[r.name]:  # the coded trainer's own uncoded step
                entry["uncoded_ms"] = 1e3 * runs[r.name]["uncoded_step_s"]
        row["remedies"][r.name] = entry
    print_row(row)
    return row


def print_row(row: dict) -> None:
    aa = f"{100 * row['aa_spread']:.0f}%"
    print(f"\n{row['row']} rep {row['rep']} ({row['note']}): before "
          f"{', '.join(f'{b:.0f}' for b in row['before_ms'])} ms (A/A spread {aa}); ranked "
          f"{row['ranking']}", flush=True)
    print("| remedy | applies | predicted (uncalibrated); from A′ | measured | |Δ|/measured | A/A | "
          "after ms |",
          flush=True)
    print("|---|---|---|---|---|---|---|", flush=True)
    for name, e in row["remedies"].items():
        pred = f"×{e['predicted']:.3f}" if e["predicted"] else "–"
        if e.get("predicted_uncalibrated") and e["predicted_uncalibrated"] != e["predicted"]:
            pred += f" (×{e['predicted_uncalibrated']:.3f})"
        if e.get("predicted_a2"):
            pred += f"; A′ ×{e['predicted_a2']:.3f}"
        meas = f"×{e['measured']:.3f}" if "measured" in e else "not measured"
        err = f"{100 * abs(e['predicted'] - e['measured']) / e['measured']:.0f}%" \
            if e["predicted"] and "measured" in e else "–"
        after = f"{e['after_ms']:.0f}" if "after_ms" in e else "–"
        if "uncoded_ms" in e:
            after += f" (uncoded on the coded trainer {e['uncoded_ms']:.0f})"
        why = "" if e["applies"] else f" ({e['why_not'][:70]}…)" if e["why_not"] else ""
        print(f"| {name} | {'yes' if e['applies'] else 'no'}{why} | {pred} | {meas} | {err} | {aa} "
              f"| {after} |", flush=True)
    # among the remedies the plan offers (ND refused for a short job is measured for its prediction)
    measured = {k: e["measured"] for k, e in row["remedies"].items()
                if "measured" in e and e["applies"]}
    first = next((k for k in row["ranking"] if k in measured), None)
    if first and measured:
        best = max(measured, key=measured.get)
        within = [k for k, e in row["remedies"].items() if e["predicted"] and "measured" in e
                  and abs(e["predicted"] - e["measured"]) <= 0.15 * e["measured"]]
        total = [k for k, e in row["remedies"].items() if e["predicted"] and "measured" in e]
        print(f"first-ranked measured remedy: {first}; best measured of those applicable: {best} "
              f"({'goal met' if first == best else 'goal NOT met'}); predictions within 15%: "
              f"{len(within)} of {len(total)}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join([*ROWS, *GPT_ROWS]))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--gpt-steps", type=int, default=16, help="steps of the train_gpt rows")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--measure-all", action="store_true",
                   help="also measure remedies the plan says do not apply")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--keep", type=Path, default=None, help="keep the runs (traces) in this folder")
    args = p.parse_args()
    report = []
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        where = args.keep or Path(tmp)
        for name in args.only.split(","):
            if name in GPT_ROWS:
                report += run_gpt_row(name, args.gpt_steps, args.reps, where, args.measure_all)
            else:
                report += run_row(name, args.steps, args.reps, where, args.measure_all)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    write_results(report, args, (time.monotonic() - began) / 60)


def write_results(report: list[dict], args: argparse.Namespace, minutes: float) -> None:
    """Predictions within 15% and first-ranked-measures-best over every row, each comparison;
    the table gives each row's remedies as medians over its repetitions, the notes the misses
    and what the machine's cores make of the rows."""
    from results import Figure, Run, write

    offs, misses, rows_ok = [], [], []
    compared: dict[tuple[str, str], list[tuple[float, float, float]]] = {}  # (row, remedy) ->
    for row in report:                                  # (predicted, measured, A/A) per rep
        measured = {k: e["measured"] for k, e in row["remedies"].items()
                    if "measured" in e and e["applies"]}
        first = next((k for k in row["ranking"] if k in measured), None)
        if first:
            rows_ok.append(first == max(measured, key=measured.get))
        for name, e in row["remedies"].items():
            if not (e["predicted"] and "measured" in e):
                continue
            off = abs(e["predicted"] - e["measured"]) / e["measured"]
            offs.append(off)
            label = name + ("" if e["applies"] else " (refused)")
            compared.setdefault((row["row"], label), []).append(
                (e["predicted"], e["measured"], row["aa_spread"]))
            if off > 0.15:
                misses.append(f"{label} on {row['row']} rep {row['rep']} {100 * off:.0f}% "
                              f"(its two before runs differ by {100 * row['aa_spread']:.0f}%)")
    table, described = [], set()
    for (row, remedy), got in compared.items():
        pred, meas = (statistics.median(x[i] for x in got) for i in (0, 1))
        table.append({"row": row if row in described else f"{row} ({ranks(row)} ranks, "
                                                              f"{row_note(row)})",
                      "remedy": remedy, "predicted (median over repetitions)": f"×{pred:.3f}",
                      "measured": f"×{meas:.3f}", "off": f"{100 * abs(pred - meas) / meas:.0f}%",
                      "A/A (median)": f"{100 * statistics.median(x[2] for x in got):.0f}%",
                      "repetitions": str(len(got))})
        described.add(row)
    within = sum(o <= 0.15 for o in offs)
    command = (f".venv/bin/python benchmarks/advise_remedies.py --only {args.only} --reps "
               f"{args.reps} --steps {args.steps}" + (" --measure-all" if args.measure_all else ""))
    write(Run(benchmark="Advise: predicted vs measured gain per remedy", issue="17", command=command,
              figures=[Figure(name="each prediction within 15% of the measured gain",
                              value=f"{within} of {len(offs)} comparisons (median |off| "
                                    f"{100 * statistics.median(offs):.0f}%)" if offs else "none",
                              goal="every prediction within 15%",
                              met=bool(offs) and within == len(offs),
                              note="misses: " + "; ".join(misses) if misses else ""),
                       Figure(name="the first-ranked remedy measures best",
                              value=f"{sum(rows_ok)} of {len(rows_ok)} repetitions",
                              goal="in every repetition", met=bool(rows_ok) and all(rows_ok))],
              note=f"{minutes:.0f} minutes of real jobs ({len(report)} repetitions).",
              table=table, text=[METHOD, cores_note(report)]))


METHOD = ("Each repetition: a calibrated before run → advise → each applicable remedy from step 0 "
          "→ a second before run (its A/A noise floor), order reversed in odd repetitions; "
          "measured = mean of the two befores / after. Gradient coding is measured by running "
          "the same job on the coded trainer (`benchmarks/coded_remedy.py`, n + 1 ranks).")


def ranks(row: str) -> int:
    """The processes a row's job runs on."""
    return ROWS[row][0] if row in ROWS else GPT_ROWS[row][0]


def row_note(row: str) -> str:
    """A row's injection in words."""
    return ROWS[row][3] if row in ROWS else GPT_ROWS[row][2]


def cores_note(report: list[dict]) -> str:
    """Which rows ran more processes than the machine has cores (they shared cores)."""
    cores = os.cpu_count() or 1
    rows = sorted({r["row"] for r in report})
    coded = sorted({r["row"] for r in report for k, e in r["remedies"].items()
                    if k.startswith("gradient-coding") and "measured" in e})
    shared = [f"{r} ({ranks(r)} ranks)" for r in rows if ranks(r) > cores]
    shared += [f"{r} on the coded trainer ({ranks(r) + 1} ranks)" for r in coded
               if ranks(r) + 1 > cores]
    return (f"This machine has {cores} cores. Runs whose processes shared them: "
            + (", ".join(shared) if shared else "none")
            + ". Where processes share cores, a remedy's measured gain includes their "
              "competition for them.")


if __name__ == "__main__":
    main()
