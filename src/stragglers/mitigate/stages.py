"""Layer-to-stage assignment from measured per-layer costs (the output head included)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from stragglers.errors import InputError


@dataclass
class StageSplit:
    """Layers per stage, each stage's cost and the bottleneck (the slowest stage's cost)."""

    layers_per_stage: list[int]
    stage_costs: list[float]

    @property
    def bottleneck(self) -> float:
        """The cost of the slowest stage, which sets the pipeline's pace."""
        return max(self.stage_costs)

    @property
    def imbalance(self) -> float:
        """Slowest stage over the mean stage (1.0 is perfect)."""
        mean = sum(self.stage_costs) / len(self.stage_costs)
        return self.bottleneck / mean if mean > 0 else 1.0


def split_costs(layer_costs: Sequence[float], layers_per_stage: Sequence[int],
                first_cost: float = 0.0, last_cost: float = 0.0) -> list[float]:
    """Each stage's cost under a given split (embedding on the first, head on the last stage)."""
    costs, i = [], 0
    for n in layers_per_stage:
        costs.append(float(sum(layer_costs[i:i + n])))
        i += n
    costs[0] += first_cost
    costs[-1] += last_cost
    return costs


def suggest_stage_split(layer_costs: Sequence[float], num_stages: int, head_cost: float = 0.0,
                        embedding_cost: float = 0.0) -> StageSplit:
    """Contiguous split of the layers into num_stages stages minimising the slowest stage.

    The embedding sits on the first stage and the output head (with the loss) on the last, so
    their measured costs weigh on those stages. Exact dynamic programme, O(L² · P).
    """
    costs = [float(c) for c in layer_costs]
    n, p = len(costs), int(num_stages)
    if p < 1:
        raise InputError("suggest_stage_split", "num_stages", f"expected >= 1, got {num_stages}")
    if n < p:
        raise InputError("suggest_stage_split", "layer_costs", f"{n} layers cannot fill {p} "
                         "stages with at least one layer each")
    if any(c < 0 or c != c for c in costs + [head_cost, embedding_cost]):
        raise InputError("suggest_stage_split", "layer_costs", "expected finite costs >= 0")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def seg(i: int, j: int, s: int) -> float:  # cost of layers i..j-1 as stage s
        return (prefix[j] - prefix[i] + (embedding_cost if s == 0 else 0.0)
                + (head_cost if s == p - 1 else 0.0))

    inf = float("inf")
    # best[s][j]: minimal bottleneck placing the first j layers on stages 0..s
    best = [[inf] * (n + 1) for _ in range(p)]
    cut = [[0] * (n + 1) for _ in range(p)]
    for j in range(1, n + 1):
        best[0][j] = seg(0, j, 0)
    for s in range(1, p):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                v = max(best[s - 1][i], seg(i, j, s))
                # ties: prefer the later cut (keeps the head's stage lighter)
                if v < best[s][j] or (v == best[s][j] and i > cut[s][j]):
                    best[s][j], cut[s][j] = v, i
    bounds, j = [n], n
    for s in range(p - 1, 0, -1):
        j = cut[s][j]
        bounds.append(j)
    bounds.append(0)
    bounds.reverse()
    layers = [bounds[k + 1] - bounds[k] for k in range(p)]
    return StageSplit(layers, split_costs(costs, layers, embedding_cost, head_cost))
