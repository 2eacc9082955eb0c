"""Each capability registers its implementations, and they satisfy the protocol written once."""

from __future__ import annotations

import importlib

import pytest

from stragglers import protocols

# registry → (module whose import registers the implementations, names that must be there)
REGISTRIES = {
    "TRACE_READERS": ("stragglers.trace.load", {"kineto", "run", "ndtimeline"}),
    "GRADIENT_CODES": ("stragglers.coding.schemes", {"frc", "cyclic-mds", "expander"}),
    "ALLREDUCE_ALGORITHMS": ("stragglers.collectives.cost_model", {"ring", "stragglar"}),
    "CONTROLLER_POLICIES": ("stragglers.adapt.controller", {"dd", "nd"}),
    "REMEDIES": ("stragglers.advice.remedies.tolerate", {"stragglar"}),
}
PROTOCOL = {"TRACE_READERS": protocols.TraceReader,
            "ALLREDUCE_ALGORITHMS": protocols.AllReduceAlgorithm}


@pytest.mark.parametrize("registry", sorted(REGISTRIES))
def test_implementations_are_registered(registry):
    module, expected = REGISTRIES[registry]
    importlib.import_module(module)
    reg = getattr(protocols, registry)
    assert expected <= set(reg.names()), (registry, reg.names())
    if registry in PROTOCOL:
        for name in reg:
            assert isinstance(reg.get(name), PROTOCOL[registry]), name
