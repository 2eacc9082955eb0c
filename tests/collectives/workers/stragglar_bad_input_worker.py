"""Worker: bad inputs to StragglAR are the same InputError on every rank, never a hang or a
wrong sum; sub-groups are created collectively, so later world-wide groups still work."""

import torch
import torch.distributed as dist

from stragglers.collectives.executor import prepare_subgroups, stragglar_all_reduce
from stragglers.errors import InputError


def expect_error(fn, field):
    try:
        fn()
    except InputError as exc:
        assert exc.field == field, exc
        return str(exc)
    raise AssertionError(f"no InputError for {field}")


def main():
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    straggler = n - 1
    # a leaf that requires grad: reduced like dist.all_reduce, on every rank
    x = torch.full((10,), float(rank + 1), requires_grad=True)
    stragglar_all_reduce(x, straggler)
    assert torch.equal(x.detach(), torch.full((10,), n * (n + 1) / 2)), x
    # the straggler's tensor is longer: every rank raises, nobody hangs, no wrong sum is
    # returned (phase 1 may have run on the ready ranks, so their contents are unspecified,
    # as after a failed dist.all_reduce; the straggler's tensor is untouched)
    y = torch.ones(20 + (5 if rank == straggler else 0))
    msg = expect_error(lambda: stragglar_all_reduce(y, straggler), "tensor.numel()")
    if rank == straggler:
        assert torch.equal(y, torch.ones_like(y))
    # a ready rank disagrees: caught among the ready ranks before phase 1, and by everyone
    z = torch.ones(20 + (3 if rank == 0 else 0))
    expect_error(lambda: stragglar_all_reduce(z, straggler, phase1="ring"), "tensor.numel()")
    w = torch.ones(20, dtype=torch.float64 if rank == 1 else torch.float32)
    expect_error(lambda: stragglar_all_reduce(w, straggler), "tensor.dtype")
    # the group is still healthy, and a later world-wide group can be created and used
    prepare_subgroups()
    v = torch.full((7,), float(rank))
    stragglar_all_reduce(v, 0, phase1="library")
    assert torch.equal(v, torch.full((7,), sum(range(n)) * 1.0))
    late = dist.new_group()
    u = torch.ones(3)
    dist.all_reduce(u, group=late)
    assert torch.equal(u, torch.full((3,), float(n)))
    # a sub-group: its ready sub-groups are created by every rank of the job at once
    sub = dist.new_group([0, 1, 2])
    prepare_subgroups(sub)  # rank 3 is not in `sub`, and takes part all the same
    if rank < 3:
        t = torch.full((9,), float(rank))
        stragglar_all_reduce(t, 2, group=sub, phase1="library")
        assert torch.equal(t, torch.full((9,), 3.0)), t
    if rank == 0:
        print(f"errors: {msg}", flush=True)
    print(f"rank {rank}: bad input ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
