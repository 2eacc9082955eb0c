"""DDP with the completion-thread hook trains exactly like DDP's own C++ all-reduce (2 ranks, gloo)."""

import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from stragglers.collectives.completion import CompletionThread, reduce_bucket
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from launch import exit_without_finalizing  # noqa: E402  (examples/launch.py)

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])


completer = CompletionThread("test-buckets")
done_on = []


def hook(state, bucket):
    return reduce_bucket(completer, bucket, state,
                         on_done=lambda: done_on.append(threading.current_thread().name))


ours, plain = DDP(make_model(), bucket_cap_mb=0.02), DDP(make_model(), bucket_cap_mb=0.02)
ours.register_comm_hook(None, hook)
opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, plain)]
torch.manual_seed(1 + rank)  # each rank its own data: the average matters
for _ in range(3):
    x = torch.randn(16, 64)
    for model, opt in zip((ours, plain), opts):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
for a, b in zip(ours.parameters(), plain.parameters()):
    assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()
# every bucket of every step was completed by our thread: gloo's ran no Python of ours
assert len(done_on) >= 3 * 2 and set(done_on) == {"test-buckets"}, done_on

thread = completer._thread
completer.stop()
assert completer._thread is None and not thread.is_alive()


class Failing:
    def wait(self):
        raise RuntimeError("peer gone")


fut = completer.complete(Failing(), lambda: None)  # starts the thread again
try:
    fut.wait()
    raise AssertionError("the failure did not reach the future")
except RuntimeError as exc:
    assert "peer gone" in str(exc)

# sum mode: the bucket holds Σ over ranks
summed = CompletionThread("test-sum")
t = torch.full((4,), float(rank + 1))


class Bucket:
    def buffer(self):
        return t


out = reduce_bucket(summed, Bucket(), None, average=False).wait()
assert torch.equal(out, torch.full((4,), float(sum(range(1, world + 1))))), out
summed.stop()
completer.stop()
print("completion ok", flush=True)
dist.destroy_process_group()
exit_without_finalizing()  # torch's gloo threads can abort a finished process at exit
