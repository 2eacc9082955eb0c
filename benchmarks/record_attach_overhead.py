"""What `stragglers.record.attach` costs: per recorded op, and on a ≥100 ms training step.

    .venv/bin/python benchmarks/record_attach_overhead.py [--reps 30] [--steps 40] [--rounds 3]

Everything runs in one process (a one-rank gloo group, so DDP's comm hook path runs), recorded
and unrecorded side by side under the same machine load:
1. Per recorded op, on tiny models (the hooks dominate), for a plain module and for DDP, with
   attach's Python hooks (STRAGGLERS_RECORD_NATIVE=0) and with its native hooks: each
   repetition times a block of bare steps, a block of attached steps, and a second bare block
   (A B A'); the cost is the median over repetitions of rec − (A + A')/2, divided by the ops per
   step (the rows each recorded step holds, read back from the run), with a 95% bootstrap
   interval of that median; the control (A/A) spread is the median |A' − A| per op. Both the training thread's CPU
   time (time.thread_time_ns: what the hooks cost, free of the scheduler's noise on a shared
   machine) and wall time are shown, with the cost of a no-op Python `with` block measured in
   the same process as the unit (the ratio says how many empty context managers an op costs).
2. On a big step: a DDP model whose step takes ≥ 100 ms; attach with sample_every=2 records the
   even steps only, so each recorded step has an unrecorded neighbour; per round the overhead
   is median t(even)/t(odd) over neighbour pairs divided by the same ratio of a control run
   without attach; rounds alternate which run goes first; the control spread is the median
   |ratio − 1| of the control runs. On a shared machine that spread is larger than the goal, so
   the cost is also computed from part 1: rows recorded per big step (read back from the run) ×
   the DDP per-op cost (the hooks' work does not grow with tensor size), over the step time.
Goals (issue 15): ≤ 2 µs per recorded op, ≤ 1% of a ≥ 100 ms step.

3. Model parallelism (issue 30), `--parallel`: the tensor-parallel example (examples/train_tp.py,
   FSDP2 + TP, dp 1 × tp 2) and the expert-parallel one (examples/train_moe.py, EP 2), each
   under torchrun with 2 gloo ranks, small sizes (the hooks dominate). Per rank, repetitions of
   bare / attached / bare blocks of the example's own step on the same model (attach is closed
   after each block); cost per op = median over repetitions and ranks of attached − mean of
   the bare blocks, over the rows each recorded step holds (read back from the run); the steps'
   CPU (training thread) and wall times side by side, with their ratio attached / bare.
   The 3-D case (FSDP2 + TP + pipelining, train_tp.py --pp 2: pp 2 × tp 2 on 4 ranks, a 1F1B
   schedule of 4 microbatches, attach given the schedule) is measured the same way, after them,
   and `3d-dp2` the same on 8 ranks (dp 2 × tp 2 × pp 2: FSDP2 gathers and reduce-scatters too).

    .venv/bin/python benchmarks/record_attach_overhead.py --parallel [--reps 10] [--steps 10] \
        [--only tp,moe,3d,3d-dp2]

Figures go to benchmarks/results/record_attach_overhead.json (parts 1-2) and
record_attach_overhead_parallel.json (part 3), through benchmarks/results.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from results import Figure, Run, write  # noqa: E402
from stragglers.record import attach, native  # noqa: E402
from stragglers.trace.runformat import read_run  # noqa: E402


NATIVE_ENV = native.ENV


def ddp(d_in: int, d_hidden: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d_in, d_hidden), nn.GELU(), nn.Linear(d_hidden, d_in))
    wrapped = nn.parallel.DistributedDataParallel(model)
    return wrapped, torch.optim.SGD(wrapped.parameters(), lr=1e-4)


def run_steps(model, opt, x, steps: int, microbatches: int) -> list[float]:
    """Plain training steps; returns each step's wall time."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for _ in range(microbatches):
            model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return times


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def null_context_ns(n: int = 20000) -> float:
    """Thread-CPU ns of one empty `with` block (the unit the per-op cost is compared to)."""
    null = _Null()
    best = float("inf")
    for _ in range(5):
        t0 = time.thread_time_ns()
        for _ in range(n):
            with null:
                pass
        best = min(best, (time.thread_time_ns() - t0) / n)
    return best


def timed_block(model, opt, x, steps: int, microbatches: int) -> tuple[float, float]:
    """(thread-CPU ns, wall ns) per step over a block of plain training steps."""
    c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
    run_steps(model, opt, x, steps, microbatches)
    return (time.thread_time_ns() - c0) / steps, (time.perf_counter_ns() - w0) / steps


def per_op_cost(wrap: bool, reps: int, native: bool, steps: int = 50,
                microbatches: int = 4) -> dict:
    """Per-op cost of attach on a tiny model: interleaved A B A' blocks, medians over reps.

    The plain module is the same model in all three blocks (attached for B, closed after), so
    no difference between two models' memory layouts is counted; DDP takes one comm hook for
    life, so each repetition uses a fresh pair of models.
    """
    make = ddp if wrap else plain
    x = torch.randn(4, 8)
    rows = []  # rows recorded per step, read back from each repetition's run
    diff = {"cpu": [], "wall": []}
    aa = {"cpu": [], "wall": []}
    os.environ[NATIVE_ENV] = "1" if native else "0"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            bare_m, bare_o = make(8, 8)
            for rep in range(reps):
                if wrap:
                    bare_m, bare_o = make(8, 8)
                    rec_m, rec_o = make(8, 8)
                else:
                    rec_m, rec_o = bare_m, bare_o
                run_steps(bare_m, bare_o, x, 10, microbatches)  # warm-up
                a = timed_block(bare_m, bare_o, x, steps, microbatches)
                with attach(rec_m, rec_o, Path(tmp) / f"r{rep}", flush_interval_s=1.0) as att:
                    assert (att._native is not None) == native, "native hooks not as asked"
                    run_steps(rec_m, rec_o, x, 3, microbatches)  # DDP's step 0 is not recorded
                    r = timed_block(rec_m, rec_o, x, steps, microbatches)
                a2 = timed_block(bare_m, bare_o, x, steps, microbatches)
                # ops per step: the rows it recorded (DDP without no_sync: a bucket all-reduce
                # per microbatch, its backward split where the bucket went out)
                recorded = read_run(Path(tmp) / f"r{rep}").ops["step"]
                rows.append(len(recorded) / len(set(recorded.tolist())))
                ops = rows[-1]
                for i, k in enumerate(("cpu", "wall")):
                    diff[k].append((r[i] - (a[i] + a2[i]) / 2) / ops)
                    aa[k].append(abs(a2[i] - a[i]) / ops)
            bare_cpu = a[0]
    finally:
        os.environ.pop(NATIVE_ENV, None)
    return {"ops": statistics.median(rows), "bare_step_cpu_ns": bare_cpu,
            "cpu_ci_ns": median_interval(diff["cpu"]),
            **{f"{k}_ns": statistics.median(v) for k, v in diff.items()},
            **{f"{k}_aa_ns": statistics.median(v) for k, v in aa.items()}}


def median_interval(values: list[float], draws: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of the median (how far the noise leaves the estimate)."""
    import numpy as np

    rng = np.random.default_rng(0)
    v = np.asarray(values)
    meds = np.median(rng.choice(v, size=(draws, len(v))), axis=1)
    return float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def verdict(interval: tuple[float, float], goal: float) -> str:
    """met when the whole interval is within the goal, MISSED when none of it is."""
    low, high = interval
    return "met" if high <= goal else "MISSED" if low > goal else "not resolved (interval spans it)"


def plain(d_in: int, d_hidden: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d_in, d_hidden), nn.GELU(), nn.Linear(d_hidden, d_in))
    return model, torch.optim.SGD(model.parameters(), lr=1e-4)


def big_step_overhead(steps: int, rounds: int) -> tuple[list[float], list[float], float, float]:
    """(per-round overheads, control |ratio − 1| values, median step s, recorded rows per
    recorded step) on a ≥100 ms step."""
    model, opt = ddp(1024, 4096)
    x = torch.randn(256, 1024)
    microbatches = 2
    run_steps(model, opt, x, 2, microbatches)
    overheads, control_spread, step_s, rows_per_step = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(rounds):
            ratios = {}
            for recorded in ((True, False) if k % 2 == 0 else (False, True)):
                if recorded:
                    # a fresh DDP replica per recorded round (DDP takes one comm hook)
                    rmodel, ropt = ddp(1024, 4096)
                    with attach(rmodel, ropt, Path(tmp) / f"big{k}", sample_every=2):
                        run_steps(rmodel, ropt, x, 1, microbatches)  # step 0: not recorded
                        t = run_steps(rmodel, ropt, x, steps, microbatches)  # even recorded
                    t = t[1:]  # start at step 2 (even)
                    del rmodel, ropt
                    ops = read_run(Path(tmp) / f"big{k}").ops["step"]
                    rows_per_step.append(len(ops) / len(set(ops.tolist())))
                else:
                    t = run_steps(model, opt, x, steps, microbatches)[1:]
                pairs = [t[i] / t[i + 1] for i in range(0, len(t) - 1, 2)]
                ratios[recorded] = statistics.median(pairs)
                step_s.append(statistics.median(t))
            overheads.append(ratios[True] / ratios[False] - 1)
            control_spread.append(abs(ratios[False] - 1))
    return overheads, control_spread, statistics.median(step_s), statistics.median(rows_per_step)


# ---- model parallelism (issue 30): the TP and MoE examples under torchrun -------------------

PARALLEL = {  # example → its flags (small: the hooks' cost, not the model's, is measured)
    "tp": ("train_tp", ["--tp", "2", "--layers", "2", "--d-model", "32", "--seq", "8",
                        "--batch", "2", "--vocab", "64"]),
    "moe": ("train_moe", ["--layers", "2", "--d-model", "32", "--d-expert", "64", "--seq", "8",
                          "--batch", "2", "--vocab", "64", "--hot-expert", "1",
                          "--routing-skew", "0.3"]),
    "3d": ("train_tp", ["--tp", "2", "--pp", "2", "--microbatches", "4", "--layers", "2",
                        "--d-model", "32", "--seq", "8", "--batch", "2", "--vocab", "64"]),
}
# dp 2 × tp 2 × pp 2 on 8 ranks: the same flags, FSDP2's gathers and reduce-scatters recorded too
PARALLEL["3d-dp2"] = PARALLEL["3d"]
NPROC = {"tp": 2, "moe": 2, "3d": 4, "3d-dp2": 8}


def parallel_worker(kind: str, reps: int, steps: int, workdir: Path) -> None:
    """One rank of the A B A' measurement on an example's model (run under torchrun)."""
    import importlib

    sys.path.insert(0, str(REPO / "examples"))
    name, flags = PARALLEL[kind]
    ex = importlib.import_module(name)
    args = ex.parse_args(flags)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    schedule = pipe = None
    if kind == "tp":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        model, dp_rank = ex.parallelize(ex.Transformer(args), mesh), mesh["dp"].get_local_rank()
    elif kind.startswith("3d"):  # 3d, 3d-dp2
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        mesh = init_device_mesh("cpu", (args.pp, world // (args.pp * args.tp), args.tp),
                                mesh_dim_names=("pp", "dp", "tp"))
        stage = mesh["pp"].get_local_rank()
        model = ex.parallelize(ex.pipeline_split(ex.Transformer(args), stage, args.pp), mesh,
                               pipelined=True)
        dp_rank = mesh["dp"].get_local_rank()
        pipe = PipelineStage(model, stage, args.pp, torch.device("cpu"),
                             group=mesh["pp"].get_group())
        import torch.nn.functional as F

        schedule = Schedule1F1B(pipe, args.microbatches, loss_fn=lambda lg, t: F.cross_entropy(
            lg.flatten(0, 1), t.flatten()))
    else:
        from torch.distributed.fsdp import fully_shard

        model, dp_rank = ex.Transformer(args, world, rank), rank
        model = fully_shard(model, ignored_params=set(model.expert_parameters()))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    import torch.nn.functional as F

    def train_step(step: int) -> None:
        if schedule is not None:  # 3-D: this rank's stage in the 1F1B schedule
            tokens = torch.cat([ex.batch(args, step, dp_rank, mb)
                                for mb in range(args.microbatches)])
            schedule.step(*((tokens[:, :-1],) if pipe.is_first else ()),
                          target=tokens[:, 1:] if pipe.is_last else None)
        else:
            tokens = ex.batch(args, step, dp_rank, 0)
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()

    def block(n: int) -> tuple[float, float]:
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        for step in range(n):
            train_step(step)
        return (time.thread_time_ns() - c0) / n, (time.perf_counter_ns() - w0) / n

    block(5)  # warm-up
    out = []
    # the runs go to the launcher's folder (one path for every rank)
    for rep in range(reps):
        a = block(steps)
        where = workdir / f"{kind}{rep}"
        with attach(schedule if schedule is not None else model, opt, where,
                    flush_interval_s=1.0):
            block(1)
            b = block(steps)
        a2 = block(steps)
        dist.barrier()
        ops = read_run(where).ops
        mine = ops["step"][ops["rank"] == rank]
        rows = len(mine) / len(set(mine.tolist()))
        out.append((a, b, a2, rows))
    every: list = [None] * world
    dist.all_gather_object(every, out)
    if rank == 0:
        print("RESULT " + repr(every), flush=True)
    dist.destroy_process_group()


def parallel_costs(reps: int, steps: int, only: list[str]) -> list:
    """Launch each example's measurement under torchrun, print its figures and return them."""
    import ast
    import shutil
    import socket
    import subprocess

    figures = []
    for kind in only:
        workdir = tempfile.mkdtemp(prefix=f"attach-{kind}-")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={NPROC[kind]}", "--rdzv-endpoint", f"127.0.0.1:{port}", __file__,
               "--worker", kind, "--reps", str(reps), "--steps", str(steps),
               "--workdir", workdir]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        shutil.rmtree(workdir, ignore_errors=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not line:
            sys.exit(f"{kind}: torchrun failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        every = ast.literal_eval(line[0][len("RESULT "):])
        cost = {"cpu": [], "wall": []}
        bare = {"cpu": [], "wall": []}
        rec = {"cpu": [], "wall": []}
        rows = []
        for per_rank in every:
            for a, b, a2, n in per_rank:
                rows.append(n)
                for i, k in enumerate(("cpu", "wall")):
                    base = (a[i] + a2[i]) / 2
                    cost[k].append((b[i] - base) / n)
                    bare[k].append(base)
                    rec[k].append(b[i])
        med = {k: statistics.median(v) for k, v in cost.items()}
        ci = median_interval(cost["cpu"])
        print(f"{kind} ({PARALLEL[kind][0]}.py, {NPROC[kind]} ranks): "
              f"{statistics.median(rows):.0f} rows per "
              f"recorded step; step bare {statistics.median(bare['cpu']) / 1e6:.2f} ms CPU / "
              f"{statistics.median(bare['wall']) / 1e6:.2f} ms wall, attached "
              f"{statistics.median(rec['cpu']) / 1e6:.2f} ms CPU / "
              f"{statistics.median(rec['wall']) / 1e6:.2f} ms wall (ratio "
              f"{statistics.median(rec['cpu']) / statistics.median(bare['cpu']):.3f} CPU, "
              f"{statistics.median(rec['wall']) / statistics.median(bare['wall']):.3f} wall); "
              f"attach adds {med['cpu'] / 1e3:.1f} µs CPU per op (median of the repetitions' "
              f"differences, 95% interval {ci[0] / 1e3:.1f}-{ci[1] / 1e3:.1f}; from the medians "
              f"above {(statistics.median(rec['cpu']) - statistics.median(bare['cpu'])) / statistics.median(rows) / 1e3:.1f}), "
              f"{med['wall'] / 1e3:.1f} µs wall per op", flush=True)
        figures.append(Figure(
            name=f"attach cost per recorded op, {kind} ({PARALLEL[kind][0]}.py, {NPROC[kind]} "
                 f"gloo ranks, {statistics.median(rows):.0f} rows per step), thread CPU",
            value=f"{med['cpu'] / 1e3:.1f} µs (95% interval {ci[0] / 1e3:.1f}-{ci[1] / 1e3:.1f})",
            anchor="bare steps of the same model in the same process (A B A')",
            note=f"wall {med['wall'] / 1e3:.1f} µs per op; step CPU ratio attached/bare "
                 f"{statistics.median(rec['cpu']) / statistics.median(bare['cpu']):.3f}"))
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=30, help="A B A' repetitions per tiny model")
    p.add_argument("--steps", type=int, default=40, help="steps per big-step run")
    p.add_argument("--rounds", type=int, default=3, help="recorded/control big-step rounds")
    p.add_argument("--parallel", action="store_true",
                   help="measure the TP, MoE and 3-D examples instead (part 3)")
    p.add_argument("--only", default=",".join(PARALLEL),
                   help="with --parallel: which of them (comma separated: tp, moe, 3d)")
    p.add_argument("--worker", choices=sorted(PARALLEL), help=argparse.SUPPRESS)
    p.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return parallel_worker(args.worker, args.reps, args.steps, args.workdir)
    if args.parallel:
        only = [k.strip() for k in args.only.split(",") if k.strip()]
        bad = [k for k in only if k not in PARALLEL]
        if bad:
            sys.exit(f"--only: unknown case {bad[0]!r}; expected among {', '.join(PARALLEL)}")
        figures = parallel_costs(args.reps, args.steps, only)
        write(Run(benchmark="attach cost per recorded op on model-parallel examples",
                  issue="30", figures=figures,
                  command=f".venv/bin/python benchmarks/record_attach_overhead.py --parallel --reps "
                          f"{args.reps} --steps {args.steps} --only {','.join(only)}"),
              # one file per set of cases: a run of some cases keeps the others' figures
              name="record_attach_overhead_parallel" + (
                  "" if set(only) == set(PARALLEL) else "_" + "_".join(only)))
        return None
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        unit = null_context_ns()
        print(f"unit: an empty `with` block costs {unit:.0f} ns of thread CPU here", flush=True)
        if native.load() is None:
            sys.exit(f"the native hooks are not built ({native.last_error()})")
        figures = []
        # Python hooks and native hooks side by side, in this order, in one process
        for wrap, hooks in [(w, h) for w in (False, True) for h in ("python", "native")]:
            c = per_op_cost(wrap, args.reps, native=hooks == "native")
            if hooks == "native":
                cost = c
            name = ("DDP (comm hook)" if wrap else "plain module") + f", {hooks} hooks"
            print(f"per recorded op, {name}: {c['ops']:.0f} ops/step, bare step {c['bare_step_cpu_ns'] / 1e3:.0f} "
                  f"µs CPU; attach adds {c['cpu_ns'] / 1e3:.2f} µs CPU per op (95% interval "
                  f"{c['cpu_ci_ns'][0] / 1e3:.2f}-{c['cpu_ci_ns'][1] / 1e3:.2f}; A/A control "
                  f"{c['cpu_aa_ns'] / 1e3:.2f}) = {c['cpu_ns'] / unit:.0f}× an empty with-block; wall "
                  f"{c['wall_ns'] / 1e3:.2f} µs per op (A/A {c['wall_aa_ns'] / 1e3:.2f}); goal <= 2 µs: "
                  f"{verdict(c['cpu_ci_ns'], 2000)} (CPU)", flush=True)
            figures.append(Figure(
                name=f"attach cost per recorded op, {name}, thread CPU",
                value=f"{c['cpu_ns'] / 1e3:.2f} µs (95% interval {c['cpu_ci_ns'][0] / 1e3:.2f}-"
                      f"{c['cpu_ci_ns'][1] / 1e3:.2f})",
                # the goal is the native hooks' (the default where they build); the Python
                # hooks are the fallback, measured beside them
                goal="<= 2 µs" if hooks == "native" else "",
                met=None if hooks != "native" or verdict(c['cpu_ci_ns'], 2000) not in
                ("met", "MISSED") else verdict(c['cpu_ci_ns'], 2000) == "met",
                anchor="bare steps in the same process (A B A')",
                note=f"A/A control {c['cpu_aa_ns'] / 1e3:.2f} µs; wall {c['wall_ns'] / 1e3:.2f} µs; "
                     f"an empty `with` block: {unit:.0f} ns of thread CPU in this run"))
        over, spread, step, rows = big_step_overhead(args.steps, args.rounds)
        med, noise = statistics.median(over), statistics.median(spread)
        # The same cost from the per-op figure: rows recorded per big step (read back from the
        # run) × the DDP per-op wall cost above, over the step — resolvable where the direct
        # ratio is not (its control spread is the machine's noise, not the recorder's cost).
        bound = rows * max(cost["wall_ns"], cost["cpu_ns"]) / 1e9 / step
        print(f"big step ({step * 1e3:.0f} ms): {rows:.0f} rows per recorded step × "
              f"{max(cost['wall_ns'], cost['cpu_ns']) / 1e3:.1f} µs per op = "
              f"{100 * bound:.2f}% of the step (goal <= 1%: {'met' if bound <= 0.01 else 'MISSED'})",
              flush=True)
        print(f"big step ({step * 1e3:.0f} ms): overhead per round "
              f"{', '.join(f'{100 * o:+.2f}%' for o in over)}; median {100 * med:+.2f}%; control "
              f"even/odd spread {100 * noise:.2f}% (goal <= 1%: "
              f"{'met' if med <= 0.01 and noise < 0.01 else 'not resolved' if noise >= 0.01 else 'MISSED'})",
              flush=True)
        figures.append(Figure(name=f"attach cost on a {step * 1e3:.0f} ms DDP step (rows × per-op cost)",
                              value=f"{100 * bound:.2f}%", goal="<= 1%", met=bound <= 0.01))
        figures.append(Figure(name=f"attach cost on a {step * 1e3:.0f} ms DDP step (measured)",
                              value=f"{100 * med:+.2f}%", goal="<= 1%",
                              met=None if noise >= 0.01 else med <= 0.01,
                              note=f"control even/odd spread {100 * noise:.2f}%"))
        write(Run(benchmark="attach cost per recorded op and on a big step", issue="15",
                  command=f".venv/bin/python benchmarks/record_attach_overhead.py --reps {args.reps} "
                          f"--steps {args.steps} --rounds {args.rounds}", figures=figures))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
