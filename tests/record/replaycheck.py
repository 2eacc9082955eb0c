"""What a replay of a recorded job must reproduce, whatever the machine's load.

Replayed with its measured costs and launch delays, a recorded job comes out exactly as
recorded wherever the record keeps the dependency model's rules: each op starts after its
dependencies ended and each transfer ends after both of its ends were posted. A real gloo job
breaks the second rule in two ways, both seen on this machine:

- a small send completes once its bytes are buffered, before the peer posts the receive (a
  send done 0.9 ms before its receive was posted, quiet and loaded);
- a send posted while the previous one of its direction was in flight is recorded from that
  one's end (the model's in-order stream), and that end is stamped when the waiter thread
  gets it back; under load a late stamp put a send's start after its receive had ended.

The model ends such a transfer at its last end's post, and what depends on it moves later by
up to the gap, which grows with the load (a rank descheduled longer): a loaded run's sim_error
has no fixed bound. The check is the exact statement instead: only ops downstream of such a
transfer may move, and only later.

It holds the replay against the trace's own rows, not the engine's grid: the engine cuts or
moves rows its model says no worker can have run so (whatif/timing.py), and its replay then
reproduces those edited rows, not the record. A record that breaks the first rule (an op
started before its dependency ended) is what the check refuses, whatever the engine made of
it.
"""

from __future__ import annotations

import numpy as np

from stragglers.trace.model import OPTYPES
from stragglers.whatif import analyze_with_model
from stragglers.whatif._replay import replay

# Row times are float seconds from a whole-second origin: equal to within float error.
TOL = 1e-7


def torn_transfers(w, start: np.ndarray, end: np.ndarray, own: np.ndarray) -> np.ndarray:
    """[N, D, T] bool: transfer rows that ended before the latest post of their group (one end
    done before the other end started: the record breaks the model's transfer rule), read from
    the recorded `start` and `end` of the cells `own` holds (`recorded`)."""
    m = w.model
    out = np.zeros(start.shape, dtype=bool)
    for members in m.groups:
        if len(members) < 2:
            continue
        last_post = np.max(np.where(own[members], start[members], -np.inf), axis=0)
        for k in members:
            out[k] = own[k] & (end[k] < last_post - TOL)
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


def recorded(trace, w) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """([N, D, T] start, end as the trace recorded them, [N, D, T] bool: the cells holding a
    row of their own worker): a cell the engine rebuilt borrows a peer's row and is skipped."""
    g = w.grid
    row = np.where(g.present, g.row, -1)
    own = (row >= 0) & (np.asarray(trace.ops["dp_rank"])[np.maximum(row, 0)]
                        == g.dp_ranks[None, :, None])
    start = np.where(own, np.asarray(trace.ops["start_ts"], dtype=np.float64)[row], np.nan)
    end = start + np.where(own, np.asarray(trace.ops["duration"], dtype=np.float64)[row], 0.0)
    return start, end, own


def check_replay(trace, steps: list[int] | str | None = None) -> dict:
    """Assert the exact replay statement on `trace` (on `steps`, as analyze takes them: "all"
    keeps the warm-up steps): each row's replayed start and end are its recorded ones; return
    its analysis ("result", "whatif") and counts for the caller's message."""
    result, w = analyze_with_model(trace, steps)
    g = w.grid
    _, start_replay, end_replay = replay(w.plan, w.cost, w.step_start, w.launch_delay,
                                         keep_timeline=True)
    start, end, own = recorded(trace, w)
    moved = own & ((np.abs(end_replay - end) > TOL) | (np.abs(start_replay - start) > TOL))
    assert not np.any(own & (end_replay < end - TOL)), "the replay ended an op early"
    assert not np.any(own & (start_replay < start - TOL)), "the replay started an op early"
    torn = torn_transfers(w, start, end, own)
    for d in range(end.shape[1]):
        for t in range(end.shape[2]):
            may = downstream(w, torn[:, d, t])
            stray = np.flatnonzero(moved[:, d, t] & ~may)
            assert len(stray) == 0, (
                f"step {g.steps[t]}: ops {[OPTYPES[g.node_optype[n]] for n in stray]} replayed "
                f"off their record with no torn transfer upstream")
    exact = ~torn.any(axis=0).any(axis=0)                     # [T]: steps without them
    assert np.allclose(w.t_replay[exact], w.t_base[exact], rtol=0, atol=TOL)
    return {"sim_error": result.sim_error, "torn_transfers": int(torn.sum()),
            "exact_steps": int(exact.sum()), "steps": len(exact), "result": result,
            "whatif": w}
