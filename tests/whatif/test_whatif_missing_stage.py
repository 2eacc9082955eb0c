"""A trace whose layout has more stages than its rows hold is refused in one line naming the
stage, whichever stage is absent (the first stage alone failed deep in a cause detector, a
zero-size reduction, while the last stage alone was refused)."""

from __future__ import annotations

import pytest

from stragglers.errors import InputError
from stragglers.trace.synth import generate
from stragglers.whatif import analyze


@pytest.mark.parametrize("kept, absent", [(0, 1), (1, 0)])
def test_a_trace_of_one_stage_of_two_is_refused_naming_the_other(kept, absent):
    t = generate(dp=2, pp=2, microbatches=4, steps=4, seed=0)
    with pytest.raises(InputError, match=f"stage {absent} has no forward/backward-compute"):
        analyze(t.select(t.ops["stage"] == kept), steps="all")
