"""Worker: StragglAR equals dist.all_reduce for every straggler, awkward lengths and each dtype."""

import sys

import torch
import torch.distributed as dist

from stragglers.collectives.executor import stragglar_all_reduce

TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 3e-2}


def main() -> None:
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    combos = [c.split("/") for c in sys.argv[1].split(",")]  # phase1/phase2 pairs
    lengths = [n - 2, 2 * (n - 1) + 1, 1000 + n]
    cases = 0
    for path, phase2 in combos:
        for straggler in range(n):
            for length in lengths:
                for dtype in TOL:
                    g = torch.Generator().manual_seed(1000 * rank + length)
                    x = (torch.randn(length, generator=g) * (rank + 1)).to(dtype)
                    ref = x.clone()
                    dist.all_reduce(ref)
                    run = stragglar_all_reduce(x, straggler, phase1=path, phase2=phase2)
                    assert run.phase1 == (path if path != "auto" else "ring") and run.phase2 == phase2, run
                    err = (x.double() - ref.double()).abs().max().item() if length else 0.0
                    scale = (ref.double().abs().max().item() if length else 0.0) + 1.0
                    assert err <= TOL[dtype] * scale * n, (path, straggler, length, dtype, err)
                    cases += 1
        # in place on a non-contiguous tensor
        base = torch.arange(24, dtype=torch.float64).reshape(4, 6) * (rank + 1)
        view = base.t()
        expect = view.clone()
        dist.all_reduce(expect)
        stragglar_all_reduce(view, n - 1, phase1=path, phase2=phase2)
        assert torch.equal(base.t(), expect), "non-contiguous tensor not reduced in place"
    # every rank must hold bitwise the same result
    x = torch.randn(999, generator=torch.Generator().manual_seed(rank))
    stragglar_all_reduce(x, 0)
    gathered = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(gathered, x)
    assert all(torch.equal(gathered[0], y) for y in gathered), "ranks disagree bitwise"
    print(f"rank {rank}: {cases} cases ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
