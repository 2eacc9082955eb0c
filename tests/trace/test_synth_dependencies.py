"""The generated traces obey the replay engine's dependency model (docs/whatif.md §3).

The checker rebuilds the dependencies from the op table alone (as a replay engine must) and
asserts every one holds: then each launch delay is >= 0 and each group member ends at or after
the group's latest start, which is exactly what makes a replay with the measured launch delays
reproduce the measured step times.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from stragglers.trace.model import OPTYPES, STREAM_OF_OPTYPE, STREAMS
from stragglers.trace.synth import generate
from stragglers.trace.synth.schedule import BASE_COST

TOL = 1e-9
# layernorm-grads-all-reduce runs in the untraced TP group: a plain op on the DP-comm stream.
DP_SYNC = ("params-all-gather", "grads-reduce-scatter", "grads-all-reduce")


def worker_steps(trace):
    """{(dp, stage, step): {optype name: row indices in start order}} and all rows per key."""
    o = trace.ops
    order = np.lexsort((o["start_ts"], o["step"], o["stage"], o["dp_rank"]))
    by_key: dict = defaultdict(lambda: defaultdict(list))
    rows: dict = defaultdict(list)
    names = np.asarray(OPTYPES)[o["optype"]]
    for i in order.tolist():
        key = (int(o["dp_rank"][i]), int(o["stage"][i]), int(o["step"][i]))
        by_key[key][names[i]].append(i)
        rows[key].append(i)
    return by_key, rows


def check_trace(trace) -> dict:
    """Assert the dependency model; return counts of checked edges and groups."""
    o, meta = trace.ops, trace.meta
    dp, pp = meta.dp_size, meta.pp_size
    start, end = o["start_ts"], o["start_ts"] + o["duration"]
    by_key, rows = worker_steps(trace)
    checked = defaultdict(int)

    def before(a: int, b: int, what: str) -> None:
        assert end[a] <= start[b] + TOL, f"{what}: op {a} ends {end[a]} after op {b} starts {start[b]}"
        checked[what] += 1

    # Stream chains, seq_id order, contiguous steps.
    stream = STREAM_OF_OPTYPE[o["optype"]]
    for key, idx in rows.items():
        idx = np.asarray(idx)
        for s in range(len(STREAMS)):
            chain = idx[stream[idx] == s]
            for a, b in zip(chain[:-1], chain[1:]):
                before(a, b, "stream chain")
        for name, ids in by_key[key].items():
            assert [o["seq_id"][i] for i in ids] == list(range(len(ids))), (key, name)
        nxt = rows.get((key[0], key[1], key[2] + 1))
        if nxt:
            assert end[idx].max() <= start[nxt].min() + TOL, f"step {key} overlaps the next"
            checked["steps contiguous"] += 1

    # In-worker edges: recv -> compute, previous compute -> recv, compute -> send.
    compute_stream = STREAMS.index("compute")
    for key, ops in by_key.items():
        _dp, stage, _step = key
        comp = [i for i in rows[key] if stream[i] == compute_stream]
        pos = {i: n for n, i in enumerate(comp)}
        for kind, recv_name, send_name in (("forward", "forward-recv", "forward-send"),
                                           ("backward", "backward-recv", "backward-send")):
            computes = ops[f"{kind}-compute"]
            consumers = [i for i in computes if _receives(kind, stage, int(o["mc"][i]), meta)]
            producers = [i for i in computes if _sends(kind, stage, int(o["mc"][i]), meta)]
            assert len(consumers) == len(ops[recv_name]) and len(producers) == len(ops[send_name])
            for recv, comp_i in zip(ops[recv_name], consumers):
                before(recv, comp_i, "recv -> compute")
                if pos[comp_i] > 0:
                    before(comp[pos[comp_i] - 1], recv, "previous compute -> recv")
                assert o["mc"][recv] == o["mc"][comp_i]
            for send, comp_i in zip(ops[send_name], producers):
                before(comp_i, send, "compute -> send")
        # Step tail: last compute -> layernorm -> embedding -> DP sync -> clip -> optimizer.
        tail = [n for n in ("layernorm-grads-all-reduce", "embedding-grads-all-reduce",
                            "grads-reduce-scatter", "grads-all-reduce",
                            "optimizer-clip-main-grad", "optimizer") if n in ops]
        last_fb = max(ops["backward-compute"], key=lambda i: start[i])
        chain = [last_fb] + [ops[n][-1] for n in tail]
        for a, b in zip(chain[:-1], chain[1:]):
            before(a, b, "step tail")
        assert comp[-1] == ops["optimizer"][0], "optimizer is the last compute op"
        for c, gather in enumerate(ops.get("params-all-gather", [])):
            first = next(i for i in ops["forward-compute"] if o["mc"][i] == c)
            before(gather, first, "all-gather -> first forward of chunk")

    # Communication groups: members end at the group's latest start + a transfer >= 0.
    def group(members, what, shared):
        latest = max(start[m] for m in members)
        for m in members:
            assert end[m] >= latest - TOL, f"{what}: op {m} ends before its group's latest start"
        if shared:
            assert max(end[m] for m in members) - min(end[m] for m in members) <= TOL, what
        checked[what] += 1

    steps = sorted({k[2] for k in by_key})
    for step in steps:
        for d in range(dp):
            for s in range(pp):
                ops = by_key[(d, s, step)]
                for direction in ("forward", "backward"):
                    peer = (s + 1) % pp if direction == "forward" else (s - 1) % pp
                    sends = ops.get(f"{direction}-send", [])
                    recvs = by_key[(d, peer, step)].get(f"{direction}-recv", [])
                    assert len(sends) == len(recvs), (direction, d, s, step)
                    for a, b in zip(sends, recvs):
                        group([a, b], "p2p pair", shared=True)
        for s in range(pp):
            for name in DP_SYNC:
                count = len(by_key[(0, s, step)].get(name, []))
                for k in range(count):
                    group([by_key[(d, s, step)][name][k] for d in range(dp)], name, False)
        if pp > 1:
            for d in range(dp):
                group([by_key[(d, s, step)]["embedding-grads-all-reduce"][0] for s in (0, pp - 1)],
                      "embedding", False)
            group([by_key[(d, s, step)]["optimizer-clip-main-grad"][0]
                   for d in range(dp) for s in range(pp)], "clip", False)
    return dict(checked)


def _receives(kind: str, stage: int, chunk: int, meta) -> bool:
    if kind == "forward":
        return not (stage == 0 and chunk == 0)
    return not (stage == meta.pp_size - 1 and chunk == meta.vpp_size - 1)


def _sends(kind: str, stage: int, chunk: int, meta) -> bool:
    if kind == "forward":
        return not (stage == meta.pp_size - 1 and chunk == meta.vpp_size - 1)
    return not (stage == 0 and chunk == 0)


def transfers(trace, name: str) -> np.ndarray:
    """end - latest start of the DP group, for every op of a DP collective."""
    o = trace.ops
    code = OPTYPES.index(name)
    idx = np.flatnonzero(o["optype"] == code)
    key = o["stage"][idx] * 10**6 + o["step"][idx] * 100 + o["seq_id"][idx]
    latest = {k: o["start_ts"][idx][key == k].max() for k in np.unique(key)}
    return np.array([o["start_ts"][i] + o["duration"][i] - latest[k] for i, k in zip(idx, key)])


CONFIGS = [
    dict(dp=2, pp=1, microbatches=4),
    dict(dp=3, pp=1, microbatches=2, sync="ddp"),
    dict(dp=2, pp=2, microbatches=2),
    dict(dp=2, pp=4, microbatches=8),
    dict(dp=3, pp=4, microbatches=4, sync="ddp"),
    dict(dp=1, pp=3, microbatches=5),
    dict(dp=2, pp=4, microbatches=2),  # fewer microbatches than stages: all warm-up
    dict(dp=2, pp=2, vpp=2, microbatches=4),
    dict(dp=2, pp=4, vpp=2, microbatches=8, sync="ddp"),
    dict(dp=1, pp=4, vpp=3, microbatches=4),
    dict(dp=2, pp=3, vpp=2, microbatches=6),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_synth_noise_only_obeys_dependency_model(cfg):
    trace = generate(steps=3, seed=1, **cfg)
    checked = check_trace(trace)
    assert checked["stream chain"] > 0 and checked["steps contiguous"] > 0
    if cfg["pp"] > 1:
        assert checked["p2p pair"] > 0 and checked["clip"] == 3
    # Collective members end together up to their own transfer noise (sigma 0.02).
    name = "grads-all-reduce" if cfg.get("sync") == "ddp" else "grads-reduce-scatter"
    tr = transfers(trace, name)
    assert np.all(np.abs(tr / BASE_COST[name] - 1) < 0.15), tr


def test_synth_all_injections_obey_dependency_model():
    trace = generate(dp=3, pp=4, microbatches=6, steps=4, seed=7,
                     slow_worker=(1, 2, 2.5), heavy_last_stage=1.4,
                     seq_imbalance={"dist": "lognormal", "max_len": 8192},
                     gc=(1.0, 0.05),
                     slow_link={"kind": "p2p", "dp": 0, "stage_from": 1, "stage_to": 2,
                                "factor": 8})
    checked = check_trace(trace)
    assert checked["p2p pair"] > 0 and checked["previous compute -> recv"] > 0


def test_synth_interleaved_with_injections_obeys_dependency_model():
    trace = generate(dp=2, pp=4, vpp=2, microbatches=4, steps=3, seed=3, gc=(2.0, 0.02),
                     slow_link={"kind": "collective", "optype": "params-all-gather",
                                "stage": 1, "factor": 5}, seq_imbalance="uniform")
    check_trace(trace)


def test_synth_checker_catches_a_violation():
    """The checker can fail: shift one forward-compute before its recv ends."""
    trace = generate(dp=2, pp=2, microbatches=4, steps=2, seed=0)
    o = trace.ops
    i = int(np.flatnonzero((o["optype"] == OPTYPES.index("forward-compute")) & (o["stage"] == 1))[2])
    o["start_ts"][i] -= 0.01
    with pytest.raises(AssertionError):
        check_trace(trace)
