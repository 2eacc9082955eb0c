"""Each injection of examples/train_gpt.py, run for real and analysed, is diagnosed as its cause.

The slow-rank injection (worker_fault) is checked in test_record_distributed.py on its shared run.
"""

from __future__ import annotations

import pytest
from conftest import REPO, torchrun

from stragglers.trace.runformat import read_run

TRAIN = REPO / "examples" / "train_gpt.py"
pytestmark = pytest.mark.distributed

# (name, processes, train_gpt arguments, expected cause, expected place {dp: [...], pp: [...]})
CASES = [
    # more steps: one load spike on a shared machine weighs less in S
    pytest.param("none", 2, ["--pp", "1", "--steps", "16"], "none", None, id="none"),
    pytest.param("stage_imbalance", 4, ["--pp", "2", "--extra-last-stage-layers", "4"],
                 "stage_imbalance", {"pp": [1]}, id="stage_imbalance"),
    pytest.param(
        "sequence_imbalance", 2, ["--pp", "1", "--seq-len-dist", "lognormal", "--max-seq-len",
                                  "1024", "--microbatches", "2"], "sequence_imbalance", None,
        id="sequence_imbalance"),
    pytest.param("gc", 2, ["--pp", "1", "--gc-garbage", "40"], "gc", None, id="gc"),
    # a slow link needs most messages of its op type unaffected: pp 4 × dp 1 in 4 processes
    pytest.param(
        "communication", 4, ["--pp", "4", "--layers", "4", "--comm-delay-rank", "1",
                             "--comm-delay-ms", "30"], "communication", {"pp": [1, 2]},
        id="communication"),
]


@pytest.mark.parametrize("name,nproc,args,cause,where", CASES)
def test_injection_is_diagnosed_at_its_place(tmp_path, name, nproc, args, cause, where):
    from stragglers.whatif.analyze import analyze

    # Timings come from a shared 2-core machine: a load spike from outside the job can make a
    # clean run look straggling, so the clean case gets a second, independent run.
    for attempt in range(2 if cause == "none" else 1):
        out = tmp_path / f"trace-{attempt}"
        torchrun(TRAIN, nproc, "--steps", "8", *args, "--trace-dir", str(out), timeout=300)
        trace = read_run(out)
        assert [i["cause"] for i in trace.meta.extra["injections"]] == \
            ([] if cause == "none" else [cause])
        result = analyze(trace)
        causes = [d["cause"] for d in result["diagnosis"]]
        if causes[0] == cause:
            break
    assert causes[0] == cause, (causes, result["slowdown"], result["diagnosis"])
    top = result["diagnosis"][0]
    for axis, values in (where or {}).items():
        assert set(values) <= set(top["where"].get(axis, [])), top
    if cause != "none":
        assert top["speedup_if_fixed"] is not None and top["speedup_if_fixed"] > 1.0
