"""Synthetic pipeline jobs recorded per schedule action (as record/pipelining.py writes them).

Each rank runs its action list on one thread, as torch.distributed.pipelining does: a receive
is posted right after the rank's previous action and waited before the compute that needs it,
a send is posted right after the compute that produced it; transfers of one op type on one rank
go out in order (one starts when the previous ended), a send/recv pair ends at the later of the
two starts plus the transfer time. Split backward: I sends the input gradient, W sends nothing.
Rows use the per-action conventions (compute gmc = stage index, transfer gmc = the peer's).
"""

from __future__ import annotations

import numpy as np

from stragglers.trace.model import JobMeta, Trace

COST = {"F": 0.010, "B": 0.020, "I": 0.010, "W": 0.010}
OPTYPE = {"F": "forward-compute", "B": "backward-compute", "I": "backward-compute",
          "W": "backward-weight-compute"}


def single_orders(pp: int, microbatches: int, kind: str) -> dict[int, list[tuple[str, int, int]]]:
    """Per-rank (action, stage, microbatch) lists, one stage per rank: gpipe, 1f1b or zb (ZB-H1:
    1F1B with backward split into I and a W deferred by pp−1−rank microbatches)."""
    orders = {}
    for r in range(pp):
        if kind == "gpipe":
            acts = [("F", r, m) for m in range(microbatches)] + [("B", r, m) for m in range(microbatches)]
        else:
            warm = min(pp - r - 1, microbatches)
            seq = [("F", m) for m in range(warm)]
            for i in range(microbatches - warm):
                seq += [("F", warm + i), ("B", i)]
            seq += [("B", m) for m in range(microbatches - warm, microbatches)]
            acts = []
            lag, done = pp - 1 - r, []
            for a, m in seq:
                if a == "F" or kind == "1f1b":
                    acts.append((a, r, m))
                    continue
                acts.append(("I", r, m))
                done.append(m)
                if len(done) > lag:
                    acts.append(("W", r, done.pop(0)))
            acts += [("W", r, m) for m in done]
        orders[r] = acts
    return orders


def looped_orders(pp: int, microbatches: int) -> dict[int, list[tuple[str, int, int]]]:
    """Two stages per rank (r and r+pp), breadth first as ScheduleLoopedBFS runs them."""
    orders = {}
    for r in range(pp):
        acts = [("F", s, m) for s in (r, r + pp) for m in range(microbatches)]
        acts += [("B", s, m) for s in (r + pp, r) for m in range(microbatches)]
        orders[r] = acts
    return orders


def action_trace(orders: dict[int, list[tuple[str, int, int]]], steps: int = 4, *,
                 transfer: float = 0.001, gap: float = 0.0005, slow: dict | None = None,
                 seed: int = 0, name: str = "synthetic-actions") -> Trace:
    """Simulate the action lists for `steps` steps and return the op table.

    `slow`: {stage index: factor} multiplies that stage's compute; every action is followed by
    a random host gap (uniform 0..2·gap) that the replay sees as launch delay.
    """
    rng = np.random.default_rng(seed)
    slow = slow or {}
    pp = len(orders)
    rank_of = {s: r for r, acts in orders.items() for _a, s, _m in acts}
    n_stages = max(rank_of) + 1
    local = {r: sorted({s for _a, s, _m in acts}) for r, acts in orders.items()}
    rows: list[tuple] = []
    t0 = 0.0
    for step in range(steps):
        sim = _Transfers(t0, transfer)
        clock = {r: t0 for r in orders}
        pos = {r: 0 for r in orders}
        posted: set = set()
        progressed = True
        while progressed:
            progressed = False
            for r, acts in orders.items():
                while pos[r] < len(acts):
                    a, s, m = acts[pos[r]]
                    need = None                     # the transfer this compute waits for
                    if a == "F" and s > 0 and rank_of[s - 1] != r:
                        need = ("forward", s - 1, s, m)
                    elif a in ("B", "I") and s < n_stages - 1 and rank_of[s + 1] != r:
                        need = ("backward", s + 1, s, m)
                    if need is not None:
                        if need not in posted:      # post the receive right away
                            posted.add(need)
                            sim.post(need, "recv", r, clock[r])
                            clock[r] += 1e-5
                        if need not in sim.end:
                            break                   # blocked until the peer sends
                        clock[r] = max(clock[r], sim.end[need])
                    c0 = clock[r] + rng.uniform(0, 2 * gap)
                    dur = COST[a] * slow.get(s, 1.0) * rng.uniform(0.95, 1.05)
                    rows.append((r, step, OPTYPE[a], c0, dur, m, local[r].index(s), s))
                    clock[r] = c0 + dur
                    send = None
                    if a == "F" and s < n_stages - 1 and rank_of[s + 1] != r:
                        send = ("forward", s, s + 1, m)
                    elif a in ("B", "I") and s > 0 and rank_of[s - 1] != r:
                        send = ("backward", s, s - 1, m)
                    if send is not None:
                        clock[r] += rng.uniform(0, 2 * gap)
                        sim.post(send, "send", r, clock[r])
                        clock[r] += 1e-5
                    pos[r] += 1
                    progressed = True
        if any(pos[r] < len(acts) for r, acts in orders.items()):
            raise ValueError("the action lists deadlock: a receive has no matching send")
        for (tid, side), st in sim.start.items():
            kind, src, dst, mb = tid
            own, peer = (src, dst) if side == "send" else (dst, src)
            r = rank_of[own]
            rows.append((r, step, f"{kind}-{side}", st, sim.end[tid] - st, mb,
                         local[r].index(own), peer))
        ends = []
        for r in orders:
            mine = [x for x in rows if x[0] == r and x[1] == step and x[2].endswith("compute")]
            c0 = max(x[3] + x[4] for x in mine) + rng.uniform(0, 2 * gap)
            rows.append((r, step, "optimizer", c0, 0.005, -1, 0, r))
            ends.append(c0 + 0.005)
        t0 = max(max(ends), max(sim.end.values(), default=t0)) + 0.002
    return _to_trace(rows, pp, max(len(v) for v in local.values()), steps, name)


class _Transfers:
    """Posted transfers: one op type on one rank is a stream (each starts when the previous
    ended, or at its post); a pair ends at the later start plus the transfer time."""

    def __init__(self, t0: float, transfer: float):
        self.t0, self.transfer = t0, transfer
        self.post_at: dict = {}
        self.start: dict = {}
        self.end: dict = {}
        self.streams: dict = {}

    def post(self, tid: tuple, side: str, rank: int, t: float) -> None:
        """Post one side of transfer `tid` at time t, then settle what can be settled."""
        self.post_at[(tid, side)] = t
        self.streams.setdefault((rank, tid[0], side), []).append(tid)
        changed = True
        while changed:
            changed = False
            for (_r, _k, sd), lst in self.streams.items():
                prev = self.t0
                for x in lst:
                    if (x, sd) not in self.start:
                        self.start[(x, sd)] = max(self.post_at[(x, sd)], prev)
                        changed = True
                    if x not in self.end:
                        if (x, "send") in self.start and (x, "recv") in self.start:
                            self.end[x] = max(self.start[(x, "send")],
                                              self.start[(x, "recv")]) + self.transfer
                            changed = True
                        else:
                            break
                    prev = self.end[x]


def _to_trace(rows, pp, vpp, steps, name) -> Trace:
    rows.sort(key=lambda x: (x[0], x[1], x[3]))
    seq: dict[tuple, int] = {}
    cols: dict[str, list] = {k: [] for k in ("rank", "dp_rank", "stage", "step", "optype", "start_ts", "duration",
                            "seq_id", "mb_id", "mc", "gmc")}
    for r, st, op, s, d, mb, mc, gmc in rows:
        k = (r, st, op)
        seq[k] = seq.get(k, -1) + 1
        for col, v in zip(cols, (r, 0, r, st, op, s, d, seq[k], mb, mc, gmc)):
            cols[col].append(v)
    meta = JobMeta(name=name, dp_size=1, pp_size=pp, vpp_size=vpp,
                   extra={"recorded_by": "synthetic-actions"})
    return Trace.from_rows(cols, meta)
