"""What a replay of a recorded job must reproduce, whatever the machine's load.

Replayed with its measured costs and launch delays, a recorded job comes out exactly as
recorded wherever the record keeps the dependency model's rules: each op starts after its
dependencies ended and each transfer ends after both of its ends were posted. gloo breaks the
second rule by itself: a small send completes once its bytes are buffered, before the peer
posts the receive (seen quiet and loaded: a send done 0.9 ms before its receive was posted).
The model then ends that send at the receive's post, and what depends on it moves later by up
to the gap, which grows with the load (the receiver is descheduled longer): a loaded run's
sim_error is not bounded by any fixed figure. The check is the exact statement instead: only
ops downstream of such a send may move, and only later.
"""

from __future__ import annotations

import numpy as np

from stragglers.trace.model import OPTYPES
from stragglers.whatif import analyze_with_model
from stragglers.whatif._replay import replay

# Row times are float seconds from a whole-second origin: equal to within float error.
TOL = 1e-7


def early_sends(w) -> np.ndarray:
    """[N, D, T] bool: sends that completed before the latest post of their transfer group."""
    g, m = w.grid, w.model
    end = g.start + g.duration
    out = np.zeros(g.start.shape, dtype=bool)
    for members in m.groups:
        first = np.max(np.where(g.present[members], g.start[members], -np.inf), axis=0)
        for k in members:
            if OPTYPES[g.node_optype[k]].endswith("send"):
                out[k] = g.present[k] & (end[k] < first - TOL)
    return out


def downstream(w, seeds: np.ndarray) -> np.ndarray:
    """[N] bool: `seeds` ([N] bool) and every op that waits on them, through dependencies and
    transfer groups (a group starts when its last member is posted)."""
    m = w.model
    users: dict[int, list[int]] = {}
    for n, deps in enumerate(m.deps):
        for k in deps:
            users.setdefault(int(k), []).append(n)
    reach = seeds.copy()
    todo = list(np.flatnonzero(seeds))
    while todo:
        n = int(todo.pop())
        nxt = list(users.get(n, []))
        if m.group_of[n] >= 0:
            nxt += [int(x) for x in m.groups[m.group_of[n]]]
        for x in nxt:
            if not reach[x]:
                reach[x] = True
                todo.append(x)
    return reach


def check_replay(trace) -> dict:
    """Assert the exact replay statement on `trace`; return counts for the caller's message."""
    result, w = analyze_with_model(trace)
    g = w.grid
    _, _, end_replay = replay(w.plan, w.cost, w.step_start, w.launch_delay, keep_timeline=True)
    end = g.start + g.duration
    moved = g.present & (np.abs(end_replay - end) > TOL)
    assert not np.any(g.present & (end_replay < end - TOL)), "the replay ended an op early"
    early = early_sends(w)
    for d in range(end.shape[1]):
        for t in range(end.shape[2]):
            may = downstream(w, early[:, d, t])
            stray = np.flatnonzero(moved[:, d, t] & ~may)
            assert len(stray) == 0, (
                f"step {g.steps[t]}: ops {[OPTYPES[g.node_optype[n]] for n in stray]} replayed "
                f"off their record with no early send upstream")
    exact = ~early.any(axis=0).any(axis=0)                    # [T]: steps without early sends
    assert np.allclose(w.t_replay[exact], w.t_base[exact], rtol=0, atol=TOL)
    return {"sim_error": result.sim_error, "early_sends": int(early.sum()),
            "exact_steps": int(exact.sum()), "steps": len(exact), "result": result}
