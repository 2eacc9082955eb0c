"""StragglAR vs the library AllReduce (gloo, loopback) with a late rank, next to the α–β model.

Driver:  .venv/bin/python benchmarks/stragglar_allreduce.py [--nprocs 4 8] [--sizes-mb 16 64 256]
It launches itself under torchrun once per world size. For D in {0, 0.5, 1, 2} x T_allreduce
it alternates the two algorithms in the same run; time = from the common start (after a
barrier) until the slowest rank is done.

Under load (a shared machine) T itself drifts, so by default (--paired) every repetition
re-measures T (a library AllReduce without delay) right before the pair it sets D for, and the
speedup is the median of the per-repetition ratios library/StragglAR (with their spread), not
a ratio of medians taken minutes apart. The 1-minute load average is printed with each row.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

DELAYS = (0.0, 0.5, 1.0, 2.0)


def worker(sizes_mb: list[int], reps: int, modes: list[str], delays=DELAYS, paired: bool = True) -> None:
    import torch
    import torch.distributed as dist

    from stragglers.collectives.calibrate import measure_link
    from stragglers.collectives.cost_model import ring_time, stragglar_time
    from stragglers.collectives.executor import stragglar_all_reduce

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    straggler = n - 1
    link1 = measure_link(sizes=(8, 1 << 16, 1 << 20, 1 << 23), reps=3)
    linkn = measure_link(sizes=(8, 1 << 16, 1 << 20, 1 << 23), reps=3, all_pairs=True)
    if rank == 0:
        print(f"# n={n} alpha={link1.alpha * 1e6:.0f}us 1/beta(one pair)={1 / link1.beta / 2**20:.0f}MiB/s "
              f"1/beta({n // 2} pairs at once)={1 / linkn.beta / 2**20:.0f}MiB/s", flush=True)

    def timed(fn, x, delay):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == straggler and delay > 0:
            time.sleep(delay)
        fn(x)
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        x.div_(n)  # keep values finite across repetitions (outside the timed region)
        return t.item()

    library = lambda x: dist.all_reduce(x)  # noqa: E731
    # "<phase2>" runs without the up-front agreement check (as the DDP hook does),
    # "<phase2>+check" with it (the default of stragglar_all_reduce)
    algos = {m: (lambda x, m=m: stragglar_all_reduce(x, straggler, phase2=m.split("+")[0],
                                                     check=m.endswith("+check")))
             for m in modes}
    for mb in sizes_mb:
        numel = mb * 2**20 // 4
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        check = x[:10007].clone()
        ref = check.clone()
        dist.all_reduce(ref)
        stragglar_all_reduce(check, straggler)  # also creates the ready sub-groups once
        assert torch.allclose(check, ref, rtol=1e-4, atol=1e-4)
        timed(library, x, 0.0)  # warm-up
        for fn in algos.values():
            timed(fn, x, 0.0)
        t_ar = statistics.median(timed(library, x, 0.0) for _ in range(reps))
        for factor in delays:
            lib, st = [], {m: [] for m in modes}
            ratios = {m: [] for m in modes}
            used_delays = []
            for _ in range(reps):
                if paired:  # T now, under the load of now
                    t_ar = timed(library, x, 0.0)
                delay = factor * t_ar
                used_delays.append(delay)
                lib.append(timed(library, x, delay))
                for m, fn in algos.items():
                    st[m].append(timed(fn, x, delay))
                    ratios[m].append(lib[-1] / st[m][-1])
            delay = statistics.median(used_delays)
            lib_t = statistics.median(lib)
            st_t = {m: statistics.median(v) for m, v in st.items()}
            size = numel * 4
            # model with the contended β (all pairs at once), which is what both algorithms see
            m_ring = ring_time(n, size, linkn, delay) if rank == 0 else 0
            m_st = stragglar_time(n, size, linkn, delay) if rank == 0 else 0
            # "shared bus" view of a 2-core host: every byte costs the same whatever the link,
            # at the aggregate rate measured with all pairs exchanging at once (n / beta_n)
            agg = n / linkn.beta if rank == 0 else 1.0
            b_ring = delay + 2 * (n - 1) * size / agg
            b_st = max(delay, (n - 2) * size / agg) + n * size / agg
            if rank == 0:
                cols = " ".join(
                    f"{m}_s={t:.3f} speedup_{m}={statistics.median(ratios[m]):.3f} "
                    f"[{min(ratios[m]):.2f}-{max(ratios[m]):.2f}] wins_{m}={sum(r > 1 for r in ratios[m])}/{reps}"
                    for m, t in st_t.items())
                print(f"ROW n={n} size_mb={mb} D/T={factor:.1f} D_s={delay:.3f} library_s={lib_t:.3f} "
                      f"{cols} model_ring_s={m_ring:.3f} model_stragglar_s={m_st:.3f} "
                      f"model_speedup={m_ring / m_st:.3f} bus_ring_s={b_ring:.3f} bus_stragglar_s={b_st:.3f} "
                      f"bus_speedup={b_ring / b_st:.3f} load1={os.getloadavg()[0]:.1f}", flush=True)
        del x
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nprocs", type=int, nargs="+", default=[4, 8])
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=["dataflow"],
                   choices=["dataflow", "lockstep", "dataflow+check", "lockstep+check"],
                   help="StragglAR phase-2 modes to time next to the library AllReduce "
                        "(+check: with the up-front agreement check)")
    p.add_argument("--delays", type=float, nargs="+", default=list(DELAYS),
                   help="straggler delays as multiples of T_allreduce")
    p.add_argument("--no-paired", dest="paired", action="store_false",
                   help="one T estimate up front instead of one per repetition")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.sizes_mb, args.reps, args.modes, args.delays, args.paired)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    rows: list[str] = []
    for n in args.nprocs:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
               str(Path(__file__).resolve()), "--worker", "--reps", str(args.reps), "--modes", *args.modes,
               "--sizes-mb", *map(str, args.sizes_mb), "--delays", *map(str, args.delays)]
        if not args.paired:
            cmd.append("--no-paired")
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("ROW", "#"))]
        print("\n".join(lines), flush=True)
        if out.returncode:
            print(out.stderr[-3000:], file=sys.stderr)
            sys.exit(out.returncode)
        rows += [ln for ln in lines if ln.startswith("ROW")]
    write_results(rows, args)


def write_results(rows: list[str], args: argparse.Namespace) -> None:
    """The n = 8, D = T speed-ups against the goal (≥ 1.15×), every row as the detail table."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results import Figure, Run, write

    table, figures = [], []
    for line in rows:
        kv = dict(re.findall(r"(\S+?)=(\S+)", line))
        spread = {m: r for m, r in re.findall(r"speedup_(\S+?)=\S+ (\[\S+\])", line)}
        row = {"n": kv["n"], "MB": kv["size_mb"], "D/T": kv["D/T"], "library s": kv["library_s"]}
        for mode in args.modes:
            row[f"{mode}: speed-up [range], wins"] = (f"{float(kv[f'speedup_{mode}']):.2f}× "
                                                      f"{spread.get(mode, '')}, {kv[f'wins_{mode}']}")
        row["α–β model"] = f"{float(kv['model_speedup']):.2f}×"
        table.append(row)
        if kv["n"] == "8" and float(kv["D/T"]) == 1.0:
            mode = args.modes[0]
            speedup = float(kv[f"speedup_{mode}"])
            figures.append(Figure(name=f"n = 8, D = T, {kv['size_mb']} MB, {mode}: median speed-up "
                                       "[range], wins",
                                  value=f"{speedup:.2f}× {spread.get(mode, '')}, {kv[f'wins_{mode}']}",
                                  anchor="`dist.all_reduce`, alternated in the same run",
                                  goal="≥ 1.15×", met=speedup >= 1.15))
    command = ".venv/bin/python benchmarks/stragglar_allreduce.py " + " ".join(
        [f"--nprocs {' '.join(map(str, args.nprocs))}",
         f"--sizes-mb {' '.join(map(str, args.sizes_mb))}",
         f"--delays {' '.join(f'{d:g}' for d in args.delays)}", f"--reps {args.reps}",
         f"--modes {' '.join(args.modes)}"] + ([] if args.paired else ["--no-paired"]))
    write(Run(benchmark="StragglAR AllReduce vs the library AllReduce", issue="4, 13",
              command=command, figures=figures or [Figure(name="rows", value=str(len(rows)))],
              table=table))


if __name__ == "__main__":
    main()
