"""Gradient coding: codes, decoders, the stability guard and coded data-parallel training.

`import stragglers.coding` needs numpy only; the training names (`train_coded`,
`PartitionedData`, `load_digits_parts`) load their modules
on first use, so the codes work without torch.

Public names (`__all__`):

* building codes: `make_code(scheme, n, s, ...)`, `SCHEMES`, the classes `CyclicMDSCode`,
  `CyclicRepetitionCode`, `ExpanderCode`, `FractionalRepetitionCode`, `IdentityCode`,
  `wait_for_all`, `ignore_stragglers`; graph helpers `random_regular_graph`, `second_eigenvalue`
* the base class of every code (implementing `stragglers.protocols.GradientCode`): `MatrixCode`,
  its `DecodingVector`, `condition_number`
* the guard: `check_stability`, `stability_report`, `decode_error_bound`, `StabilityReport`,
  `UnstableCodeError`
* training (torch): `train_coded`, `TrainResult`, `PartitionedData`, `load_digits_parts`;
  delays: `DelaySampler`
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stragglers.lazy import lazy_exports

_LAZY = {
    "CyclicMDSCode": "stragglers.coding.mds",
    "CyclicRepetitionCode": "stragglers.coding.repetition",
    "FractionalRepetitionCode": "stragglers.coding.repetition",
    "IdentityCode": "stragglers.coding.repetition",
    "ignore_stragglers": "stragglers.coding.repetition",
    "wait_for_all": "stragglers.coding.repetition",
    "ExpanderCode": "stragglers.coding.expander",
    "random_regular_graph": "stragglers.coding.expander",
    "second_eigenvalue": "stragglers.coding.expander",
    "DecodingVector": "stragglers.coding.matrix_code",
    "MatrixCode": "stragglers.coding.matrix_code",
    "condition_number": "stragglers.coding.matrix_code",
    "SCHEMES": "stragglers.coding.schemes",
    "make_code": "stragglers.coding.schemes",
    "StabilityReport": "stragglers.coding.stability",
    "UnstableCodeError": "stragglers.coding.stability",
    "check_stability": "stragglers.coding.stability",
    "decode_error_bound": "stragglers.coding.stability",
    "stability_report": "stragglers.coding.stability",
    "DelaySampler": "stragglers.coding.delays",
    "PartitionedData": "stragglers.coding.data",
    "load_digits_parts": "stragglers.coding.data",
    "TrainResult": "stragglers.coding.training",
    "train_coded": "stragglers.coding.training",
}

# The base class and its decoding were exported as GradientCode and Decoding, the names of the
# interfaces in stragglers.protocols that they implement.
_RENAMED = {"GradientCode": "MatrixCode", "Decoding": "DecodingVector"}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY, _RENAMED)

if TYPE_CHECKING:   # the same names for type checkers, which do not run __getattr__
    from stragglers.coding.data import PartitionedData, load_digits_parts
    from stragglers.coding.delays import DelaySampler
    from stragglers.coding.expander import ExpanderCode, random_regular_graph, second_eigenvalue
    from stragglers.coding.matrix_code import DecodingVector, MatrixCode, condition_number
    from stragglers.coding.mds import CyclicMDSCode
    from stragglers.coding.repetition import (CyclicRepetitionCode, FractionalRepetitionCode,
                                              IdentityCode, ignore_stragglers, wait_for_all)
    from stragglers.coding.schemes import SCHEMES, make_code
    from stragglers.coding.stability import (StabilityReport, UnstableCodeError, check_stability,
                                             decode_error_bound, stability_report)
    from stragglers.coding.training import TrainResult, train_coded
