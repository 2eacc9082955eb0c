"""Hand-built analysis results shaped like the `stragglers analyze --json` output."""

from __future__ import annotations

import json
from typing import Any


def straggling_result() -> dict[str, Any]:
    """A dp 4 × pp 4 job with a slow last stage and one faulty worker (dp 2, pp 1)."""
    by_dp = {0: 1.21, 1: 1.20, 2: 1.42, 3: 1.22}
    by_pp = {0: 1.00, 1: 1.38, 2: 0.99, 3: 1.23}
    steps = [3, 7, 12, 15, 21, 30, 33, 41]
    step_s = [1.44, 1.45, 1.47, 1.43, 1.61, 1.44, 1.46, 1.42]
    return {
        "job": {"name": "gpt-13b-run7", "dp": 4, "pp": 4, "tp": 2, "world_size": 32,
                "steps": len(steps), "ops": 48_512},
        "slowdown": 1.452,
        "waste": 1 - 1 / 1.452,
        "sim_error": 0.008,
        "launch_slowdown": 1.019,
        "T_base": 2.734, "T_nodelay": 2.683, "T_ideal": 1.848,
        "step_slowdown": dict(zip(steps, step_s)),
        "by_optype": {"forward-compute": 1.18, "backward-compute": 1.21, "optimizer": 1.0,
                      "forward-pp-comm": 1.02, "backward-pp-comm": 1.01,
                      "grads-reduce-scatter": 1.04},
        "by_stage": by_pp,
        "by_dp_rank": by_dp,
        "worker_scores": [{"dp": d, "pp": p, "score": min(by_dp[d], by_pp[p])}
                          for d in by_dp for p in by_pp],
        "M_W": 0.61,
        "M_S": 0.44,
        "diagnosis": [
            {"cause": "worker_fault", "where": {"dp": [2], "pp": [1]},
             "evidence": "worker dp 2 / pp 1 has S_w 1.38, 0.17 above the next worker, "
                         "in 8 of 8 steps",
             "speedup_if_fixed": 1.25},
            {"cause": "stage_imbalance", "where": {"pp": [3]},
             "evidence": "M_S = 0.44; the last stage alone gives S 1.23",
             "speedup_if_fixed": 1.12, "interval": [1.10, 1.14], "upper_bound": True,
             "share": 0.31, "speedup_after_others": 1.08},
            {"cause": "host_stall", "where": {"workers": [{"dp": 1, "pp": 0, "rank": 4,
                                                           "host": "node-3"}]},
             "evidence": "rank 4 starts each step 80 ms late", "speedup_if_fixed": 1.05,
             "interval": [1.04, 1.06], "upper_bound": False, "share": 1.3},
            {"cause": "gc", "where": {"dp": [0, 3], "pp": [2], "steps": [21]},
             "evidence": "one 160 ms forward-compute at step 21", "speedup_if_fixed": None},
        ],
        "diagnosis_summary": {"all_fixed": 1.41, "all_fixed_interval": [1.38, 1.44],
                              "explained": 0.83, "unexplained": 0.17, "noise_floor": 1.01},
        "warnings": ["2 p2p ops were recorded but never launched; treated as no-ops"],
        "notes": [{"kind": "ranks", "message": "2 of 128 ranks read; missing ranks 2-127"},
                  {"kind": "clock", "message": "clock alignment residual 0.4 ms"}],
    }


def clean_result() -> dict[str, Any]:
    """A healthy job: S < 1.03, so the decomposition keys are empty or null."""
    return {
        "job": {"name": "resnet-ddp", "dp": 8, "pp": 1, "tp": 1, "world_size": 8,
                "steps": 4, "ops": 640},
        "slowdown": 1.012, "waste": 1 - 1 / 1.012, "sim_error": 0.003,
        "launch_slowdown": 1.001,
        "step_slowdown": {1: 1.01, 2: 1.013, 3: 1.012, 4: 1.011},
        "by_optype": {}, "by_stage": {}, "by_dp_rank": {}, "worker_scores": [],
        "M_W": None, "M_S": None,
        "diagnosis": [{"cause": "none", "where": {}, "evidence": "S = 1.012 < 1.1",
                       "speedup_if_fixed": None}],
    }


def json_round_trip(result: dict[str, Any]) -> dict[str, Any]:
    """The result as a JSON reader sees it (integer map keys become strings)."""
    return json.loads(json.dumps(result))
