"""The verdict on every real trace we have (none made by us), as one table.

Inputs: the single-rank GPU samples and NDTimeline samples of the real-data folder (tests/README.md, "Real data"), the 8-rank DLRM
job, HTA's single-process MI250 toy and the PAI mini-batch tables in tests/data/real. For each: ranks read, steps analysed,
S, replay error, the verdict (causes and the ranks they name), and the time to read and
analyse. A regression check for the reader and the diagnosis on what users bring.

    .venv/bin/python benchmarks/real_traces.py
"""

from __future__ import annotations

import tarfile
import tempfile
import time
from pathlib import Path

from results import Figure, Run, write

from stragglers.trace.load import load_trace
from stragglers.whatif import analyze

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
REAL = ROOT / "tests" / "data" / "real"


def inputs(tmp: Path) -> list[tuple[str, Path]]:
    """(label, path) of every real input present."""
    out = []
    with tarfile.open(REAL / "dlrm-8xv100" / "dlrm_kineto.tar.gz") as tar:
        tar.extractall(tmp, filter="data")
    out.append(("DLRM, 8 of 8 ranks, V100", tmp / "dlrm_kineto"))
    out.append(("HTA MI250 toy, 1 process, ROCm",
                REAL / "hta-mi250-minitoy" / "mi250_minitoy_train_ROCm6_2_kineto.json.gz"))
    for folder in sorted((SHARED / "kineto-gpu-samples").glob("*/")):
        out.append((folder.name, folder))
    for name in ("job_4_norm.csv", "job_2_norm.csv", "job_1_norm.csv", "job_3_norm.csv"):
        out.append((f"PAI {name}", REAL / "pai-minibatch" / name))
    for x in ("AR", "SE", "ST"):
        out.append((f"NDTimeline {x}", SHARED / "ndtimeline-samples" / f"trace-{x}.parquet"))
    return [(label, p) for label, p in out if p.exists()]


def verdict(result) -> str:
    parts = []
    for f in result.diagnosis:
        ranks = sorted({w.rank for w in f.where.workers if w.rank is not None})
        parts.append(f.cause + (f" {ranks}" if ranks else ""))
    return "; ".join(parts)


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        print("| input | ranks read | steps | S | sim_error | straggling | verdict | read + analyse |")
        print("|---|---|---|---|---|---|---|---|")
        for label, path in inputs(Path(tmp)):
            t0 = time.perf_counter()
            trace = load_trace(path)
            result = analyze(trace)
            dt = time.perf_counter() - t0
            job = result.job
            rows.append({"input": label, "ranks read": f"{job.ranks_read} of {job.world_size}",
                         "steps": str(len(result.steps_analysed)), "S": f"{result.slowdown:.4f}",
                         "sim_error": f"{100 * result.sim_error:.2f}%",
                         "straggling": str(result.straggling), "verdict": verdict(result),
                         "read + analyse": f"{dt:.2f} s"})
            print("| " + " | ".join(rows[-1].values()) + " |", flush=True)
    by_input = {r["input"]: r for r in rows}
    figures = [Figure(name=f"{label}: S, verdict", value=f"{r['S']}, {r['verdict']}")
               for label, r in by_input.items() if label.startswith(("DLRM", "PAI job_4", "NDTimeline SE"))]
    figures.append(Figure(name="real inputs read and analysed", value=f"{len(rows)}",
                          note="inputs absent from this checkout are skipped (the public GPU and "
                               "NDTimeline samples the tests use, tests/conftest.py)"))
    write(Run(benchmark="Real jobs: GPU profiler traces and production step times", issue="29",
              command=".venv/bin/python benchmarks/real_traces.py", figures=figures, table=rows))


if __name__ == "__main__":
    main()
