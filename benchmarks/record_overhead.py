"""Recorder overhead on examples/train_gpt.py: recorded vs unrecorded runs, side by side.

    .venv/bin/python benchmarks/record_overhead.py [--pairs 3] [--steps 20] [--nproc 4 --pp 2]

Two measurements in the same run:
1. In-process cost of the recorder's hot path (an op span, a recorded isend/wait-free path,
   a GC callback), timed over many iterations against the same loop without the recorder,
   times the ops per step of the example, over the example's step time: the overhead the
   recorder adds to a step, free of the machine's noise (the loops' thread CPU time, so a loaded
   machine does not inflate them; the writer's work is process CPU time).
2. End to end, interleaved in one job: --sample-every 2 records the even steps only, so each
   recorded step has an unrecorded neighbour under the same machine load; the median over
   neighbour pairs of t(recorded) / t(unrecorded). (The background writer's work lands on both.)
3. End to end, separate jobs: torchrun pairs (recorder on, recorder off), alternating order;
   on a shared machine this one mostly measures the noise.
Goal: <= 1% of step time.
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(args, record: bool, out: Path, extra: tuple[str, ...] = ()) -> dict:
    summary = out / ("on.json" if record else "off.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.nproc}", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           str(REPO / "examples" / "train_gpt.py"), "--pp", str(args.pp), "--steps", str(args.steps),
           "--summary", str(summary), "--trace-dir", str(out / "trace"), "--overwrite", *extra]
    if not record:
        cmd.append("--no-record")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    subprocess.run(cmd, check=True, env=env, cwd=REPO, capture_output=True)
    return json.loads(summary.read_text())


def hot_path_cost(iterations: int = 20000) -> dict[str, float]:
    """Seconds per recorded op span and per GC callback, net of the bare loop."""
    import gc

    from stragglers.record import Recorder
    from stragglers.trace.model import JobMeta

    with tempfile.TemporaryDirectory() as tmp:
        rec = Recorder(tmp, JobMeta(name="bench", dp_size=1, pp_size=1), dp_rank=0, stage=0,
                       flush_interval_s=0.5)
        with rec:
            # the training thread's CPU time, not wall time: on a shared machine the wall
            # time of a µs-long span mostly measures the scheduler (14-18 µs under load)
            def loop(recorded: bool) -> float:
                t0 = time.thread_time()
                for i in range(iterations):
                    if recorded:
                        if i % 100 == 0:
                            rec.begin_step(i)  # a fresh step every 100 ops, like a real loop
                        with rec.op("forward-compute", i % 8, seq_lens=(128, 128)):
                            pass
                    else:
                        with _Null():
                            pass
                return (time.thread_time() - t0) / iterations

            bare = min(loop(False) for _ in range(3))
            spans = min(loop(True) for _ in range(3))
            n = 2000
            t0 = time.thread_time()
            for _ in range(n):
                rec._on_gc("start", {})
                rec._on_gc("stop", {"generation": 0})
            gc_cb = (time.thread_time() - t0) / n
            gc.collect()
            # the background writer: one step of the example (19 rows) to columns, and one part
            from stragglers.record.writer import StepBuffer
            from stragglers.trace.runformat import write_rank

            writer = rec._writer
            t0 = time.process_time()
            for k in range(200):
                buf = StepBuffer(k, None)
                base = time.perf_counter_ns()
                buf.ops = [(0, base + i * 1000, base + i * 1000 + 500, i % 4, 0, 0, 1.0, 256, -1, ())
                           for i in range(19)]
                cols = writer.columns(buf)
            columns_s = (time.process_time() - t0) / 200
            t0 = time.process_time()
            for k in range(50):
                write_rank(Path(tmp) / "bench-parts", 0, cols, part=k)
            part_s = (time.process_time() - t0) / 50
    return {"op_span_s": spans - bare, "gc_callback_s": gc_cb, "columns_s": columns_s,
            "part_s": part_s}


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--pp", type=int, default=2)
    args = p.parse_args()

    cost = hot_path_cost()
    print(f"hot path: {cost['op_span_s'] * 1e6:.2f} µs per recorded op span, "
          f"{cost['gc_callback_s'] * 1e6:.2f} µs per GC callback pair; background writer: "
          f"{cost['columns_s'] * 1e3:.3f} ms CPU per step to columns, {cost['part_s'] * 1e3:.2f} ms "
          f"CPU per Parquet part (one per second by default)", flush=True)
    even_odd = {}
    with tempfile.TemporaryDirectory() as tmp:
        # the control run records nothing: its even/odd ratio is what the schedule alone gives
        for record in (True, False):
            job = run_job(args, record, Path(tmp), ("--sample-every", "2", "--steps",
                                                    str(2 * args.steps)))
            t = job["step_times"]["0"][2:]  # rank 0; steps 2, 3, ... (even = recorded)
            pairs = [t[i] / t[i + 1] for i in range(0, len(t) - 1, 2)]
            even_odd[record] = statistics.median(pairs)
            print(f"interleaved ({'recorded even steps' if record else 'control, nothing recorded'}"
                  f"): median t(even)/t(odd) over {len(pairs)} neighbour pairs = "
                  f"{even_odd[record]:.4f}", flush=True)
    interleaved = even_odd[True] / even_odd[False]
    print(f"interleaved overhead (recorded ratio / control ratio): {100 * (interleaved - 1):+.2f}%",
          flush=True)
    ratios, on_steps, off_steps = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.pairs):
            # alternate the order so neither side always runs first
            order = (True, False) if k % 2 == 0 else (False, True)
            got = {rec: run_job(args, rec, Path(tmp)) for rec in order}
            on, off = got[True]["mean_step_s"], got[False]["mean_step_s"]
            ratios.append(on / off)
            on_steps.append(on)
            off_steps.append(off)
            print(f"pair {k}: recorded {on * 1e3:.1f} ms/step, unrecorded {off * 1e3:.1f} ms/step, "
                  f"ratio {on / off:.3f}", flush=True)
    step = statistics.median(off_steps)
    ops_per_step = 4 * 2 + 4 + 3  # fwd+bwd per microbatch, p2p per microbatch, tail collectives
    # CPU the recorder spends per step: spans in the loop, the writer in the background (on
    # 2 shared cores the background thread's CPU is taken from the training too)
    per_step = (ops_per_step * cost["op_span_s"] + cost["columns_s"]
                + cost["part_s"] * min(1.0, step / 1.0))
    estimate = per_step / step
    print(f"in-process estimate: {ops_per_step} spans × {cost['op_span_s'] * 1e6:.2f} µs + writer "
          f"{(cost['columns_s'] + cost['part_s'] * min(1.0, step)) * 1e3:.2f} ms = "
          f"{per_step * 1e3:.3f} ms CPU per {step * 1e3:.0f} ms step = {100 * estimate:.3f}% of "
          "step time")
    print(f"end to end: median ratio {statistics.median(ratios):.3f} over {args.pairs} pairs "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    noise = abs(even_odd[False] - 1)
    resolved = noise < 0.01
    print(f"goal <= 1%: recorder CPU per step {'met' if estimate <= 0.01 else 'MISSED'} "
          f"({100 * estimate:.2f}%); end to end {'' if resolved else 'not resolvable here: '}"
          f"interleaved {100 * (interleaved - 1):+.2f}% with a control even/odd difference of "
          f"{100 * noise:.1f}%, separate jobs median {100 * (statistics.median(ratios) - 1):+.1f}%")
    from results import Figure, Run, write

    write(Run(benchmark="Recorder overhead", issue="3",
              command=f".venv/bin/python benchmarks/record_overhead.py --pairs {args.pairs} "
                      f"--steps {args.steps}",
              figures=[Figure(name=f"recorder CPU per step ({ops_per_step} spans + writer) / step "
                                   "time", value=f"{per_step * 1e3:.2f} ms / {step * 1e3:.0f} ms = "
                                                 f"{100 * estimate:.2f}%",
                              goal="≤ 1% of step time", met=estimate <= 0.01),
                       Figure(name="recorded op span, hot path (net of a bare loop), thread CPU",
                              value=f"{cost['op_span_s'] * 1e6:.2f} µs"),
                       Figure(name="end to end, interleaved in one job (`--sample-every 2`)",
                              value=f"{100 * (interleaved - 1):+.2f}%",
                              anchor=f"a control job recording nothing: even/odd difference "
                                     f"{100 * noise:.1f}%", goal="≤ 1%",
                              met=(interleaved - 1 <= 0.01) if resolved else None,
                              note="" if resolved else "not resolvable: the control's own "
                                                       "even/odd difference is over 1%")],
              table=[{"measurement": "GC callback pair",
                      "result": f"{cost['gc_callback_s'] * 1e6:.2f} µs"},
                     {"measurement": "background writer, CPU per step / per Parquet part",
                      "result": f"{cost['columns_s'] * 1e3:.3f} ms / {cost['part_s'] * 1e3:.2f} ms"},
                     {"measurement": f"separate jobs, recorded / unrecorded mean step, median of "
                                     f"{args.pairs} pairs",
                      "result": f"{statistics.median(ratios):.3f}"}],
              text=["`examples/train_gpt.py` (GPT, d 64, 4 blocks, 4 microbatches of 256 tokens, "
                    f"1F1B), {args.nproc} processes, pp {args.pp}. Replay fidelity on every "
                    "recorded run is checked by tests/record/test_record_distributed.py "
                    "(median error ≤ 2%, worst ≤ 5%)."]))


if __name__ == "__main__":
    main()
