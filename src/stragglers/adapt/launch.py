"""Find the shard service for a torchrun job: a given URL, or one embedded in rank 0."""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import torch.distributed as dist

from stragglers.adapt.service import EmbeddedServer
from stragglers.errors import EnvironmentFailure
from stragglers.serving import read_token_file

_JOB_STORE: dist.Store | None = None  # the incarnation's torchrun store (set by init_distributed)
HOST_ENV = "STRAGGLERS_ADAPT_HOST"


@dataclass
class JobService:
    """Where the job's shard service is and the job's bearer token."""

    url: str
    token: str
    server: EmbeddedServer | None = None


class _Published(msgspec.Struct):
    """What rank 0 publishes to the other ranks (JSON in the torchrun store)."""

    url: str
    token: str


def read_or_create_token(token_file: str | Path) -> str:
    """The job's token from `token_file`; a new random one (mode 0600) if it does not exist.

    The token must outlive an incarnation: the data set belongs to it, and a restarted rank 0
    re-registers the data set with it. An existing file is read as the service's token file is
    (serving.read_token_file: its first line, a regular file only group and others may not
    read or write): read whole, a file of two lines gave a token with a newline in it that
    every write was refused 401 for, and a FIFO blocked rank 0's start.
    """
    path = Path(token_file)
    if path.exists() or path.is_symlink():
        token = read_token_file(path, "token file")
        assert token is not None
        return token
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def spans_hosts() -> bool:
    """Whether this torchrun job has ranks on more than one host."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("LOCAL_WORLD_SIZE", str(world))) < world


def own_address() -> str:
    """The address other hosts reach this one at ($STRAGGLERS_ADAPT_HOST overrides it)."""
    if os.environ.get(HOST_ENV):
        return os.environ[HOST_ENV]
    candidates = []
    # The interface that routes to the rendezvous host, then the one of the default route
    # (a UDP connect sends no packet), then what the host name resolves to.
    targets = [(os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "29500")))] \
        if os.environ.get("MASTER_ADDR") else []
    for target in targets + [("203.0.113.1", 9)]:  # TEST-NET-3: never answered
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect(target)
                candidates.append(s.getsockname()[0])
        except OSError:
            pass
    try:
        candidates.append(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    for addr in candidates:
        if not ipaddress.ip_address(addr).is_loopback:
            return addr
    raise EnvironmentFailure("embedded shard service", "the job spans hosts but no"
                             f" non-loopback address of this host was found; set {HOST_ENV}")


def job_service(spec: str, db: str | Path, token_file: str | Path) -> JobService:
    """Collective. `spec` is a URL or "embedded": rank 0 serves `db`, all learn URL and token.

    Embedded: loopback when every rank is on this host; the host's own address when the job
    spans hosts (the service then also requires the token to create anything). The URL and
    the token reach the other ranks through the torchrun store of this incarnation. An
    embedded service lives and dies with rank 0; after a torchrun restart the new rank 0
    serves the same SQLite file, so no shard state is lost.
    """
    store = _JOB_STORE
    key = "stragglers/adapt/service"
    if dist.get_rank() == 0:
        token, server = read_or_create_token(token_file), None
        url = spec
        if spec == "embedded":
            multi = spans_hosts()
            server = EmbeddedServer(db, host=own_address() if multi else "127.0.0.1",
                                    service_token=token if multi else None).start()
            url = server.url
        payload = json.dumps({"url": url, "token": token})
        if store is not None:
            store.set(key, payload)
        else:
            dist.broadcast_object_list([payload], src=0)
        return JobService(url, token, server)
    if store is not None:
        payload = store.get(key).decode()
    else:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        payload = box[0]
    where = msgspec.json.decode(payload, type=_Published)
    return JobService(where.url, where.token)


def init_distributed(backend: str = "gloo", timeout_s: float = 300.0) -> int:
    """init_process_group for a torchrun worker; returns the incarnation (restart count).

    The process group's keys are namespaced by the restart count: the agent keeps its store
    across an elastic restart, and a new incarnation must never read the gloo address a killed
    worker published (it would be refused, and the group would fail to form).
    """
    global _JOB_STORE
    incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store: dist.Store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0,
                          timeout=timedelta(seconds=timeout_s))
    store = dist.PrefixStore(f"/stragglers/adapt/incarnation_{incarnation}", store)
    _JOB_STORE = store
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    return incarnation
