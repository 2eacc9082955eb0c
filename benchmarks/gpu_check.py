"""The GPU check (`make gpu-check`): every CUDA/NCCL path run once and checked, as one table.

    .venv/bin/python benchmarks/gpu_check.py [--out gpu-check.md]

On a machine with N ≥ 1 CUDA GPUs, in under 5 minutes:
1. the recorder on a real GPU training step: host time per recorded op (goal ≤ 5 µs), the
   recorder's share of a ≥ 100 ms step (goal ≤ 1%), CUDA-event vs host-timer durations;
2. `examples/train_gpt.py` on CUDA under torchrun (NCCL with N ranks; dp = N, pp = 1), then the
   analysis of its trace (replay error);
3. the GPU test modules (`tests/gpu/`): StragglAR, gradient coding and the AntDT DD step on CUDA
   tensors, each checked against the plain result (NCCL refuses two ranks on one GPU, so with one
   GPU they run NCCL with world size 1 plus gloo processes holding CUDA tensors).
Without a GPU every row says SKIP and why; the exit status is non-zero only when a check failed.
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
import xml.etree.ElementTree as ET
from pathlib import Path

from results import RESULTS, Figure, Run, write

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recorder_overhead(rows: list) -> None:
    """Host µs per recorded op and the recorder's share of a ~100 ms CUDA step, in one process."""
    import torch

    from stragglers.record import Recorder
    from stragglers.trace.model import JobMeta
    from stragglers.trace.runformat import read_run

    dev = torch.device("cuda")
    width = 4096
    layers = [torch.nn.Linear(width, width, device=dev) for _ in range(8)]
    x = torch.randn(4096, width, device=dev)

    def microbatch(rec, mb):
        with rec.op("forward-compute", mb) if rec else _null():
            y = x
            for layer in layers:
                y = torch.relu(layer(y))
        with rec.op("backward-compute", mb) if rec else _null():
            y.sum().backward()

    def step(rec, s, mbs):
        ctx = rec.step(s) if rec else _null()
        with ctx:
            for mb in range(mbs):
                microbatch(rec, mb)
        torch.cuda.synchronize()

    out = Path(tempfile.mkdtemp(prefix="gpu-check-rec-"))
    with Recorder(out / "run", JobMeta(name="gpu-check", dp_size=1, pp_size=1), dp_rank=0,
                  stage=0) as rec:
        # size the step to >= 100 ms
        mbs = 1
        while True:
            t0 = time.perf_counter()
            step(None, 0, mbs)
            if time.perf_counter() - t0 >= 0.1 or mbs >= 256:
                break
            mbs *= 2
        plain, recorded = [], []
        for s in range(1, 11):           # interleaved: recorded and plain neighbours
            t0 = time.perf_counter()
            step(rec if s % 2 else None, s, mbs)
            (recorded if s % 2 else plain).append(time.perf_counter() - t0)
        # host cost of one recorded op around an empty region, against the same loop without it
        n = 20000
        with rec.step(1000):
            t0 = time.perf_counter_ns()
            for i in range(n):
                with rec.op("forward-compute", i):
                    pass
            with_rec = time.perf_counter_ns() - t0
        t0 = time.perf_counter_ns()
        for i in range(n):
            with _null():
                pass
        without = time.perf_counter_ns() - t0
    trace = read_run(out / "run")
    per_op_us = (with_rec - without) / n / 1e3
    share = statistics.median(recorded) / statistics.median(plain) - 1
    fwd = trace.ops["duration"][trace.ops["optype"] == trace.ops["optype"][0]]
    rows.append(("recorder: host time per recorded op", f"{per_op_us:.2f} µs", "≤ 5 µs",
                 "PASS" if per_op_us <= 5 else "FAIL"))
    rows.append((f"recorder: share of a {statistics.median(plain) * 1e3:.0f} ms step "
                 f"({mbs} microbatches)", f"{share * 100:+.2f}%", "≤ 1%",
                 "PASS" if share <= 0.01 else "FAIL"))
    rows.append(("recorder: CUDA-event op durations recorded", f"{len(fwd)} ops, median "
                 f"{statistics.median(fwd.tolist()) * 1e3:.2f} ms", "> 0", "PASS" if len(fwd) and
                 min(fwd.tolist()) > 0 else "FAIL"))


class _null:
    def __enter__(self):
        return True

    def __exit__(self, *exc):
        return False


def train_gpt(rows: list, ngpu: int) -> None:
    """examples/train_gpt.py on CUDA under torchrun, then the analysis of its trace."""
    out = Path(tempfile.mkdtemp(prefix="gpu-check-gpt-"))
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ngpu}",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(REPO / "examples/train_gpt.py"),
           "--pp", "1", "--steps", "8", "--trace-dir", str(out / "run")]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        rows.append((f"train_gpt.py on CUDA, NCCL × {ngpu}", f"exit {proc.returncode}: "
                     f"{(proc.stderr.strip().splitlines() or [''])[-1][:120]}", "exit 0", "FAIL"))
        return
    ana = subprocess.run([PY, "-m", "stragglers.cli", "analyze", str(out / "run"), "--quiet",
                          "--json", str(out / "result.json")], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    if ana.returncode != 0:
        rows.append(("analysis of the CUDA run", ana.stderr.strip()[-160:], "exit 0", "FAIL"))
        return
    result = json.loads((out / "result.json").read_text())
    err = result.get("sim_error", float("nan"))
    rows.append((f"train_gpt.py on CUDA, NCCL × {ngpu}", f"8 steps in {took:.0f} s, S "
                 f"{result.get('slowdown', float('nan')):.3f}, replay error {err:.4f}",
                 "replay error ≤ 0.02", "PASS" if err <= 0.02 else "FAIL"))


def gpu_tests(rows: list) -> None:
    """The GPU-only test modules, one row per test."""
    xml = Path(tempfile.mkdtemp(prefix="gpu-check-junit-")) / "junit.xml"
    subprocess.run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu",
                    f"--junitxml={xml}"], cwd=REPO, timeout=300)
    if not xml.exists():
        rows.append(("tests/gpu", "pytest wrote no report", "", "FAIL"))
        return
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        outcome, detail = "PASS", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "SKIP" if tag == "skipped" else "FAIL"
                detail = (node.get("message") or "")[:120]
        rows.append((name, detail or f"{float(case.get('time', 0)):.1f} s", "equal to plain",
                     outcome))


def _gpu_run_on_record(path: Path) -> bool:
    """Whether the stored result was measured on a GPU (its note names at least one)."""
    if not path.exists():
        return False
    note = json.loads(path.read_text()).get("note", "")
    return " CUDA GPU(s): " in note


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="also write the table (Markdown) here")
    args = p.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    rows: list[tuple[str, str, str, str]] = []
    try:
        import torch
    except ImportError:
        torch = None
    ngpu = torch.cuda.device_count() if torch is not None and torch.cuda.is_available() else 0
    header = (f"torch {torch.__version__ if torch else 'missing'}, "
              f"{ngpu} CUDA GPU(s)" + (f": {torch.cuda.get_device_name(0)}" if ngpu else ""))
    if ngpu == 0:
        for what, goal in (("recorder: host time per recorded op", "≤ 5 µs"),
                           ("recorder: share of a ≥ 100 ms step", "≤ 1%"),
                           ("train_gpt.py on CUDA", "exit 0"),
                           ("tests/gpu: StragglAR, coding and DD on CUDA", "equal to plain")):
            rows.append((what, "no CUDA GPU on this machine", goal, "SKIP"))
    else:
        for check in (lambda: recorder_overhead(rows), lambda: train_gpt(rows, ngpu),
                      lambda: gpu_tests(rows)):
            try:
                check()
            except Exception as exc:  # one failed check must not hide the others
                rows.append((getattr(check, "__name__", "check"), f"{type(exc).__name__}: "
                             f"{str(exc)[:140]}", "", "FAIL"))
    table = [f"GPU check, {time.strftime('%Y-%m-%d %H:%M')}: {header}", "",
             "| check | result | goal | verdict |", "|---|---|---|---|"]
    table += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    text = "\n".join(table)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    # A run without a GPU measures nothing: it is written only while no GPU run is on record,
    # so it never replaces a GPU run's figures.
    if ngpu or not _gpu_run_on_record(RESULTS / "gpu_check.json"):
        note = header if ngpu else (f"{header}: every row SKIP; the goals are unmeasured and "
                                    "every CUDA/NCCL path untested")
        write(Run(benchmark="GPU check", issue="16",
                  command=".venv/bin/python benchmarks/gpu_check.py", note=note,
                  text=["`make gpu-check` runs this script; without a CUDA GPU every row says "
                        "SKIP."],
                  figures=[Figure(name=a, value=b, goal=c,
                                  met={"PASS": True, "FAIL": False}.get(d)) for a, b, c, d in rows]))
    return 1 if any(r[3] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    sys.exit(main())
