"""DDP training step time with a persistent straggler: plain DDP vs the StragglAR hook
(persistent and eager mode), interleaved step by step in one run (gloo, loopback).

Driver:  .venv/bin/python benchmarks/stragglar_ddp.py [--nproc 4] [--params-m 8] [--steps 12]
Rank n-1 sleeps D = delay_factor x T_allreduce(gradients) before each backward. Each step runs
plain DDP and both hooks one after the other; the speed-up is the median over steps of the
step's plain / hook ratio (the same machine load on both sides of each ratio).
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


def worker(params_m: float, steps: int, delay_factor: float, warmup: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from stragglers.collectives.ddp_hook import StragglarHookState, stragglar_hook

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    width = int((params_m * 1e6 / 4) ** 0.5)

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])

    grads = sum(p.numel() for p in make().parameters())
    buf = torch.randn(grads)
    dist.all_reduce(buf)
    t0 = time.perf_counter()
    for _ in range(3):
        dist.all_reduce(buf)
    t_ar = torch.tensor([(time.perf_counter() - t0) / 3])
    dist.all_reduce(t_ar, op=dist.ReduceOp.MAX)
    delay = delay_factor * t_ar.item()
    cap = float(os.environ.get("BUCKET_CAP_MB", "25"))
    models = {"plain": DDP(make(), bucket_cap_mb=cap)}
    states = {}
    for mode in ("persistent", "eager"):
        m = DDP(make(), bucket_cap_mb=cap)
        states[mode] = StragglarHookState(mode=mode, window=4, threshold=0.6)
        m.register_comm_hook(states[mode], stragglar_hook)
        models[mode] = m
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    x = torch.randn(32, width)
    times = {k: [] for k in models}
    for step in range(warmup + steps):
        for name, model in models.items():
            dist.barrier()
            t0 = time.perf_counter()
            loss = model(x).square().mean()
            if rank == n - 1:
                time.sleep(delay)
            opts[name].zero_grad()
            loss.backward()
            opts[name].step()
            t = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if step >= warmup:
                times[name].append(t.item())
    for st in states.values():
        st.close()
    if rank == 0:
        base = statistics.median(times["plain"])
        print(f"# n={n} params={grads / 1e6:.1f}M grads={grads * 4 / 2**20:.0f}MiB T_allreduce={t_ar.item():.3f}s "
              f"D={delay:.3f}s steps={steps}", flush=True)
        for name, ts in times.items():
            med = statistics.median(ts)
            used = ""
            if name in states:
                ds = states[name].decisions[-steps * 4:]
                hits = sum(d.straggler == n - 1 for d in ds)
                used = f" calls_with_stragglar(rank {n - 1})={hits}/{len(ds)}"
            # the models run one after the other in every step, under the same machine load:
            # the median of the per-step ratios is steadier than a ratio of medians
            paired = statistics.median(p / t for p, t in zip(times["plain"], ts))
            print(f"ROW mode={name} median_step_s={med:.3f} speedup_vs_plain={paired:.3f} "
                  f"ratio_of_medians={base / med:.3f}{used}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--params-m", type=float, default=8.0, help="model size in millions of parameters")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--delay-factor", type=float, default=1.0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.params_m, a.steps, a.delay_factor, a.warmup)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}",
           str(Path(__file__).resolve()), "--worker", "--params-m", str(a.params_m), "--steps", str(a.steps),
           "--warmup", str(a.warmup), "--delay-factor", str(a.delay_factor)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    print("\n".join(ln for ln in out.stdout.splitlines() if ln.startswith(("ROW", "#"))), flush=True)
    if out.returncode:
        print(out.stderr[-3000:], file=sys.stderr)
        sys.exit(out.returncode)
    write_results(out.stdout.splitlines(), a)


def write_results(lines: list[str], a: argparse.Namespace) -> None:
    """The hook's median step against plain DDP's, per mode, as this run measured them."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results import Figure, Run, write

    rows = [dict(re.findall(r"(\w+(?:\(rank \d+\))?)=(\S+)", ln))
            for ln in lines if ln.startswith("ROW")]
    plain = next(r for r in rows if r["mode"] == "plain")
    t_ar = float(next(re.search(r"T_allreduce=([\d.]+)s", ln).group(1)  # type: ignore[union-attr]
                      for ln in lines if ln.startswith("#")))
    hooks = [r for r in rows if r["mode"] != "plain"]
    value = " / ".join(f"{float(r['speedup_vs_plain']):.2f}×" for r in hooks)
    steps = " / ".join(f"{r['median_step_s']} s" for r in hooks)
    write(Run(benchmark="StragglAR as a DDP communication hook", issue="4",
              command=f".venv/bin/python benchmarks/stragglar_ddp.py --nproc {a.nproc} --params-m "
                      f"{a.params_m:g} --steps {a.steps} --warmup {a.warmup}",
              figures=[Figure(name=f"n = {a.nproc}, median step, "
                                   + " / ".join(f"{r['mode']} hook" for r in hooks),
                              value=f"{value} ({steps})",
                              anchor=f"plain DDP {plain['median_step_s']} s, interleaved step by "
                                     "step (the speed-up: median of the per-step ratios)",
                              note=f"the hook can save only on the step's communication: about "
                                   f"0.2 × T_allreduce = {0.2 * t_ar:.2f} s of the "
                                   f"{plain['median_step_s']} s step; {a.nproc} ranks share the "
                                   f"machine's {os.cpu_count()} cores")],
              table=[{k: v for k, v in r.items()} for r in rows]))


if __name__ == "__main__":
    main()
