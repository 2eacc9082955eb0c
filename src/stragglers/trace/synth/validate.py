"""Checking the generator's parameters and writing down the injected ground truth."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from stragglers.errors import InputError
from stragglers.trace.model import COMPUTE_OPTYPES, OPTYPES, P2P_OPTYPES

SOURCE = "stragglers synth"
COLLECTIVE_OPTYPES = tuple(o for o in OPTYPES if o not in COMPUTE_OPTYPES + P2P_OPTYPES)
SEQ_DEFAULTS: dict[str, Any] = {"dist": "lognormal", "max_len": 16384, "min_len": 64,
                                "tokens_per_mb": 16384, "median_len": 1024, "sigma": 1.2}


def _int(params: dict, key: str, low: int = 1) -> int:
    v = params[key]
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
        raise InputError(SOURCE, key, f"expected an integer >= {low}, got {v!r}")
    return int(v)


def _positive(value, field: str, low: float = 0.0, strict: bool = True) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise InputError(SOURCE, field, f"expected a number, got {value!r}") from None
    if not np.isfinite(v) or v < low or (strict and v == low):
        raise InputError(SOURCE, field, f"expected a finite number {'>' if strict else '>='} "
                         f"{low}, got {value!r}")
    return v


def _index(value, field: str, size: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < size:
        raise InputError(SOURCE, field, f"{what} {value!r} is out of range; expected 0..{size - 1}")
    return int(value)


def validate_parameters(p: dict) -> dict:
    """Check sizes and injections; return a JSON-friendly copy with defaults filled in."""
    for key in ("dp", "pp", "vpp", "microbatches", "steps"):
        p[key] = _int(p, key)
    p["seed"] = _int(p, "seed", 0)
    if p["sync"] not in ("zero", "ddp"):
        raise InputError(SOURCE, "sync", f"expected 'zero' or 'ddp', got {p['sync']!r}")
    if p["vpp"] > 1 and p["pp"] < 2:
        raise InputError(SOURCE, "vpp", "an interleaved schedule (vpp > 1) needs pp >= 2")
    if p["vpp"] > 1 and p["microbatches"] % p["pp"]:
        raise InputError(SOURCE, "microbatches", f"the interleaved schedule needs a multiple of "
                         f"pp={p['pp']} microbatches, got {p['microbatches']}")
    p["noise"] = _positive(p["noise"], "noise", strict=False)
    p["launch_delay"] = _positive(p["launch_delay"], "launch_delay", strict=False)
    p["step_gap"] = _positive(p["step_gap"], "step_gap", strict=False)
    if p["slow_worker"] is not None:
        try:
            d, s, f = p["slow_worker"]
        except (TypeError, ValueError):
            raise InputError(SOURCE, "slow_worker", "expected (dp_rank, stage, factor)") from None
        p["slow_worker"] = [_index(d, "slow_worker", p["dp"], "dp rank"),
                            _index(s, "slow_worker", p["pp"], "stage"),
                            _positive(f, "slow_worker factor")]
    if p["heavy_last_stage"] is not None:
        p["heavy_last_stage"] = _positive(p["heavy_last_stage"], "heavy_last_stage")
        if p["pp"] == 1:
            warnings.warn("heavy_last_stage with pp=1 slows the only stage: every worker is "
                          "equally slow, so it is no imbalance", stacklevel=3)
    if p["seq_imbalance"] is not None:
        p["seq_imbalance"] = _seq_imbalance(p["seq_imbalance"])
    if p["gc"] is not None:
        try:
            rate, length = p["gc"]
        except (TypeError, ValueError):
            raise InputError(SOURCE, "gc", "expected (pauses per worker per step, "
                             "pause seconds)") from None
        p["gc"] = [_positive(rate, "gc rate"), _positive(length, "gc length")]
        forwards = p["microbatches"] * p["vpp"]
        if p["gc"][0] > forwards:
            warnings.warn(f"gc rate {p['gc'][0]} exceeds the {forwards} forwards per step; "
                          f"every forward gets a pause (rate capped at {forwards})", stacklevel=3)
    if p["slow_link"] is not None:
        p["slow_link"] = _slow_link(p["slow_link"], p)
    if p["host_stall"] is not None:
        p["host_stall"] = _host_stall(p["host_stall"], p)
    if p["gc_in_compute"] is not None:
        try:
            rate, length = p["gc_in_compute"]
        except (TypeError, ValueError):
            raise InputError(SOURCE, "gc_in_compute", "expected (pauses per worker per step, "
                             "pause seconds)") from None
        p["gc_in_compute"] = [_positive(rate, "gc_in_compute rate"),
                              _positive(length, "gc_in_compute length")]
    if p["stage_scale"] is not None:
        scale = p["stage_scale"]
        if not isinstance(scale, (list, tuple)) or len(scale) != p["pp"]:
            raise InputError(SOURCE, "stage_scale", f"expected one factor per stage "
                             f"({p['pp']} numbers), got {scale!r}")
        p["stage_scale"] = [_positive(f, "stage_scale") for f in scale]
    return p


def _steps_list(value, field: str, p: dict):
    if value is None:
        return None
    try:
        steps = sorted({_index(s, field, p["steps"], "step") for s in value})
    except TypeError:
        raise InputError(SOURCE, field, "expected a list of step numbers") from None
    if not steps:
        raise InputError(SOURCE, field, "is empty; give at least one step or None for every step")
    return steps


def _host_stall(stall, p: dict) -> dict:
    if not isinstance(stall, dict) or set(stall) - {"dp", "stage", "seconds", "steps"}:
        raise InputError(SOURCE, "host_stall", "expected {'dp', 'stage', 'seconds', 'steps' "
                         f"(optional)}}, got {stall!r}")
    return {"dp": _index(stall.get("dp"), "host_stall dp", p["dp"], "dp rank"),
            "stage": _index(stall.get("stage"), "host_stall stage", p["pp"], "stage"),
            "seconds": _positive(stall.get("seconds"), "host_stall seconds"),
            "steps": _steps_list(stall.get("steps"), "host_stall steps", p)}


def _seq_imbalance(cfg) -> dict:
    if isinstance(cfg, str):
        cfg = {"dist": cfg}
    if not isinstance(cfg, dict):
        raise InputError(SOURCE, "seq_imbalance", f"expected a dict or a distribution name, "
                         f"got {cfg!r}")
    unknown = set(cfg) - set(SEQ_DEFAULTS)
    if unknown:
        raise InputError(SOURCE, "seq_imbalance", f"unknown keys {sorted(unknown)}; expected "
                         f"{sorted(SEQ_DEFAULTS)}")
    out = {**SEQ_DEFAULTS, **cfg}
    if out["dist"] not in ("lognormal", "uniform"):
        raise InputError(SOURCE, "seq_imbalance.dist", f"expected 'lognormal' or 'uniform', "
                         f"got {out['dist']!r}")
    for key in ("max_len", "min_len", "tokens_per_mb"):
        out[key] = int(_positive(out[key], f"seq_imbalance.{key}", low=1, strict=False))
    if out["min_len"] > out["max_len"]:
        raise InputError(SOURCE, "seq_imbalance.min_len", f"{out['min_len']} exceeds max_len "
                         f"{out['max_len']}")
    out["median_len"] = _positive(out["median_len"], "seq_imbalance.median_len")
    out["sigma"] = _positive(out["sigma"], "seq_imbalance.sigma", strict=False)
    return out


def _slow_link(link, p: dict) -> dict:
    if not isinstance(link, dict) or link.get("kind") not in ("p2p", "collective"):
        raise InputError(SOURCE, "slow_link", "expected {'kind': 'p2p', 'dp', 'stage_from', "
                         "'stage_to', 'factor'} or {'kind': 'collective', 'optype', 'stage', "
                         "'factor'}")
    unknown = set(link) - {"kind", "factor", "steps", "dp", "stage_from", "stage_to", "optype",
                           "stage"}
    if unknown:
        raise InputError(SOURCE, "slow_link", f"unknown keys {sorted(unknown)}")
    out = {"kind": link["kind"], "factor": _positive(link.get("factor"), "slow_link factor"),
           "steps": None}
    if link.get("steps") is not None:
        try:
            out["steps"] = sorted({_index(s, "slow_link steps", p["steps"], "step")
                                   for s in link["steps"]})
        except TypeError:
            raise InputError(SOURCE, "slow_link steps", "expected a list of step numbers") from None
        if not out["steps"]:
            raise InputError(SOURCE, "slow_link steps", "is empty; give at least one step or None "
                             "for every step")
    if link["kind"] == "p2p":
        if p["pp"] < 2:
            raise InputError(SOURCE, "slow_link", "a p2p link needs pp >= 2 (no pipeline p2p)")
        out["dp"] = _index(link.get("dp"), "slow_link dp", p["dp"], "dp rank")
        a = _index(link.get("stage_from"), "slow_link stage_from", p["pp"], "stage")
        b = _index(link.get("stage_to"), "slow_link stage_to", p["pp"], "stage")
        ring = p["vpp"] > 1 and {a, b} == {0, p["pp"] - 1}
        if abs(a - b) != 1 and not ring:
            raise InputError(SOURCE, "slow_link", f"stages {a} and {b} are not pipeline "
                             "neighbours, so no p2p traffic passes between them")
        out["stage_from"], out["stage_to"] = a, b
        return out
    optype = link.get("optype")
    if optype not in COLLECTIVE_OPTYPES:
        raise InputError(SOURCE, "slow_link optype", f"expected one of "
                         f"{', '.join(COLLECTIVE_OPTYPES)}, got {optype!r}")
    present = _collectives_present(p)
    if optype not in present:
        raise InputError(SOURCE, "slow_link optype", f"{optype} does not occur in this job "
                         f"(sync={p['sync']}, pp={p['pp']}); it has {', '.join(present)}")
    stage = link.get("stage")
    if optype == "embedding-grads-all-reduce" and stage not in (None, 0, p["pp"] - 1):
        raise InputError(SOURCE, "slow_link stage", "embedding-grads-all-reduce runs only on "
                         f"stages 0 and {p['pp'] - 1}")
    out["optype"] = optype
    out["stage"] = None if stage is None else _index(stage, "slow_link stage", p["pp"], "stage")
    return out


def _collectives_present(p: dict) -> list[str]:
    names = ["params-all-gather", "grads-reduce-scatter"] if p["sync"] == "zero" \
        else ["grads-all-reduce"]
    if p["pp"] > 1:
        names += ["layernorm-grads-all-reduce", "embedding-grads-all-reduce",
                  "optimizer-clip-main-grad"]
    return names


def ground_truth(p: dict, costs, impacts: dict | None) -> list[dict]:
    """The injected causes as [{cause, where, params, impact}], what a diagnosis should find.

    impact = mean step time with the cause / without it (None for jobs too big to measure).
    """
    truth = []

    def add(key: str, cause: str, where: dict, params: dict) -> None:
        impact = None if impacts is None else round(impacts[key], 6)
        truth.append({"cause": cause, "where": where, "params": params, "impact": impact})

    if p["slow_worker"] is not None:
        d, s, f = p["slow_worker"]
        add("slow_worker", "worker_fault", {"dp": [d], "pp": [s]}, {"factor": f})
    if p["heavy_last_stage"] is not None:
        add("heavy_last_stage", "stage_imbalance", {"pp": [p["pp"] - 1]},
            {"factor": p["heavy_last_stage"]})
    if p["seq_imbalance"] is not None:
        add("seq_imbalance", "sequence_imbalance", {},
            {**p["seq_imbalance"], "attn_cost_cv": costs.notes["attn_cost_cv"],
             "cost_cv": costs.notes["cost_cv"]})
    if p["gc"] is not None:
        active = costs.gc_active
        slot_stage = costs.gc_slot_stage
        cols = np.flatnonzero(active.any(axis=0))
        where = {"dp": sorted(set((cols % p["dp"]).tolist())),
                 "pp": sorted(set(slot_stage[active.any(axis=1)].tolist())),
                 "steps": sorted(set((cols // p["dp"]).tolist()))}
        add("gc", "gc", where, {"rate": p["gc"][0], "length_s": p["gc"][1],
                                "pauses": int(active.sum()),
                                "pause_s": float(costs.duration[costs.gc_rows][active].sum())})
    if p["slow_link"] is not None:
        link = p["slow_link"]
        if link["kind"] == "p2p":
            where = {"dp": [link["dp"]], "pp": sorted([link["stage_from"], link["stage_to"]])}
            optypes = ["forward-send", "forward-recv", "backward-send", "backward-recv"]
        else:
            where = {"pp": list(range(p["pp"])) if link["stage"] is None else [link["stage"]]}
            optypes = [link["optype"]]
        if link["steps"] is not None:
            where["steps"] = link["steps"]
        add("slow_link", "communication", where, {**link, "optypes": optypes})
    if p["host_stall"] is not None:
        stall = p["host_stall"]
        where = {"dp": [stall["dp"]], "pp": [stall["stage"]]}
        if stall["steps"] is not None:
            where["steps"] = stall["steps"]
        add("host_stall", "host_stall", where, {"seconds": stall["seconds"]})
    if p["gc_in_compute"] is not None:
        _, active, stages = costs.pause_cells
        cols = np.flatnonzero(active.any(axis=0))
        where = {"dp": sorted(set((cols % p["dp"]).tolist())),
                 "pp": sorted(set(stages[active.any(axis=1)].tolist())),
                 "steps": sorted(set((cols // p["dp"]).tolist()))}
        add("gc_in_compute", "gc", where, {"rate": p["gc_in_compute"][0],
                                           "length_s": p["gc_in_compute"][1],
                                           "pauses": int(active.sum()), "in_compute": True})
    return truth
