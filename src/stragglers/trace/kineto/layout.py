"""The job's pipeline layout from what the ranks did: who sends to whom, and in which order.

The profiler does not record DP rank and pipeline stage. Point-to-point ops with known peers
give them: the first transfer between two pipeline neighbours in a step is a forward
activation, so it goes from the earlier stage to the later one. Chains of such edges are the
pipelines; a rank's stage is its position in its chain. A layout given by the user is checked
against this pattern (and against the absence of any point-to-point traffic).
"""

from __future__ import annotations

from dataclasses import dataclass

from stragglers.errors import InputError
from stragglers.trace.kineto.ops import P2P_KINDS, RankParts


@dataclass
class Pipelines:
    """Stages found from the send/recv pattern (or why none could be found)."""

    stage: dict[int, int]          # rank (read or only named as a peer) → stage
    chains: list[list[int]]        # one pipeline per chain, stage order
    why_not: str = ""              # non-empty when the pattern gives no layout

    @property
    def pp(self) -> int:
        """Stages per pipeline (1 without a pattern)."""
        return len(self.chains[0]) if self.chains else 1


def p2p_summary(parts: dict[int, RankParts]) -> tuple[int, int]:
    """(p2p ops in all ranks, of which with a known peer rank)."""
    total = known = 0
    for p in parts.values():
        for c in p.colls:
            if c.kind in P2P_KINDS:
                total += 1
                known += (c.dst if c.kind == "send" else c.src) is not None
    return total, known


def pipelines_from_p2p(parts: dict[int, RankParts]) -> Pipelines:
    """Pipeline chains from the first transfer between each pair of neighbours in a step."""
    edges: set[tuple[int, int]] = set()
    for rank, p in parts.items():
        first_step = None
        seen: set[int] = set()
        for c in sorted(p.colls, key=lambda c: (c.step, c.start)):
            if c.kind not in ("send", "recv"):
                continue
            peer = c.dst if c.kind == "send" else c.src
            if peer is None or peer == rank:
                continue
            first_step = c.step if first_step is None else first_step
            if c.step != first_step or peer in seen:
                continue
            seen.add(peer)
            edges.add((rank, peer) if c.kind == "send" else (peer, rank))
    if not edges:
        return Pipelines({}, [], "no send/recv with a known peer rank")
    both = sorted((a, b) for a, b in edges if (b, a) in edges and a < b)
    if both:
        a, b = both[0]
        return Pipelines({}, [], f"ranks {a} and {b} each send to the other first (an "
                                 "interleaved pipeline wrapping around?)")
    succ: dict[int, int] = {}
    pred: dict[int, int] = {}
    for a, b in sorted(edges):
        if a in succ and succ[a] != b or b in pred and pred[b] != a:
            return Pipelines({}, [], f"rank {a if a in succ else b} talks to more than one "
                                     "rank in the same direction")
        succ[a], pred[b] = b, a
    chains = []
    for head in sorted(set(succ) - set(pred)):
        chain = [head]
        while chain[-1] in succ and len(chain) <= len(succ) + 1:
            chain.append(succ[chain[-1]])
        chains.append(chain)
    if not chains or sum(len(c) for c in chains) < len(set(succ) | set(pred)):
        return Pipelines({}, [], "the send/recv pattern has a cycle")
    lengths = sorted({len(c) for c in chains})
    if len(lengths) > 1:
        return Pipelines({}, [], f"pipelines of different lengths {lengths}")
    unplaced = sorted(set(parts) - {r for c in chains for r in c})
    if unplaced:
        return Pipelines({}, [], f"rank {unplaced[0]} takes part in no send/recv")
    stage = {r: i for c in chains for i, r in enumerate(c)}
    return Pipelines(stage, chains)


def check_given_layout(source: str, pp_size: int | None, dp_size: int | None,
                       parts: dict[int, RankParts], found: Pipelines, world: int) -> None:
    """Refuse a given --pp-size/--dp-size that the traces contradict (one-line InputError)."""
    total, _known = p2p_summary(parts)
    if pp_size and pp_size > 1 and total == 0:
        raise InputError(source, "pp_size", f"{pp_size} pipeline stages given, but no rank sends "
                         "or receives point-to-point: the traces are of a data-parallel job "
                         "(expected pp_size 1, or the traces of a pipeline job)")
    if pp_size and found.chains and found.pp != pp_size:
        chain = "→".join(map(str, found.chains[0]))
        raise InputError(source, "pp_size", f"{pp_size} given, but the ranks' send/recv pattern "
                         f"has {found.pp} stage(s) per pipeline (e.g. ranks {chain})")
    if pp_size is None and dp_size and found.chains and found.pp > 1:
        expect = world // found.pp
        if dp_size > expect:
            raise InputError(source, "dp_size", f"{dp_size} given, but the send/recv pattern has "
                             f"{found.pp} pipeline stages, leaving {expect} ranks per stage")
