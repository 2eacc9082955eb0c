"""Two analysis results compared number by number (the partitioned paths against one process)."""

from __future__ import annotations

import json
import math

# Synthetic jobs (generate() keywords) both partitioned paths are compared on, one per shape of
# dependency the partitions must keep: virtual stages, intermittent p2p, launch delays + Σs².
PARTITION_JOBS = {
    "heavy last stage, vpp 2": dict(dp=2, pp=4, vpp=2, microbatches=8, steps=5,
                                    heavy_last_stage=1.4, seed=5),
    "slow link on some steps": dict(dp=4, pp=2, microbatches=4, steps=8, seed=7,
                                    slow_link={"kind": "p2p", "dp": 2, "stage_from": 0,
                                               "stage_to": 1, "factor": 30.0, "steps": [2, 3, 5]}),
    "host stall + sequences": dict(dp=4, pp=2, microbatches=4, steps=6, seed=9,
                                   host_stall={"dp": 3, "stage": 0, "seconds": 0.02},
                                   seq_imbalance={"dist": "lognormal", "max_len": 4096,
                                                  "tokens_per_mb": 8192}),
}


def assert_same(reference, other) -> None:
    """Every number of the two results within 1e-9 (relative), everything else equal."""
    a, b = json.loads(reference.to_json()), json.loads(other.to_json())
    assert math.isclose(a["slowdown"], b["slowdown"], rel_tol=0, abs_tol=1e-9)
    close(a, b, "result")


def close(a, b, where: str) -> None:
    """Numbers within 1e-9 (relative), anything else equal, recursively; `where` names the place."""
    if isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12), (where, a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            close(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)
