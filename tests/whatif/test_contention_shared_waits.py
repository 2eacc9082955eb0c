"""Transfers late at some carriers, within CPU waits that every carrier had as long: the host's
contention is everyone's and which transfers it made late the scheduler's, no place (four
ranks on one CPU: clean TP 3-D runs read a persistent cpu_contention on pipeline p2p at three
of the four ranks, the fourth having waited as long); waits only at the late ones stay
cpu_contention (tests/whatif/test_whatif_diagnosis.py)."""

import numpy as np

from stragglers.trace.model import OPTYPE_CODES as C, P2P_OPTYPES, Trace
from stragglers.trace.synth import generate
from stragglers.whatif import analyze

LINK = dict(dp=2, pp=4, microbatches=8, steps=8, seed=3,
            slow_link={"kind": "p2p", "dp": 1, "stage_from": 1, "stage_to": 2, "factor": 20})


def _waits(trace: Trace, everywhere: bool) -> Trace:
    """cpu_wait on the p2p rows: the slow transfers' time beyond the median on each of them,
    or (everywhere) that much on every transfer of every carrier."""
    ops = dict(trace.ops)
    p2p = np.isin(ops["optype"], [C[o] for o in P2P_OPTYPES])
    median = np.median(ops["duration"][p2p])
    slow = p2p & (ops["duration"] > 2 * median)
    excess = ops["duration"] - median
    wait = np.full(p2p.shape, float(np.max(excess[slow]))) if everywhere else \
        np.where(slow, excess, 0.0)
    ops["cpu_wait"] = np.where(p2p, wait, np.nan)
    return Trace(ops, trace.meta)


def test_lateness_within_waits_every_carrier_had_is_no_place():
    causes = {f.cause for f in analyze(_waits(generate(**LINK), everywhere=True)).diagnosis}
    assert not {"cpu_contention", "communication"} & causes, causes


def test_waits_at_the_late_carriers_alone_are_cpu_contention():
    causes = {f.cause for f in analyze(_waits(generate(**LINK), everywhere=False)).diagnosis}
    assert "cpu_contention" in causes and "communication" not in causes, causes
