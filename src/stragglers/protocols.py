"""The interfaces each capability offers and consumes, written once (as torchtitan's protocols/).

A capability implements one of these protocols and registers its implementations by name in the
matching registry below, where they are defined; callers look them up by name
(`TRACE_READERS.get("kineto")`) instead of choosing with if/elif on strings. Nothing here
imports torch: registries hold names and factories, and the torch-using modules import torch
themselves.

`make typecheck` proves the implementations match: `Registry.register` takes the registry's
protocol type, so mypy checks each reader, algorithm, policy class and remedy class where it is
registered, and `coding/matrix_code.py` checks `MatrixCode` and `DecodingVector` against
`GradientCode` and `Decoding`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol, Sequence, runtime_checkable

from stragglers.registry import Registry

if TYPE_CHECKING:   # the implementations' types, for the checker only (no import at run time)
    import numpy as np

    from stragglers.adapt.controller import ControllerState, Proposal
    from stragglers.advice.context import AdviceContext
    from stragglers.advice.plan import RemedyAdvice
    from stragglers.coding.matrix_code import MatrixCode
    from stragglers.collectives.cost_model import LinkModel
    from stragglers.trace.model import Trace


@runtime_checkable
class TraceReader(Protocol):
    """Turns files on disk into an op table (`stragglers.trace.model.Trace`)."""

    name: str

    def can_read(self, path: Path) -> bool:
        """Whether `path` looks like this reader's format (cheap: names and first bytes only)."""

    def read(self, path: Path, *, meta: Path | str | None = None, dp_size: int | None = None,
             pp_size: int | None = None, tp_size: int | None = None) -> Trace:
        """The Trace in `path`; InputError naming the file and field when it is not readable.

        `meta` is NDTimeline's metadata YAML; dp_size / pp_size / tp_size place profiler ranks.
        A reader whose format records its layout refuses the ones it does not use."""


@runtime_checkable
class Decoding(Protocol):
    """One survivor set's decoding vector a, with aᵀB ≈ 1ᵀ supported on the survivors."""

    survivors: tuple[int, ...]
    method: str

    @property
    def residual(self) -> float:
        """‖aᵀB − 1ᵀ‖₂ (0 to rounding for exact codes)."""

    def combine(self, messages: np.ndarray) -> np.ndarray:
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

    def weights(self, worker: int) -> np.ndarray:
        """The weights worker `worker` combines its parts' gradients with."""

    def decode(self, survivors: Sequence[int]) -> Decoding:
        """The decoding for this survivor set (InputError for a set the code cannot decode)."""


@runtime_checkable
class AllReduceAlgorithm(Protocol):
    """An all-reduce with a cost model (docs/stragglar.md): run on torch.distributed, or priced."""

    @property
    def name(self) -> str:
        """The name it is registered under."""

    def time(self, n: int, size: float, link: LinkModel, delay: float = 0.0) -> float:
        """α–β time in seconds of an all-reduce of `size` bytes on n ranks, straggler `delay` late."""


class GradientCodeFactory(Protocol):
    """How GRADIENT_CODES builds a scheme: `factory(n, s, d=, seed=, decoder=)`.

    It builds a MatrixCode (a GradientCode with its matrix B explicit): make_code's stability
    guard reads B."""

    def __call__(self, n: int, s: int, *, d: int | None = None, seed: int = 0,
                 decoder: str | None = None) -> MatrixCode:
        """The code for n workers tolerating s stragglers (InputError for options it refuses)."""


@runtime_checkable
class ControllerPolicy(Protocol):
    """Turns observed per-worker speeds into actions (docs/adaptive.md)."""

    name: str

    def decide(self, state: ControllerState) -> list[Proposal]:
        """The actions (resize batches, restart a worker) proposed for this state."""


@runtime_checkable
class Remedy(Protocol):
    """A fix for one straggler cause, with its prediction on a given job (advice/)."""

    name: str

    def predict(self, ctx: AdviceContext) -> RemedyAdvice:
        """Predicted step time and speedup of applying this remedy to the analysed job."""


class RemedyFamily(Protocol):
    """A remedy as REMEDIES holds it (its class): the settings of it worth pricing on one job."""

    def variants(self, ctx: AdviceContext) -> Sequence[Remedy]:
        """One Remedy per setting to predict (most remedies: one)."""


TRACE_READERS: Registry[TraceReader] = Registry("trace format")
GRADIENT_CODES: Registry[GradientCodeFactory] = Registry("gradient code")
ALLREDUCE_ALGORITHMS: Registry[AllReduceAlgorithm] = Registry("all-reduce algorithm")
# policies and remedies are registered as classes: a policy is made per controller, a remedy's
# class lists the settings of it to price
CONTROLLER_POLICIES: Registry[Callable[[], ControllerPolicy]] = Registry("controller policy")
REMEDIES: Registry[RemedyFamily] = Registry("remedy")

__all__ = [
    "ALLREDUCE_ALGORITHMS", "AllReduceAlgorithm", "CONTROLLER_POLICIES", "ControllerPolicy",
    "Decoding", "GRADIENT_CODES", "GradientCode", "GradientCodeFactory", "REMEDIES", "Remedy",
    "RemedyFamily", "TRACE_READERS", "TraceReader",
]
