"""Self-adaptive data-parallel training (AntDT) on scikit-learn's digits, with injected stragglers.

    torchrun --nproc-per-node 4 examples/train_adaptive.py --policy dd --speeds 1,1,1,0.33 \
        --overwrite
    torchrun --nproc-per-node 4 --max-restarts 1 examples/train_adaptive.py --policy nd \
        --persistent-rank 3 --overwrite

--policy bsp: static equal batches; dd: per-worker batches from measured throughput (AntDT-DD);
nd: ADJUST_BS for transient stragglers, KILL_RESTART for persistent ones (AntDT-ND).
Device speed is injected: each micro-batch of m samples sleeps m x --sample-time / speed.
A --workdir holding an earlier run is refused unless --resume (continue it) or --overwrite
(start afresh) is given; torchrun's own restarts always resume. Rank 0 prints progress every 10
steps and ends with a verdict: the step time before and after the policy re-split the batches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

from stragglers.adapt.agent import EXIT_RESTART, Agent
from stragglers.adapt.checkpoint import load_job_checkpoint, save_job_checkpoint
from stragglers.adapt.client import ShardBatchSampler, ShardClient
from stragglers.adapt.controller import ControlConfig
from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.heterogeneity import SimulatedDevice, parse_speeds
from stragglers.adapt.launch import init_distributed, job_service
from stragglers.adapt.policies import micro_batches
from stragglers.adapt.step import DataParallelStep
from stragglers.serving import read_token_file

from launch import exit_without_finalizing, main_once, require_torchrun  # examples/launch.py

RUN_FILES = ("shards.db", "shards.db-wal", "shards.db-shm", "checkpoint.pt", "metrics.jsonl",
             "summary.json", "job.token")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", choices=["bsp", "dd", "nd"], default="dd")
    p.add_argument("--speeds", default="1", help="per-rank device speeds, e.g. 1,1,1,0.33")
    p.add_argument("--transient-rate", type=float, default=0.0,
                   help="per-step chance that a rank starts a 3x slowdown of 5-15 steps")
    p.add_argument("--persistent-rank", type=int, default=None,
                   help="rank that becomes 3x slower from --persistent-start (first incarnation only)")
    p.add_argument("--persistent-start", type=int, default=5)
    p.add_argument("--steps", type=int, default=60, help="global steps to run")
    p.add_argument("--epochs", type=int, default=None, help="stop after this many epochs")
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--memory-cap", type=int, default=32, help="samples per micro-batch")
    p.add_argument("--sample-time", type=float, default=0.004, help="seconds per sample at speed 1")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-server", default="embedded", help="service URL or 'embedded'")
    p.add_argument("--service-token-file", type=Path, default=None,
                   help="token of a --shard-server started with --token-file (to create the data set)")
    p.add_argument("--workdir", type=Path, default=Path("runs/adaptive"))
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--restart-cost", type=float, default=10.0, help="predicted seconds per restart")
    p.add_argument("--max-restarts", type=int, default=1, help="same as torchrun's --max-restarts")
    p.add_argument("--window", type=int, default=5, help="monitor window in steps")
    p.add_argument("--persistent-windows", type=int, default=3,
                   help="flagged windows in a row that make a straggler persistent")
    p.add_argument("--num-samples", type=int, default=None, help="use only the first N digits")
    p.add_argument("--lease-s", type=float, default=30.0)
    p.add_argument("--ack-interval", type=float, default=1.0,
                   help="seconds between progress acks (checkpoints always ack first)")
    p.add_argument("--log-samples", action="store_true", help="write each rank's sample ids per step")
    p.add_argument("--crash-at", type=int, default=None,
                   help="test hook: rank 1 dies (exit 1) at this step of incarnation --crash-incarnation")
    p.add_argument("--crash-incarnation", type=int, default=0)
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue the run in --workdir")
    again.add_argument("--overwrite", action="store_true",
                       help="delete the run in --workdir and start afresh")
    return p.parse_args()


def earlier_run(workdir: Path) -> list[str]:
    """Files of an earlier run in `workdir` (its state, checkpoint or logs)."""
    if not workdir.is_dir():
        return []
    return sorted(p.name for p in workdir.iterdir()
                  if p.name in RUN_FILES or p.name.startswith("samples_rank"))


def refuse_silent_resume(args: argparse.Namespace, incarnation: int) -> None:
    """Exit 2 when the first incarnation would silently continue an earlier run."""
    found = earlier_run(args.workdir)
    if incarnation == 0 and found and not (args.resume or args.overwrite):
        raise SystemExit(f"--workdir {args.workdir} holds an earlier run ({', '.join(found[:4])});"
                         " pass --resume to continue it or --overwrite to start afresh")


class StepTimes:
    """Rank 0's step times, grouped by the batch split they ran with: what the policy bought."""

    def __init__(self) -> None:
        self.splits: list[tuple[list[int], list[float]]] = []  # (batch sizes, step seconds)

    def add(self, batch_sizes: list[int], seconds: float) -> None:
        if not self.splits or self.splits[-1][0] != batch_sizes:
            self.splits.append((list(batch_sizes), []))
        self.splits[-1][1].append(seconds)

    def verdict(self, policy: str) -> str:
        """'verdict: ...' with the mean step time before the first re-split and after the last."""
        if not self.splits:
            return "verdict: no step ran"
        mean = lambda xs: sum(xs[1:] or xs) / len(xs[1:] or xs)  # noqa: E731  (first: warm-up)
        (first, before), (last, after) = self.splits[0], self.splits[-1]
        if len(self.splits) == 1:
            return (f"verdict: {policy} kept batches {first}; step time {mean(before):.3f} s over "
                    f"{len(before)} steps")
        return (f"verdict: {policy} re-split batches {first} -> {last}; step time "
                f"{mean(before):.3f} s -> {mean(after):.3f} s ({mean(before) / mean(after):.2f}x "
                f"faster; {len(before)} steps before the first re-split, {len(after)} after "
                "the last)")


def main() -> None:
    args = parse_args()
    refuse_silent_resume(args, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    require_torchrun()
    incarnation = init_distributed("gloo")  # incarnation = torchrun restart count
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        args.workdir.mkdir(parents=True, exist_ok=True)
        if args.overwrite and incarnation == 0:
            for name in earlier_run(args.workdir):
                (args.workdir / name).unlink(missing_ok=True)
    dist.barrier()
    torch.manual_seed(args.seed)

    # Data and model: the 1,797 8x8 digits shipped inside scikit-learn, and a small MLP.
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    if args.num_samples:
        x, y = x[:args.num_samples], y[:args.num_samples]
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sum_loss = torch.nn.CrossEntropyLoss(reduction="sum")

    # Shard service (embedded in rank 0 unless a URL is given); rank 0 registers the data set
    # with the job's token, which every rank learns through the torchrun store.
    svc = job_service(args.shard_server, args.workdir / "shards.db", args.workdir / "job.token")
    # Creating needs the service's token where it has one: the job token for an embedded
    # service on a public address (the job spans hosts), the given file's for a standalone one.
    service_token = (read_token_file(args.service_token_file, "--service-token-file")
                     if args.service_token_file else svc.token)
    client = ShardClient(svc.url, "digits", worker=f"rank{rank}", token=svc.token,
                         service_token=service_token)
    if rank == 0:
        client.create_dataset(DatasetConfig("digits", len(x), shard_size=4 * args.global_batch // world,
                                            seed=args.seed, num_epochs=args.epochs, lease_s=args.lease_s))
    dist.barrier()
    ckpt_path = args.workdir / "checkpoint.pt"
    state = load_job_checkpoint(ckpt_path, model, optimizer, client)
    step = state.step if state else 0

    speeds = parse_speeds(args.speeds, world)
    device = SimulatedDevice(rank, speeds, args.sample_time, args.transient_rate,
                             persistent_rank=args.persistent_rank,
                             persistent_start=args.persistent_start, incarnation=incarnation,
                             seed=args.seed)
    if rank == 0:
        client.configure_control(ControlConfig(
            policy=args.policy, world_size=world, global_batch=args.global_batch,
            memory_cap=args.memory_cap, total_steps=args.steps, restart_cost_s=args.restart_cost,
            max_restarts=max(0, args.max_restarts - incarnation), window=args.window,
            persistent_windows=args.persistent_windows, incarnation=incarnation,
            start_step=step))   # (the checkpoint's: the first records' steps are bounded from it)
    dist.barrier()
    agent = Agent(ShardClient(svc.url, "digits", worker=f"agent{rank}", token=svc.token), rank,
                  world, args.global_batch, args.memory_cap, incarnation, device.device)
    dd = DataParallelStep(model, n_extras=3)  # extras: unfinished, KILL_RESTART votes, target
    plan = agent.plan(step)
    sampler = ShardBatchSampler(client, batch_size=lambda: plan.batch_size, block=False,
                                ack_interval_s=args.ack_interval)
    batches = iter(DataLoader(TensorDataset(x, y), batch_sampler=sampler, collate_fn=sampler.collate))

    metrics = open(args.workdir / "metrics.jsonl", "a") if rank == 0 else None
    samples_log = open(args.workdir / f"samples_rank{rank}.jsonl", "a") if args.log_samples else None

    def checkpoint(step: int) -> None:
        sampler.ack(force=True)  # the shard snapshot must include every trained batch
        save_job_checkpoint(ckpt_path, step, model, optimizer, client)

    last_loss = float("nan")
    times = StepTimes()
    while step < args.steps:
        t0 = time.perf_counter()
        plan = agent.plan(step)
        split = list(agent.batch_sizes)  # the split in force for this step
        device.step = step
        batch = next(batches, None)
        inputs, targets = batch if batch is not None else (x[:0], y[:0])
        pending_kill = plan.kill_target if plan.kill_target is not None else -1
        result = dd.step(sum_loss, inputs, targets, micro_batches(len(inputs), args.memory_cap),
                         optimizer, extras=[0.0 if sampler.finished else 1.0,
                                            float(pending_kill >= 0), pending_kill + 1.0],
                         on_micro_batch=device.run)
        sampler.ack()
        step += 1
        last_loss = result.mean_loss if result.global_count else last_loss
        agent.record(step, result.compute_s, len(inputs))
        if rank == 0:
            times.add(split, time.perf_counter() - t0)
            if step % 10 == 0 or step == args.steps:
                print(f"step {step}/{args.steps}: loss {last_loss:.4f}, step "
                      f"{time.perf_counter() - t0:.3f} s, batches {agent.batch_sizes}", flush=True)
        if samples_log:
            samples_log.write(json.dumps({"inc": incarnation, "step": step, "ids": sampler.last_batch,
                                          "epochs": sampler.last_batch_epochs}) + "\n")
            samples_log.flush()
        if metrics:
            metrics.write(json.dumps({"inc": incarnation, "step": step, "t": time.time(),
                                      "samples": result.global_count, "loss": result.mean_loss,
                                      "batch_sizes": agent.batch_sizes, "policy": args.policy}) + "\n")
            metrics.flush()
        unfinished, kill_votes, kill_target_sum = result.extras
        if kill_votes > 0:
            # Every rank learns of KILL_RESTART from the same AllReduce, so all checkpoint together.
            target = round(kill_target_sum / kill_votes) - 1
            checkpoint(step)
            print(f"rank {rank}: KILL_RESTART of rank {target} at step {step}: {plan.reason};"
                  " checkpointed, leaving so torchrun re-forms the group", flush=True)
            agent.close()
            os._exit(EXIT_RESTART)
        if step == args.crash_at and incarnation == args.crash_incarnation and rank == 1:
            os._exit(1)  # test hook: a worker dies mid-shard, without any cleanup
        if unfinished == 0:
            break  # every rank has drained the data set
        if step % args.ckpt_every == 0:
            checkpoint(step)

    checkpoint(step)
    agent.close()
    dd.close()
    if rank == 0:
        summary = {"steps": step, "incarnation": incarnation,
                   "failed_shards": msgspec.to_builtins(client.status().failed),
                   "control": msgspec.to_builtins(client.control_state()), "late_actions": agent.late}
        (args.workdir / "summary.json").write_text(json.dumps(summary, indent=1))
        print(f"done: {step} steps, last loss {last_loss:.4f}, batch sizes {agent.batch_sizes}")
        print(times.verdict(args.policy), flush=True)
    dist.barrier()
    if svc.server:
        svc.server.stop()
    dist.destroy_process_group()


if __name__ == "__main__":
    # torch's gloo threads can abort a finished process at exit (examples/launch.py)
    exit_without_finalizing(main_once(main))
