"""`stragglers analyze RUN --dask ADDRESS | --workers N`: the what-if of a run directory on Dask.

The partitions of whatif/partitioned.py mapped onto a cluster: each worker reads its steps
from the run's Parquet files (the path must be readable where the workers run: a local
cluster, or a shared file system) and lays them on the grid; the driver merges the template,
assembles the grid and builds the dependency model, costs and ideal costs; the replays (the
three top-level ones and the attribution by op type, stage and DP rank) run on the workers,
each on its steps; the diagnosis runs on the driver (it replays whole-job fixes with
bootstrap intervals over steps).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from stragglers.errors import InputError, MissingExtraError, StragglersError
from stragglers.whatif import partitioned as P

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 10


@contextlib.contextmanager
def dask_client(address: str | None = None, workers: int | None = None,
                processes: bool = True, timeout: float = CONNECT_TIMEOUT_S) -> Iterator:
    """A client of the scheduler at `address`, or of a LocalCluster of `workers` workers
    (closed on exit); bad values are one-line InputErrors."""
    try:
        from distributed import Client, LocalCluster
    except ImportError as exc:
        raise MissingExtraError(exc.name or "distributed", "dask") from None
    if (address is None) == (workers is None):
        raise InputError("--dask", None, "give either --dask ADDRESS (a running scheduler) or "
                         "--workers N (a local cluster), not both" if address else
                         "expected a scheduler address or a number of workers")
    if workers is not None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise InputError("--workers", None, f"{workers!r}: expected a number of local Dask "
                             "workers ≥ 1")
        with LocalCluster(n_workers=workers, threads_per_worker=1, processes=processes,
                          dashboard_address=None, silence_logs=logging.ERROR) as cluster, \
                Client(cluster) as client:
            yield client
        return
    if not isinstance(address, str) or not address.strip():
        raise InputError("--dask", None, f"{address!r}: expected a scheduler address such as "
                         "tcp://10.0.0.5:8786")
    try:
        client = Client(address, timeout=timeout)
    except (OSError, TimeoutError, ValueError, TypeError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise InputError("--dask", None, f"cannot reach a Dask scheduler at {address!r} "
                         f"({first}); expected the address of a running scheduler such as "
                         "tcp://10.0.0.5:8786") from None
    with client:
        if not client.scheduler_info().get("workers"):
            client.wait_for_workers(1, timeout=timeout * 3)
        yield client


def analyze_run_on_dask(path: Path | str, steps=None, progress: Callable[[str], None] | None = None,
                        config=None, *, address: str | None = None, workers: int | None = None,
                        processes: bool = True, partitions: int | None = None):
    """(AnalysisResult, WhatIf) of a run directory, computed by step partitions on Dask: the
    same numbers as analyze_with_model(read_run(path)) (tests/whatif/test_whatif_dask.py)."""
    with dask_client(address, workers, processes) as client:
        return analyze_with_client(client, path, steps, progress, config, partitions)


def analyze_with_client(client, path, steps=None, progress=None, config=None,
                        partitions: int | None = None):
    """The partitioned analysis (partitioned.analyze_run) on an existing Dask client: at least
    one step partition per worker."""
    addresses = sorted(client.scheduler_info()["workers"])
    return P.analyze_run(path, steps, progress, config,
                         read_all=lambda *a: _read_on_workers(client, addresses, *a),
                         load=lambda *a: _load_shards(client, addresses, *a),
                         partitions=partitions, min_partitions=len(addresses),
                         where=f"on {len(addresses)} Dask worker(s)")


def _read_on_workers(client, addresses: list[str], layout, parts: list,
                     tick: Callable[[str], None]) -> list:
    """ReadAll on the cluster: each partition read and laid on the grid where it is assigned
    (round robin over the workers), the results gathered in step order; what each worker
    decoded told at the end. The layout (every file's row groups) is sent to each worker once,
    not with every partition."""
    on = [addresses[i % len(addresses)] for i in range(len(parts))]
    shared = client.scatter(layout, broadcast=True, hash=False)
    futures = [client.submit(_guarded, P.read_and_place, shared, p, pure=False, workers=[w])
               for p, w in zip(parts, on)]
    got = _gather(client, futures, tick, "read")
    for w in addresses:
        mine = [s for (s, _), at in zip(got, on) if at == w]
        tick(f"read by worker {w}: {len(mine)} partitions, "
             f"{sum(s.rows_read for s in mine):,} rows, "
             f"{sum(s.bytes_read for s in mine):,} bytes decoded")
    return got


def _load_shards(client, addresses: list[str], plan, cost, delay, ideal, start):
    """Place each worker's steps of the costs on it; return the replay_all over them."""
    cut = np.array_split(np.arange(len(start)), min(len(addresses), len(start)))
    shards = []
    for i, idx in enumerate(c for c in cut if len(c)):
        sl = slice(int(idx[0]), int(idx[-1]) + 1)
        shard = P.ReplayShard(plan, cost[:, :, sl], delay[:, :, sl], ideal, start[sl])
        shards.append(client.scatter(shard, workers=[addresses[i]]))

    def replay_all(kind: str, nodes) -> np.ndarray:
        """One replay on every shard, per-step results in step order."""
        futures = [client.submit(P.shard_replay, s, kind, nodes, pure=False) for s in shards]
        return np.concatenate(client.gather(futures), axis=-1)

    return replay_all


def _gather(client, futures: list, tick: Callable[[str], None], what: str) -> list:
    """Results in submission order, progress told as partitions finish."""
    from distributed import as_completed

    index = {f.key: i for i, f in enumerate(futures)}
    out: list = [None] * len(futures)
    for done, f in enumerate(as_completed(futures), 1):
        out[index[f.key]] = _unwrap(f.result())
        f.release()   # the worker drops its copy now, not once every partition is in
        tick(f"{done}/{len(futures)} step partitions {what}")
    return out


def _guarded(fn, *args):
    """Run fn on a worker; our errors come back as values (they do not pickle as exceptions)."""
    failed = next((a for a in args if isinstance(a, _Failure)), None)
    if failed is not None:   # the partition it works on could not be read
        return failed
    try:
        return fn(*args)
    except StragglersError as exc:
        return _Failure(type(exc).__name__, str(exc), getattr(exc, "exit_code", 2))


class _Failure:
    """An error raised on a worker, re-raised on the driver with its message."""

    def __init__(self, kind: str, message: str, exit_code: int):
        self.kind, self.message, self.exit_code = kind, message, exit_code


class WorkerInputError(InputError):
    """Bad input found on a Dask worker (its message names the file and field)."""

    def __init__(self, message: str):
        StragglersError.__init__(self, message)
        self.source, self.field, self.problem = "worker", None, message


def _unwrap(value):
    if isinstance(value, _Failure):
        raise WorkerInputError(value.message)
    return value
