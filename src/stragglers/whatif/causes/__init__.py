"""Cause detectors of the diagnosis: each finds one kind of straggler and the costs its fix leaves.

Every detector takes a `Context` and returns `Candidate`s; the diagnosis (whatif/diagnosis.py)
predicts, bounds and ranks them. The contract is in whatif/README.md.
"""

from collections.abc import Callable

from stragglers.whatif.causes.base import Candidate, Context
from stragglers.whatif.causes.capacity import slow_group
from stragglers.whatif.causes._communication import communication
from stragglers.whatif.causes.experts import expert_imbalance
from stragglers.whatif.causes.gc import gc_pauses
from stragglers.whatif.causes.sequence import sequence_imbalance
from stragglers.whatif.causes.stage import stage_imbalance
from stragglers.whatif.causes.workers import host_stall, worker_fault

__all__ = ["Candidate", "Context", "DETECTORS", "communication", "expert_imbalance", "gc_pauses",
           "host_stall",
           "sequence_imbalance", "slow_group", "stage_imbalance", "worker_fault"]

# name → detector, in the order they run (the diagnosis ranks the findings by gain); each takes
# the Context (worker_fault also the worker scores S_w) and returns its candidates.
DETECTORS: dict[str, Callable[..., list[Candidate]]] = {
    "worker_fault": worker_fault,
    "slow_group": slow_group,
    "host_stall": host_stall,
    "stage_imbalance": stage_imbalance,
    "sequence_imbalance": sequence_imbalance,
    "expert_imbalance": expert_imbalance,
    "gc": gc_pauses,
    "communication": communication,
}
