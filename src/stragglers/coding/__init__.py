"""Gradient coding: codes, decoders and the stability guard (numpy only; training needs torch)."""

from stragglers.coding.expander import ExpanderCode, random_regular_graph, second_eigenvalue
from stragglers.coding.mds import CyclicMDSCode
from stragglers.coding.protocol import Decoding, GradientCode, condition_number
from stragglers.coding.repetition import (CyclicRepetitionCode, FractionalRepetitionCode,
                                          IdentityCode, ignore_stragglers, wait_for_all)
from stragglers.coding.schemes import SCHEMES, make_code
from stragglers.coding.stability import (StabilityReport, UnstableCodeError, check_stability,
                                         stability_report)

__all__ = [
    "CyclicMDSCode", "CyclicRepetitionCode", "Decoding", "ExpanderCode",
    "FractionalRepetitionCode", "GradientCode", "IdentityCode", "SCHEMES", "StabilityReport",
    "UnstableCodeError", "check_stability", "condition_number", "ignore_stragglers", "make_code",
    "random_regular_graph", "second_eigenvalue", "stability_report", "wait_for_all",
]
