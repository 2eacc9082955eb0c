"""The paper's measured remedies as library features (see README.md)."""

from stragglers.mitigate.planned_gc import PlannedGC
from stragglers.mitigate.sequences import SequencePlan, attention_cost, balance_sequences
from stragglers.mitigate.stages import StageSplit, split_costs, suggest_stage_split

__all__ = ["PlannedGC", "SequencePlan", "StageSplit", "attention_cost", "balance_sequences",
           "split_costs", "suggest_stage_split"]
