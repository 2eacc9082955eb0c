"""Find the shard service for a torchrun job: a given URL, or one embedded in rank 0."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from stragglers.adapt.service import EmbeddedServer


def job_service(spec: str, db: str | Path) -> tuple[str, EmbeddedServer | None]:
    """Collective. `spec` is a URL or "embedded": rank 0 serves `db` on a free port, all learn the URL.

    An embedded service lives and dies with rank 0; after a torchrun restart the new rank 0
    serves the same SQLite file, so no shard state is lost.
    """
    server = None
    if spec != "embedded":
        return spec, None
    box = [None]
    if dist.get_rank() == 0:
        server = EmbeddedServer(db).start()
        box = [server.url]
    dist.broadcast_object_list(box, src=0)
    return box[0], server


def init_distributed(backend: str = "gloo", timeout_s: float = 300.0) -> int:
    """init_process_group for a torchrun worker; returns the incarnation (restart count).

    The process group's keys are namespaced by the restart count: the agent keeps its store
    across an elastic restart, and a new incarnation must never read the gloo address a killed
    worker published (it would be refused, and the group would fail to form).
    """
    incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0,
                          timeout=timedelta(seconds=timeout_s))
    store = dist.PrefixStore(f"/stragglers/adapt/incarnation_{incarnation}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    return incarnation
