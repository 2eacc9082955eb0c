"""Find the shard service for a torchrun job: a given URL, or one embedded in rank 0."""

from __future__ import annotations

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
