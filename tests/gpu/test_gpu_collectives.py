"""StragglAR, the DDP hook and gradient coding on CUDA tensors, each against the plain result
(skipped without a GPU; run by `make gpu-check`).

One GPU: NCCL with world size 1 (the hook's own group, CUDA control tensors, CUDA-event
timing and CUDA-aware futures all run), CUDA-event stopwatches, coded messages decoded on the
device. Two or more GPUs: StragglAR and the hook on NCCL with one rank per GPU; three or more:
coded training on NCCL. NCCL refuses two ranks on one GPU, so those cases skip on one GPU.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from conftest import torchrun  # noqa: E402

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

STRAGGLAR_WORKER = """
import time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from stragglers.collectives.executor import stragglar_all_reduce
from stragglers.collectives.ddp_hook import StragglarHookState, stragglar_hook

dist.init_process_group("nccl")
rank, n = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(rank % torch.cuda.device_count())
dev = torch.device("cuda", torch.cuda.current_device())
cases = 0
for phase1 in (("auto", "library", "ring") if n > 1 else ("auto",)):
    for phase2 in ("dataflow", "lockstep"):
        for straggler in range(n):
            for length in (max(n - 2, 1), 2 * n + 1, 100003):
                for dtype in (torch.float32, torch.float64, torch.bfloat16):
                    g = torch.Generator(device=dev).manual_seed(7 * rank + length)
                    x = (torch.randn(length, generator=g, device=dev) * (rank + 1)).to(dtype)
                    ref = x.clone()
                    dist.all_reduce(ref)
                    stragglar_all_reduce(x, straggler, phase1=phase1, phase2=phase2)
                    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
                    err = (x.double() - ref.double()).abs().max().item()
                    assert err <= tol * (ref.double().abs().max().item() + 1) * n, (phase1, err)
                    cases += 1
torch.manual_seed(0)
def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).to(dev)
models = [DDP(make(), device_ids=[dev.index], bucket_cap_mb=0.01) for _ in range(2)]
state = StragglarHookState(window=2, threshold=0.5, min_lead_s=0.01)
models[1].register_comm_hook(state, stragglar_hook)
for model in models:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator(device=dev).manual_seed(rank)
    for step in range(8):
        x = torch.randn(32, 64, generator=g, device=dev)
        loss = model(x).square().mean()
        if model is models[1] and rank == n - 1 and n > 1:
            time.sleep(0.1)
        opt.zero_grad(); loss.backward(); opt.step()
state.close()
for p, q in zip(models[0].parameters(), models[1].parameters()):
    assert torch.allclose(p, q, atol=1e-5, rtol=1e-4), (p - q).abs().max()
assert all(d.seconds is None or d.seconds >= 0 for d in state.decisions)
print(f"rank {rank}: {cases} cuda cases ok, decisions {[d.straggler for d in state.decisions][-4:]}", flush=True)
dist.destroy_process_group()
"""

CODED_WORKER = """
import torch, torch.distributed as dist
from stragglers.coding import make_code
from stragglers.coding.data import load_digits_parts
from stragglers.coding.training import set_seed, train_coded

dist.init_process_group("nccl")
rank, n = dist.get_rank(), dist.get_world_size() - 1
torch.cuda.set_device(rank % torch.cuda.device_count())
dev = torch.device("cuda", torch.cuda.current_device())
data = load_digits_parts(n, batch_size=16)
data.X, data.y = data.X.to(dev), data.y.to(dev)
out = {}
for scheme, s in (("wait-for-all", 0), ("cyclic-mds", 1)):
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    res = train_coded(model, opt, torch.nn.functional.cross_entropy, data, make_code(scheme, n, s),
                      6, keep_params=True)
    if res is not None:
        out[scheme] = torch.stack(res.params).cpu()
if rank == 0:
    diff = (out["wait-for-all"] - out["cyclic-mds"]).abs().max().item()
    assert diff <= 1e-5 * out["wait-for-all"].abs().max().item(), diff
    print(f"coded on cuda ok: max difference {diff:.3g}", flush=True)
dist.destroy_process_group()
"""


def _run(tmp_path, source: str, nproc: int, timeout: float = 300):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(source))
    return torchrun(script, nproc, timeout=timeout)


def test_stopwatch_measures_gpu_time_not_host_enqueue():
    from stragglers.collectives.devices import Stopwatch

    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    watch = Stopwatch("cuda").start()
    for _ in range(10):
        a = a @ a / 64
    watch.stop()
    assert watch.seconds() > 1e-4  # ten 4096³ matmuls: far above a launch's microseconds


def test_coded_messages_decode_on_the_device_like_numpy():
    from stragglers.coding import make_code
    from stragglers.coding.training import combine_messages

    for scheme, n, s in (("cyclic-mds", 9, 2), ("cyclic-mds-complex", 8, 2), ("frc", 8, 1)):
        code = make_code(scheme, n, s)
        G = np.random.default_rng(0).standard_normal((n, 1000)).astype(np.float32)
        K = list(range(s, n))
        dec = code.decode(K)
        cdtype = np.complex64 if code.is_complex else np.float32
        f = (code.B.astype(cdtype) @ G.astype(cdtype))[K]
        msgs = [torch.as_tensor(np.ascontiguousarray(
            f[i].view(np.float32) if code.is_complex else f[i])).cuda() for i in range(len(K))]
        got = combine_messages(dec, msgs)
        assert got.is_cuda
        np.testing.assert_allclose(got.cpu().numpy(), dec.combine(f), rtol=1e-10, atol=1e-8)


def test_stragglar_and_hook_on_nccl(tmp_path):
    nproc = min(GPUS, 4)  # world size 1 on a single GPU: the CUDA plumbing, not the p2p rounds
    proc = _run(tmp_path, STRAGGLAR_WORKER, nproc)
    assert proc.stdout.count("cuda cases ok") == nproc, proc.stdout


@pytest.mark.skipif(GPUS < 3, reason="coded training on NCCL needs 1 master + 2 workers, one GPU each")
def test_coded_training_on_nccl_matches_wait_for_all(tmp_path):
    proc = _run(tmp_path, CODED_WORKER, 3)
    assert "coded on cuda ok" in proc.stdout, proc.stdout
