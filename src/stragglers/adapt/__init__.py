"""Self-adaptive training (AntDT): data-sharding service, monitor/controller/agent, DD and ND policies.

The service side (`ShardStore`, `DatasetConfig`, `create_app`, `EmbeddedServer`, `ShardClient`,
`ShardBatchSampler`) and the controller (`ControlConfig`, `Controller`, `SpeedMonitor`, the
`split_batch` arithmetic) need no torch; `DataParallelStep`, the checkpoint functions and the
torchrun launch helpers do, and are imported lazily on first use.
"""

from __future__ import annotations

from stragglers.lazy import lazy_exports

_LAZY = {
    "DatasetConfig": "stragglers.adapt.dataset",
    "epoch_permutation": "stragglers.adapt.dataset",
    "ShardStore": "stragglers.adapt.shards",
    "LeaseLost": "stragglers.adapt.shards",
    "Fenced": "stragglers.adapt.shards",
    "Conflict": "stragglers.adapt.shards",
    "ServiceConfig": "stragglers.adapt.service",
    "create_app": "stragglers.adapt.service",
    "serve": "stragglers.adapt.service",
    "EmbeddedServer": "stragglers.adapt.service",
    "ShardClient": "stragglers.adapt.client",
    "ShardBatchSampler": "stragglers.adapt.client",
    "ControlConfig": "stragglers.adapt.controller",
    "Controller": "stragglers.adapt.controller",
    "SpeedMonitor": "stragglers.adapt.monitor",
    "split_batch": "stragglers.adapt.policies",
    "micro_batches": "stragglers.adapt.policies",
    "Agent": "stragglers.adapt.agent",
    # torch
    "DataParallelStep": "stragglers.adapt.step",
    "save_job_checkpoint": "stragglers.adapt.checkpoint",
    "load_job_checkpoint": "stragglers.adapt.checkpoint",
    "init_distributed": "stragglers.adapt.launch",
    "job_service": "stragglers.adapt.launch",
    "SimulatedDevice": "stragglers.adapt.heterogeneity",
}

# AntDT's monitor was exported as Monitor, the name of the live service (stragglers.monitor).
_RENAMED = {"Monitor": "SpeedMonitor"}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY, _RENAMED)
