"""A DDP communication hook that can switch between the library all-reduce and StragglAR mid-run.

DDP takes one hook per model, once (register_comm_hook cannot be called twice), so the hook
registered is this dispatcher; `use_stragglar()` / `use_library()` switch what it runs. Both are
collective: every rank calls them at the same step (AdvisePolicy's decisions are identical on
every rank). The hook also times each bucket's arrival and completion for the window timings.

No `from __future__ import annotations` here: DDP checks the hook's annotations at runtime.
"""

import time

import torch.distributed as dist
from stragglers.collectives.completion import CompletionThread, reduce_bucket
from stragglers.collectives.ddp_hook import StragglarHookState, stragglar_hook


class SwitchableCommHook:
    """Hook state: library all-reduce or StragglAR (persistent mode), switched collectively."""

    def __init__(self, process_group=None, window: int = 4, threshold: float = 0.6):
        # StragglAR's traffic (p2p rounds, its time exchange) gets a group of its own, so it
        # never interleaves with collectives the training loop issues on the default group.
        self.process_group = process_group
        self.stragglar_group = dist.new_group(list(range(dist.get_world_size(process_group))))
        self.window, self.threshold = window, threshold
        self.stragglar: StragglarHookState | None = None
        self.stragglar_calls = 0  # bucket calls that ran StragglAR (not its warm-up all-reduces)
        self.arrived: float | None = None    # perf_counter when the last bucket's sync was called
        self.completed: float | None = None  # ... and when its result was ready
        self.nbytes = 0
        # completes the futures DDP waits on (no Python callback on gloo's: completion.py)
        self.completer = CompletionThread("stragglers-advise-buckets")

    @property
    def mode(self) -> str:
        return "stragglar" if self.stragglar is not None else "library"

    def use_stragglar(self) -> None:
        """Switch to StragglAR (collective: all ranks at the same step, between steps)."""
        if self.stragglar is None:
            self.stragglar = StragglarHookState(process_group=self.stragglar_group,
                                                mode="persistent", window=self.window,
                                                threshold=self.threshold)

    def use_library(self) -> None:
        """Switch back to the library all-reduce (collective, between steps)."""
        if self.stragglar is not None:
            self.stragglar.close()
            self.stragglar_calls += sum(d.straggler is not None for d in self.stragglar.decisions)
            self.stragglar = None

    def close(self) -> None:
        """Finish StragglAR's queued work and join the hook's thread (every rank, after training)."""
        self.use_library()
        self.completer.stop()


def switchable_hook(state, bucket):
    """Average the bucket with the library all-reduce or StragglAR, whichever `state` holds."""
    state.arrived = time.perf_counter()
    buf = bucket.buffer()
    state.nbytes = buf.numel() * buf.element_size()

    def done():
        state.completed = time.perf_counter()

    if state.stragglar is not None:
        fut = stragglar_hook(state.stragglar, bucket)
        return state.completer.complete(fut, fut.value, done, buf.device)
    return reduce_bucket(state.completer, bucket, state.process_group, on_done=done)
