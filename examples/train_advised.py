"""Data-parallel training that finds its straggler, asks `advise` what would fix it, applies the
best runtime remedy and checks the prediction against the next window.

    python -m torch.distributed.run --standalone --nproc-per-node 4 examples/train_advised.py \
        --slow-rank 3 --slow-factor 2.5 --steps 48

Every rank times its steps (host work, forward, backward up to the DDP hook, the gradient sync,
the optimizer, GC pauses) and all-gathers the timings, so every rank feeds the same numbers to
the same `AdvisePolicy` and takes the same decisions. Each window the policy replays the window
with each remedy's modified durations (`stragglers.advice.advise`), applies the best one that
can change at runtime — the DDP hook switched to StragglAR, batches re-split (AntDT-DD) or
planned GC — and keeps it only if the next window is faster; otherwise it rolls it back.

Injections (off by default): --slow-rank/--slow-factor (a slow device: its per-sample device
time, slept, is --slow-factor × longer), --stall-rank/--stall-s (host-side work before each
forward, e.g. a slow data loader), --gc-garbage (cyclic garbage each step over a live heap of
--gc-heap-mb, so automatic collections pause the ranks at different steps).
Fixed remedies without the controller (for benchmarks): --stragglar, --batch-sizes, --planned-gc.
With --monitor-url the windows are the live monitor's: every rank uploads its rows of the step
timings as parts of job --monitor-job, rank 0 follows the job's analysed windows over HTTP,
prices each (`AdvisePolicy.observe_window`) and broadcasts its decisions, so every rank switches
at the same step (start one with `stragglers monitor serve --db monitor.db`).

Read top to bottom: arguments → data and model → one step → the loop → the report.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from stragglers.adapt.heterogeneity import SimulatedDevice
from stragglers.advice.act import APPLY, AdvisePolicy, Forced, GCParams, SplitParams
from stragglers.advice.hooks import SwitchableCommHook, switchable_hook
from stragglers.advice.live import MonitorWindows, TimingPublisher, window_of
from stragglers.advice.window import ROW_WIDTH, StepTiming, window_step_time, window_trace
from stragglers.mitigate import PlannedGC
from stragglers.serving import read_token_file

from launch import exit_without_finalizing, require_torchrun  # examples/launch.py (on sys.path)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--width", type=int, default=512, help="MLP width (gradients ≈ 4·layers·width² B)")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--sample-time", type=float, default=0.002, help="device seconds per sample")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    # the controller
    p.add_argument("--no-act", action="store_true", help="only train (no advise/act loop)")
    p.add_argument("--window", type=int, default=8, help="steps per window")
    p.add_argument("--settle", type=int, default=2, help="steps ignored after a switch")
    p.add_argument("--force", default="", help="apply this remedy at the first window whatever "
                   "the advice, e.g. planned-gc:1 or stragglar (tests, demos)")
    p.add_argument("--calibrate", action="store_true", help="measure each rank's compute at "
                   "three batch sizes before training and a full collection on every rank at "
                   "once after it (advise prices DD and planned GC with them)")
    p.add_argument("--monitor-url", default="", help="take the windows from this live monitor")
    p.add_argument("--monitor-job", default="train_advised", help="the job's name on the monitor")
    p.add_argument("--monitor-token-file", type=Path, default=None, help="bearer token for uploads")
    # injections
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-factor", type=float, default=1.0)
    p.add_argument("--stall-rank", type=int, default=-1)
    p.add_argument("--stall-s", type=float, default=0.0)
    p.add_argument("--gc-heap-mb", type=float, default=0.0, help="long-lived GC-tracked objects")
    p.add_argument("--gc-garbage", type=float, default=0.0, help="MB of cyclic garbage per step")
    # fixed remedies (no controller)
    p.add_argument("--stragglar", action="store_true", help="StragglAR hook from step 0")
    p.add_argument("--batch-sizes", default="", help="per-rank batches, e.g. 18,18,18,10")
    p.add_argument("--planned-gc", type=int, default=0, metavar="N", help="PlannedGC(every=N)")
    # outputs
    p.add_argument("--summary", type=Path, default=None, help="rank 0 writes step times and decisions")
    p.add_argument("--trace-dir", type=Path, default=None, help="rank 0 writes the timings as a run")
    p.add_argument("--params-out", type=Path, default=None, help="rank 0 writes final parameters (.npy)")
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the means")
    return p.parse_args(argv)


# ---- data and model -------------------------------------------------------------------------

def global_batch(step: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch (identical on every rank); each rank takes its slice of it."""
    g = torch.Generator().manual_seed(args.seed * 100_003 + step)
    x = torch.randn(args.global_batch, args.width, generator=g)
    teacher = torch.Generator().manual_seed(args.seed + 7)
    w = torch.randn(args.width, 1, generator=teacher) / args.width ** 0.5
    return x, torch.tanh(x @ w)


def make_model(args) -> nn.Module:
    torch.manual_seed(args.seed)
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(args.width, 1))


def split(total: int, n: int) -> list[int]:
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


class GCTimer:
    """The garbage-collection pauses of this process, as (start, end) intervals (gc.callbacks)."""

    def __init__(self):
        self.pauses: list[tuple[float, float]] = []
        self._t0 = None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.pauses.append((self._t0, time.perf_counter()))
            self._t0 = None

    def within(self, lo: float, hi: float) -> float:
        """Seconds of pause inside [lo, hi]."""
        return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in self.pauses)

    def clear(self) -> None:
        self.pauses.clear()


def make_cyclic_garbage(megabytes: float, rng: np.random.Generator) -> list:
    """Reference cycles (~200 B each) that only the cyclic collector frees."""
    keep = []
    for _ in range(int(megabytes * 1e6 / 200 * rng.uniform(0.5, 1.5))):
        a: list = []
        a.append([a])
        keep.append(a)
    return keep


def calibrate(ddp, device, args, batch: int, n: int, group) -> dict:
    """The calibration step before training: every rank's compute curve t_i(b) = a_i + c_i·b.

    DD moves samples between ranks, so it needs t_i(b), not t_i(b)/b: each rank times its
    forward + device time + backward (no gradient sync: DDP's no_sync) at b/2, b and 3b/2
    samples, all ranks at once (the contention training has), three times, and fits a line.
    """
    x, _ = global_batch(0, args)
    sizes = sorted({max(1, batch // 2), batch, min(args.global_batch, batch + batch // 2)})
    points = []
    for _ in range(3):
        for b in sizes:
            dist.barrier(group=group)
            t0 = time.perf_counter()
            with ddp.no_sync():
                out = ddp(x[:b]).pow(2).sum()
                device.run(b)
                out.backward()
            points.append((b, time.perf_counter() - t0))
    ddp.zero_grad(set_to_none=True)
    bs, ts = np.array(points, dtype=float).T
    per_sample, fixed = np.polyfit(bs, ts, 1)
    rows = gather_floats([fixed, max(per_sample, 1e-9)], n, group)
    return {"compute_curves": [(r[0], r[1]) for r in rows]}


def calibrate_gc(n: int, group) -> float:
    """The calibration of planned GC, after the steps: a full collection on every rank at once.

    On shared cores (or memory bandwidth) that is not one collection alone, so it is timed as
    planned GC runs it, all ranks after a barrier; the step waits for the last rank. It runs
    after the measured steps because a full collection promotes the live heap to the oldest
    generation, which changes the very automatic collections the steps are measuring.
    """
    pauses = []
    for _ in range(2):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        gc.collect()
        pauses.append(time.perf_counter() - t0)
    return max(r[0] for r in gather_floats([float(np.mean(pauses))], n, group))


def gather_floats(values: list[float], n: int, group) -> list[list[float]]:
    """Every rank's `values`, on every rank."""
    rows = [torch.zeros(len(values), dtype=torch.float64) for _ in range(n)]
    dist.all_gather(rows, torch.tensor(values, dtype=torch.float64), group=group)
    return [[float(v) for v in r] for r in rows]


# ---- the run --------------------------------------------------------------------------------

def main(argv=None) -> None:
    args = parse_args(argv)
    require_torchrun()
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    timing_group = dist.new_group(list(range(n)))  # the controller's all_gather, apart from DDP's

    model = make_model(args)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=10_000)  # one bucket
    hook = SwitchableCommHook()
    ddp.register_comm_hook(hook, switchable_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    speeds = [1.0 / args.slow_factor if r == args.slow_rank else 1.0 for r in range(n)]
    device = SimulatedDevice(rank, speeds, args.sample_time)
    gc_timer = GCTimer()
    live_heap = [[i, None] for i in range(int(args.gc_heap_mb * 1e6 / 120))]  # noqa: F841
    rng = np.random.default_rng([args.seed, rank])

    batches = [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else \
        split(args.global_batch, n)
    if len(batches) != n or sum(batches) != args.global_batch:
        raise SystemExit(f"--batch-sizes {args.batch_sizes}: expected {n} values summing to "
                         f"--global-batch {args.global_batch}")
    calibration = calibrate(ddp, device, args, batches[rank], n, timing_group) \
        if args.calibrate else None
    if rank == 0 and calibration:
        print(f"calibration: {json.dumps(calibration)}", flush=True)
    planned = PlannedGC(args.planned_gc).start() if args.planned_gc else None
    if args.stragglar:
        hook.use_stragglar()
    policy = None
    if not args.no_act:
        force = None
        if args.force:
            name, _, value = args.force.partition(":")
            force = Forced(name, every=int(value) if name == "planned-gc" and value else None)
        policy = AdvisePolicy(n, args.global_batch, window=args.window, settle=args.settle,
                              force=force, remaining_steps=args.steps, warmup=args.skip,
                              **(calibration or {}))

    publisher = feed = None
    if args.monitor_url:
        token = read_token_file(args.monitor_token_file, "--monitor-token-file")
        publisher = TimingPublisher(args.monitor_url, args.monitor_job, rank, n,
                                    args.global_batch, token, calibration=calibration)
        feed = MonitorWindows(args.monitor_url, args.monitor_job, token) if rank == 0 else None

    everyone: list[list[StepTiming]] = []
    for step in range(args.steps):
        device.step = step
        gc_timer.clear()
        t0 = time.perf_counter()
        if rank == args.stall_rank:
            time.sleep(args.stall_s)  # host-side work before the step's first op
        x, y = global_batch(step, args)
        lo = sum(batches[:rank])
        xs, ys = x[lo:lo + batches[rank]], y[lo:lo + batches[rank]]
        fs = time.perf_counter()
        # Sum over the local samples × n / B: DDP's average over ranks is then the mean over
        # the global batch for any split (the DD update is the B-sample batch's).
        loss = (ddp(xs) - ys).pow(2).sum() * n / args.global_batch
        # allocated in the forward, as activations are: the automatic collections it sets off
        # pause this rank's forward at steps of its own
        garbage = make_cyclic_garbage(args.gc_garbage, rng) if args.gc_garbage else None
        device.run(batches[rank])  # the device time of this rank's samples
        fe = time.perf_counter()
        loss.backward()            # the hook fires when the (one) bucket is ready
        opt.step()
        opt.zero_grad(set_to_none=True)
        del garbage
        if planned:
            planned.step(step)
        oe = time.perf_counter()
        be = hook.arrived
        mine = StepTiming(rank, step, t0, fs, fe, be, hook.completed, oe, batches[rank],
                          hook.nbytes, gc_timer.within(fs, fe), gc_timer.within(fe, be))
        rows = torch.zeros(n, ROW_WIDTH, dtype=torch.float64)
        gathered = list(rows.unbind(0))
        dist.all_gather(gathered, torch.tensor(mine.as_row(), dtype=torch.float64),
                        group=timing_group)
        timings = [StepTiming.from_row(r.tolist()) for r in gathered]
        everyone.append(timings)
        if publisher is not None:
            publisher.add(timings)
        for d in decide(policy, timings, feed, everyone, args, calibration, timing_group):
            # Every rank got the same decision from the same numbers: switch together.
            on = d.kind == APPLY
            if d.remedy == "stragglar":
                hook.use_stragglar() if on else hook.use_library()
            elif isinstance(d.params, SplitParams):
                batches = d.params.batch_sizes if on else split(args.global_batch, n)
            elif isinstance(d.params, GCParams):
                if on:
                    planned = PlannedGC(d.params.every).start()
                elif planned:
                    planned.stop()
                    planned = None
            if rank == 0:
                print(f"step {d.step}: {d.kind} {d.remedy} {d.params} — {d.reason}", flush=True)
    hook.close()
    if planned:
        planned.stop()
    if publisher is not None:
        publisher.close()
    if calibration is not None:
        calibration["gc_sync_pause_s"] = calibrate_gc(n, timing_group)
    if rank == 0:
        report(args, everyone, policy, ddp, hook, calibration)
    dist.barrier()
    del ddp, opt
    gc.collect()
    dist.destroy_process_group()


def decide(policy, timings, feed, everyone, args, calibration, group) -> list:
    """This step's decisions: from the policy's own windows, or from the monitor's via rank 0."""
    if policy is None:
        return []
    if feed is None and not args.monitor_url:
        return policy.observe(timings)
    decisions = []
    if feed is not None:  # rank 0: the monitor's windows analysed since the last step
        held = dict(enumerate(everyone))
        for w in feed.poll():
            trace = window_of(w, held, args.monitor_job, args.global_batch, calibration)
            if trace is not None and w.error is None:
                decisions += policy.observe_window(trace, w.slowdown,
                                                   source=f"monitor:{args.monitor_job}#{w.idx}",
                                                   applied_at=len(everyone))
    box = [decisions]
    dist.broadcast_object_list(box, src=0, group=group)  # every rank switches at this step
    if dist.get_rank() != 0:
        policy.decisions.extend(box[0])
    return box[0]


def report(args, everyone: list[list[StepTiming]], policy, model: nn.Module,
           hook: SwitchableCommHook, calibration: dict | None) -> None:
    """Rank 0: predicted vs measured per decision, step times, and the requested outputs."""
    steps = everyone[args.skip:]
    mean = window_step_time(steps)
    print(f"mean step time {1e3 * mean:.1f} ms over steps {args.skip}..{args.steps - 1}", flush=True)
    decisions = policy.decisions if policy else []
    for d in decisions:
        if d.kind != APPLY:
            pred = f"{1e3 * d.predicted_step_s:.1f} ms (×{d.predicted_speedup:.3f})" \
                if d.predicted_step_s and d.predicted_speedup else "none"
            print(f"{d.remedy}: before {ms(d.baseline_step_s)}, predicted {pred}, measured "
                  f"{ms(d.measured_step_s)} (×{d.measured_speedup or float('nan'):.3f}) → {d.kind}",
                  flush=True)
    if args.summary:
        args.summary.parent.mkdir(parents=True, exist_ok=True)
        args.summary.write_text(json.dumps({
            "mean_step_s": mean, "skipped_steps": args.skip,
            "step_times": [window_step_time([s]) for s in everyone],
            "decisions": [d.to_dict() for d in decisions], "stragglar_calls": hook.stragglar_calls,
            "calibration": calibration}, indent=1))
    if args.trace_dir:
        from stragglers.trace.runformat import write_run

        write_run(args.trace_dir, window_trace(steps, name="train_advised",
                                               global_batch=args.global_batch,
                                               calibration=calibration))
    if args.params_out:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        np.save(args.params_out, flat)


def ms(seconds: float | None) -> str:
    """Seconds as milliseconds for the report ("none" when not measured)."""
    return "none" if seconds is None else f"{1e3 * seconds:.1f} ms"


if __name__ == "__main__":
    main()
    exit_without_finalizing()  # torch's gloo threads can abort a finished process at exit
