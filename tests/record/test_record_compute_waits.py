"""attach() on CPU: a compute piece between two model-parallel collectives (an expert's compute
between its dispatch and its combine) carries its run delay in `cpu_wait`, from the schedstat
counters the two collectives read anyway, and its time on a CPU in `cpu_time` (read at the second
collective's end); every other row keeps NaN in both. Every row carries its step's process CPU
(`step_cpu`)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import REPO, torchrun

from stragglers.trace.model import OPTYPE_CODES
from stragglers.trace.runformat import read_run

MOE_EXAMPLE = REPO / "examples" / "train_moe.py"
A2A, GC = OPTYPE_CODES["all-to-all"], OPTYPE_CODES["gc"]
COMPUTE = (OPTYPE_CODES["forward-compute"], OPTYPE_CODES["backward-compute"])


@pytest.mark.distributed
def test_compute_between_two_all_to_alls_carries_its_run_delay(tmp_path):
    torchrun(MOE_EXAMPLE, 4, "--steps", "3", "--hot-expert", "2", "--routing-skew", "0.6",
             "--out", str(tmp_path / "run"), timeout=400)
    ops = read_run(tmp_path / "run").ops
    assert "cpu_time" in ops
    between = 0
    for r in np.unique(ops["rank"]):
        for s in np.unique(ops["step"]):
            idx = np.flatnonzero((ops["rank"] == r) & (ops["step"] == s) & (ops["optype"] != GC))
            idx = idx[np.argsort(ops["start_ts"][idx], kind="stable")]
            code = ops["optype"][idx]
            for j, i in enumerate(idx):
                if code[j] not in COMPUTE:
                    continue
                wait, on_cpu = ops["cpu_wait"][i], ops["cpu_time"][i]
                inside = 0 < j < len(idx) - 1 and code[j - 1] == A2A and code[j + 1] == A2A
                if not inside:
                    assert np.isnan(wait) and np.isnan(on_cpu), (r, s, j)
                    continue
                between += 1
                # read after the first all-to-all ended and before the next one began
                prev, nxt = idx[j - 1], idx[j + 1]
                window = ops["start_ts"][nxt] - (ops["start_ts"][prev] + ops["duration"][prev])
                assert 0 <= wait <= window + 1e-6, (r, s, j, wait, window)
                # on a CPU between the first all-to-all's end and the second's (the kernel's
                # count of a running thread may lag by a tick: 10 ms covers HZ ≥ 100)
                through = window + ops["duration"][nxt]
                assert 0 <= on_cpu <= through + 0.01, (r, s, j, on_cpu, through)
    # per rank and step: two layers' expert forward, and backward's pieces between them
    assert between >= 4 * 3 * 2
    # the collectives keep theirs
    assert np.isfinite(ops["cpu_wait"][ops["optype"] == A2A]).all()
    assert np.isnan(ops["cpu_time"][ops["optype"] == A2A]).all()
    # every row carries its step's process CPU: one value per rank and step, at least the
    # training thread's CPU in the pieces above (a tick of slack per piece: the count lags)
    assert np.isfinite(ops["step_cpu"]).all()
    for r in np.unique(ops["rank"]):
        for s in np.unique(ops["step"]):
            sel = (ops["rank"] == r) & (ops["step"] == s)
            assert len(np.unique(ops["step_cpu"][sel])) == 1, (r, s)
            pieces = ops["cpu_time"][sel]
            pieces = pieces[np.isfinite(pieces)]
            assert ops["step_cpu"][sel][0] >= pieces.sum() - 0.01 * len(pieces), (r, s)
