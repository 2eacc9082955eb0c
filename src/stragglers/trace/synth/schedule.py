"""The per-step op schedule of every pipeline stage, as a symbolic dependency graph.

All DP ranks and all steps run the same schedule, so the graph is built once per stage (a few
hundred nodes) and the generator evaluates it on vectors that span every (step, dp rank).
The dependency rules are those of docs/whatif.md §3 (the replay engine's model).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stragglers.trace.model import STREAM_OF_OPTYPE, optype_code

# Seconds; the cost of one op without noise or injections (realistic magnitudes on an H100-class
# GPU). Forward/backward are per microbatch and per stage, divided among the model chunks.
BASE_COST = {
    "forward-compute": 0.020,
    "backward-compute": 0.040,
    "optimizer": 0.010,
    "gc": 0.0,  # set from the gc injection's pause length
    "forward-send": 0.0005,
    "forward-recv": 0.0005,
    "backward-send": 0.0005,
    "backward-recv": 0.0005,
    "params-all-gather": 0.003,
    "grads-reduce-scatter": 0.004,
    "grads-all-reduce": 0.006,
    "layernorm-grads-all-reduce": 0.0002,
    "embedding-grads-all-reduce": 0.002,
    "optimizer-clip-main-grad": 0.0003,
}


@dataclass
class Node:
    """One op of one stage's step: what it is and which ops' ends its start waits for."""

    id: int
    stage: int
    optype: str
    mb: int = -1
    chunk: int = 0
    deps: list[int] = field(default_factory=list)
    group: int = -1

    @property
    def code(self) -> int:
        """Op type code (index into OPTYPES)."""
        return optype_code(self.optype)


@dataclass
class Group:
    """Ops that complete together: each member ends at max(start over members) + a transfer.

    `across_dp`: the group also spans every DP rank (DP collectives, the global clip).
    `shared_transfer`: one transfer for all members (a p2p pair) instead of one each.
    `kind`: "compute" (a singleton that ends at start + duration), "p2p" or "collective".
    """

    id: int
    members: list[int]
    kind: str
    across_dp: bool = False
    shared_transfer: bool = False


def compute_order(stage: int, pp: int, vpp: int, microbatches: int) -> list[tuple[str, int, int]]:
    """Megatron's 1F1B (vpp=1) or interleaved (vpp>1) compute order: (F|B, chunk, microbatch)."""
    if vpp == 1:
        warmup = min(pp - stage - 1, microbatches)
        order = [("F", 0, m) for m in range(warmup)]
        for i in range(microbatches - warmup):
            order += [("F", 0, warmup + i), ("B", 0, i)]
        return order + [("B", 0, m) for m in range(microbatches - warmup, microbatches)]
    total = microbatches * vpp
    if microbatches == pp:
        warmup = total  # Megatron: all forwards first when there are exactly pp microbatches
    else:
        warmup = min((pp - stage - 1) * 2 + (vpp - 1) * pp, total)

    def chunk(k: int, forward: bool) -> int:
        c = (k % (pp * vpp)) // pp
        return c if forward else vpp - 1 - c

    def mb(k: int) -> int:
        return (k // (pp * vpp)) * pp + k % pp

    order = [("F", chunk(k, True), mb(k)) for k in range(warmup)]
    for i in range(total - warmup):
        k = warmup + i
        order += [("F", chunk(k, True), mb(k)), ("B", chunk(i, False), mb(i))]
    return order + [("B", chunk(k, False), mb(k)) for k in range(total - warmup, total)]


@dataclass
class StepGraph:
    """Nodes of every stage (one step, one DP rank) plus communication groups and event order."""

    pp: int
    vpp: int
    microbatches: int
    sync: str
    gc_slots: bool
    nodes: list[Node] = field(default_factory=list)
    groups: list[Group] = field(default_factory=list)
    by_stage: list[list[int]] = field(default_factory=list)
    # the group whose latest start ends a step on every worker (clip; the DP sync when pp = 1)
    barrier: int = -1
    optimizer: list[int] = field(default_factory=list)  # optimizer node per stage
    events: list[tuple[str, int]] = field(default_factory=list)  # ("S", node) / ("E", group)


def build_step_graph(pp: int, vpp: int, microbatches: int, sync: str, gc_slots: bool) -> StepGraph:
    """Build the symbolic graph of one step for all stages and order it topologically."""
    sched = StepGraph(pp, vpp, microbatches, sync, gc_slots)
    p2p_keys: dict[tuple, list[int]] = {}
    tail: dict[str, list[int]] = {}
    for stage in range(pp):
        _build_stage(sched, stage, p2p_keys, tail)
    for key, members in p2p_keys.items():
        if len(members) != 2:  # a schedule bug, never user input
            raise AssertionError(f"unmatched p2p op {key}: {members}")
        _add_group(sched, members, "p2p", shared_transfer=True)
    for name, members in tail.items():
        if name == "embedding-grads-all-reduce":
            _add_group(sched, members, "collective")
        elif name == "optimizer-clip-main-grad":
            sched.barrier = _add_group(sched, members, "collective", across_dp=True)
    for node in sched.nodes:
        if node.group < 0:
            # layernorm-grads-all-reduce runs inside the (untraced) TP group: a plain op here.
            kind = "collective" if STREAM_OF_OPTYPE[node.code] == 1 \
                and node.optype != "layernorm-grads-all-reduce" else "compute"
            _add_group(sched, [node.id], kind, across_dp=kind == "collective")
    if pp == 1:
        sync_name = "grads-all-reduce" if sync == "ddp" else "grads-reduce-scatter"
        sched.barrier = next(sched.nodes[n].group for n in sched.by_stage[0]
                             if sched.nodes[n].optype == sync_name)
    sched.events = _event_order(sched)
    return sched


def _add_group(sched: StepGraph, members: list[int], kind: str, across_dp: bool = False,
               shared_transfer: bool = False) -> int:
    gid = len(sched.groups)
    sched.groups.append(Group(gid, list(members), kind, across_dp, shared_transfer))
    for m in members:
        sched.nodes[m].group = gid
    return gid


def _build_stage(sched: StepGraph, stage: int, p2p_keys: dict, tail: dict) -> None:
    """Append one stage's nodes in stream order; record p2p keys and tail collectives."""
    pp, vpp = sched.pp, sched.vpp
    ids: list[int] = []
    last_on_stream: dict[int, int] = {}

    def add(optype: str, deps: list[int], mb: int = -1, chunk: int = 0) -> int:
        node = Node(len(sched.nodes), stage, optype, mb, chunk, [d for d in deps if d >= 0])
        stream = int(STREAM_OF_OPTYPE[node.code])
        if stream in last_on_stream:  # ops on one stream form a chain
            node.deps.append(last_on_stream[stream])
        last_on_stream[stream] = node.id
        sched.nodes.append(node)
        ids.append(node.id)
        return node.id

    gather = {c: add("params-all-gather", [], chunk=c) for c in range(vpp)} \
        if sched.sync == "zero" else {}
    prev_compute = -1
    gathered: set[int] = set()
    for kind, c, m in compute_order(stage, pp, vpp, sched.microbatches):
        if kind == "F":
            if sched.gc_slots:  # a possible GC pause right before every forward
                prev_compute = add("gc", [], chunk=c)
            deps = []
            if not (stage == 0 and c == 0):
                deps.append(add("forward-recv", [prev_compute], chunk=c))
                p2p_keys.setdefault(("f", stage, c, m), []).append(deps[-1])
            if c in gather and c not in gathered:
                deps.append(gather[c])
                gathered.add(c)
            prev_compute = add("forward-compute", deps, m, c)
            if not (stage == pp - 1 and c == vpp - 1):
                send = add("forward-send", [prev_compute], chunk=c)
                dest = (stage + 1, c) if stage < pp - 1 else (0, c + 1)
                p2p_keys.setdefault(("f", *dest, m), []).append(send)
        else:
            deps = []
            if not (stage == pp - 1 and c == vpp - 1):
                deps.append(add("backward-recv", [prev_compute], chunk=c))
                p2p_keys.setdefault(("b", stage, c, m), []).append(deps[-1])
            prev_compute = add("backward-compute", deps, m, c)
            if not (stage == 0 and c == 0):
                send = add("backward-send", [prev_compute], chunk=c)
                dest = (stage - 1, c) if stage > 0 else (pp - 1, c - 1)
                p2p_keys.setdefault(("b", *dest, m), []).append(send)
    sync_name = "grads-all-reduce" if sched.sync == "ddp" else "grads-reduce-scatter"
    if pp == 1:
        last = add(sync_name, [prev_compute])
    else:
        last = add("layernorm-grads-all-reduce", [prev_compute])
        if stage in (0, pp - 1):
            tail.setdefault("embedding-grads-all-reduce", []).append(
                add("embedding-grads-all-reduce", []))
        add(sync_name, [])
        last = add("optimizer-clip-main-grad", [])
        tail.setdefault("optimizer-clip-main-grad", []).append(last)
    sched.optimizer.append(add("optimizer", [last]))
    sched.by_stage.append(ids)


def _event_order(sched: StepGraph) -> list[tuple[str, int]]:
    """Kahn order of start events (node) and end events (group); a cycle is a schedule bug."""
    n_nodes, n_groups = len(sched.nodes), len(sched.groups)
    # event index: node start i -> i; group end g -> n_nodes + g
    waiting = [0] * (n_nodes + n_groups)
    after: list[list[int]] = [[] for _ in range(n_nodes + n_groups)]
    for node in sched.nodes:
        for d in set(sched.nodes[d].group for d in node.deps):
            after[n_nodes + d].append(node.id)
            waiting[node.id] += 1
    for g in sched.groups:
        for m in g.members:
            after[m].append(n_nodes + g.id)
            waiting[n_nodes + g.id] += 1
    ready = [i for i in range(n_nodes) if waiting[i] == 0]
    order: list[tuple[str, int]] = []
    while ready:
        ev = ready.pop()
        order.append(("S", ev) if ev < n_nodes else ("E", ev - n_nodes))
        for nxt in after[ev]:
            waiting[nxt] -= 1
            if waiting[nxt] == 0:
                ready.append(nxt)
    if len(order) != n_nodes + n_groups:
        stuck = [sched.nodes[i] for i in range(n_nodes) if waiting[i]][:4]
        raise AssertionError(f"schedule has a dependency cycle near {stuck}")
    return order
