"""The interfaces each capability offers and consumes, written once (as torchtitan's protocols/).

A capability implements one of these protocols and registers its implementations by name in the
matching registry below, where they are defined; callers look them up by name
(`TRACE_READERS.get("kineto")`) instead of choosing with if/elif on strings. Nothing here
imports torch: registries hold names and factories, and the torch-using modules import torch
themselves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from stragglers.registry import Registry


@runtime_checkable
class TraceReader(Protocol):
    """Turns files on disk into an op table (`stragglers.trace.model.Trace`)."""

    name: str

    def can_read(self, path: Path) -> bool:
        """Whether `path` looks like this reader's format (cheap: names and first bytes only)."""

    def read(self, path: Path, **options: Any) -> Any:
        """The Trace in `path`; InputError naming the file and field when it is not readable."""


@runtime_checkable
class Decoding(Protocol):
    """One survivor set's decoding vector a, with aᵀB ≈ 1ᵀ supported on the survivors."""

    survivors: tuple[int, ...]
    method: str

    @property
    def residual(self) -> float:
        """‖aᵀB − 1ᵀ‖₂ (0 to rounding for exact codes)."""

    def combine(self, messages: Any) -> Any:
        """Σ_k a_k f_k over the survivors' messages."""


@runtime_checkable
class GradientCode(Protocol):
    """n workers, n data parts, encoding matrix B; tolerates s stragglers (docs/gradient-coding.md)."""

    name: str
    n: int
    s: int
    exact: bool

    def parts(self, worker: int) -> tuple[int, ...]:
        """The data parts worker `worker` computes gradients of."""

    def weights(self, worker: int) -> Any:
        """The weights worker `worker` combines its parts' gradients with."""

    def decode(self, survivors: Sequence[int]) -> Decoding:
        """The decoding for this survivor set (InputError for a set the code cannot decode)."""


@runtime_checkable
class AllReduceAlgorithm(Protocol):
    """An all-reduce with a cost model (docs/stragglar.md): run on torch.distributed, or priced."""

    name: str

    def time(self, n: int, size: float, link: Any, delay: float = 0.0) -> float:
        """α–β time in seconds of an all-reduce of `size` bytes on n ranks, straggler `delay` late."""


@runtime_checkable
class ControllerPolicy(Protocol):
    """Turns observed per-worker speeds into actions (docs/adaptive.md)."""

    name: str

    def decide(self, state: Mapping[str, Any]) -> list[Any]:
        """The actions (resize batches, restart a worker, switch a remedy) for this state."""


@runtime_checkable
class Remedy(Protocol):
    """A fix for one straggler cause, with its prediction on a given job (advice/)."""

    name: str

    def predict(self, result: Any) -> Any:
        """Predicted step time and speedup of applying this remedy to the analysed job."""


TRACE_READERS: Registry[TraceReader] = Registry("trace format")
GRADIENT_CODES: Registry[Any] = Registry("gradient code")
ALLREDUCE_ALGORITHMS: Registry[AllReduceAlgorithm] = Registry("all-reduce algorithm")
CONTROLLER_POLICIES: Registry[ControllerPolicy] = Registry("controller policy")
REMEDIES: Registry[Remedy] = Registry("remedy")

__all__ = [
    "ALLREDUCE_ALGORITHMS", "AllReduceAlgorithm", "CONTROLLER_POLICIES", "ControllerPolicy",
    "Decoding", "GRADIENT_CODES", "GradientCode", "REMEDIES", "Remedy", "TRACE_READERS",
    "TraceReader",
]
