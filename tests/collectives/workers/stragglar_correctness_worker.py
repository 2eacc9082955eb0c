"""Worker: StragglAR equals dist.all_reduce for every straggler, awkward lengths and each dtype."""

import sys

import torch
import torch.distributed as dist

from stragglers.collectives.executor import stragglar_all_reduce

TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 3e-2}


def main() -> None:
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    paths = sys.argv[1].split(",")
    lengths = [1, n - 2, 2 * (n - 1) + 1, 1000 + n, 4097]
    cases = 0
    for path in paths:
        for straggler in range(n):
            for length in lengths:
                for dtype in TOL:
                    g = torch.Generator().manual_seed(1000 * rank + length)
                    x = (torch.randn(length, generator=g) * (rank + 1)).to(dtype)
                    ref = x.clone()
                    dist.all_reduce(ref)
                    # a 2-D, non-contiguous view must also come back reduced in place
                    run = stragglar_all_reduce(x, straggler, phase1=path)
                    assert run.phase1 == (path if path != "auto" else "ring"), run
                    err = (x.double() - ref.double()).abs().max().item() if length else 0.0
                    scale = (ref.double().abs().max().item() if length else 0.0) + 1.0
                    assert err <= TOL[dtype] * scale * n, (path, straggler, length, dtype, err)
                    cases += 1
        # in place on a non-contiguous tensor
        base = torch.arange(24, dtype=torch.float64).reshape(4, 6) * (rank + 1)
        view = base.t()
        expect = view.clone()
        dist.all_reduce(expect)
        stragglar_all_reduce(view, n - 1, phase1=path)
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
