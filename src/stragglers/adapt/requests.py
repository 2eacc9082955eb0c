"""Typed, strict, bounded request bodies of the shard service (pydantic).

Strict: `"2"` is not an integer, `10.9` is not a count, `123` is not a name, NaN and Infinity
are not numbers, unknown fields are refused. Every string and list has a length bound, every
number a range, so no request can make the service store or copy an unbounded value.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from stragglers.adapt.controller import MAX_BATCH, MAX_WORLD
from stragglers.adapt.dataset import (MAX_EPOCHS, MAX_ERROR_CHARS, MAX_FENCE,  # noqa: F401
                                      MAX_LEASE_S, MAX_QUEUE_POS,
                                      MAX_RETRIES, MAX_SAMPLES, MAX_SEED, MAX_SHARD_SIZE,
                                      MAX_SHARDS_PER_EPOCH, MIN_LEASE_S, NAME_PATTERN, STATES,
                                      WORKER_PATTERN)
from stragglers.errors import InputError

MAX_COUNT = 256  # shards per lease request
MAX_RECORDS = 10_000  # step records per report
MAX_STEP = 1 << 40
MAX_BPT_S = 1e6
# no step takes less than a nanosecond: a BPT of 5e-324 s (accepted by gt=0) made a per-sample
# time of 0 (or 1/t of inf), and ND gave the fastest rank no samples at all
MIN_BPT_S = 1e-9


class Strict(BaseModel):
    """Base of every request body."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)


Name = Annotated[str, Field(pattern=NAME_PATTERN.pattern)]


def _not_only_dots(name: str) -> str:
    """A worker name of dots only is refused in every request, not only at its join."""
    # the pattern lets '.' and '..' through; join refused them (check_name) but a lease by
    # such a name was a 409 "has not joined" instead of the 400 that names the field
    if not name.strip("."):
        raise ValueError("expected a name that is not only dots")
    return name


Worker = Annotated[str, Field(pattern=WORKER_PATTERN.pattern), AfterValidator(_not_only_dots)]
Fence = Annotated[int, Field(ge=1, le=MAX_FENCE)]
RequestId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
ErrorText = Annotated[str, Field(max_length=MAX_ERROR_CHARS)]


class CreateDataset(Strict):
    """POST /datasets."""

    name: Name
    num_samples: Annotated[int, Field(ge=1, le=MAX_SAMPLES)]
    shard_size: Annotated[int, Field(ge=1, le=MAX_SHARD_SIZE)]
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] = 0
    num_epochs: Annotated[int, Field(ge=1, le=MAX_EPOCHS)] | None = 1
    lease_s: Annotated[float, Field(ge=MIN_LEASE_S, le=MAX_LEASE_S)] = 30.0
    max_retries: Annotated[int, Field(ge=0, le=MAX_RETRIES)] = 3


class Join(Strict):
    """POST /datasets/{name}/join."""

    worker: Worker


class Lease(Strict):
    """POST /datasets/{name}/lease."""

    worker: Worker
    fence: Fence
    count: Annotated[int, Field(ge=1, le=MAX_COUNT)] = 1
    request_id: RequestId | None = None


class Ack(Strict):
    """POST /datasets/{name}/ack."""

    worker: Worker
    fence: Fence
    epoch: Annotated[int, Field(ge=0, le=MAX_EPOCHS)]
    shard: Annotated[int, Field(ge=0, le=MAX_SHARDS_PER_EPOCH)]
    consumed: Annotated[int, Field(ge=0, le=MAX_SHARD_SIZE)]


class Release(Strict):
    """POST /datasets/{name}/release (no fence: fence off every incarnation of the worker)."""

    worker: Worker
    fence: Fence | None = None
    failure: bool = True
    error: ErrorText | None = None


class Empty(Strict):
    """A body that carries nothing (retry-failed)."""


class SnapshotConfig(CreateDataset):
    """The data set config inside a snapshot (every field present)."""

    seed: Annotated[int, Field(ge=0, le=MAX_SEED)]
    num_epochs: Annotated[int, Field(ge=1, le=MAX_EPOCHS)] | None
    lease_s: Annotated[float, Field(ge=MIN_LEASE_S, le=MAX_LEASE_S)]
    max_retries: Annotated[int, Field(ge=0, le=MAX_RETRIES)]


ShardRow = tuple[Annotated[int, Field(ge=0, le=MAX_EPOCHS)],
                 Annotated[int, Field(ge=0, le=MAX_SHARDS_PER_EPOCH)],
                 Literal[STATES],  # type: ignore[valid-type]
                 Annotated[int, Field(ge=0, le=MAX_SHARD_SIZE)],
                 Annotated[int, Field(ge=0, le=MAX_RETRIES + 1)],
                 Annotated[int, Field(ge=-MAX_QUEUE_POS, le=MAX_QUEUE_POS)],
                 ErrorText | None]


class Snapshot(Strict):
    """POST /datasets/{name}/restore (the reply of GET .../snapshot)."""

    dataset: SnapshotConfig
    epochs_created: Annotated[int, Field(ge=1, le=MAX_EPOCHS)]
    # fail_fast: the first bad row refuses the body; collecting an error per row (589,824 bad
    # rows: 19 s and 1.6 GB before the 400) cost more than the body's limit bounds
    shards: Annotated[list[ShardRow], Field(max_length=4 * MAX_SHARDS_PER_EPOCH * 16,
                                            fail_fast=True)]
    # epochs below it list only their shards not DONE (GET .../snapshot folds epochs done)
    folded_epochs: Annotated[int, Field(ge=0, le=MAX_EPOCHS)] = 0


class ControlConfigBody(Strict):
    """POST /jobs/{job}/control/config (the fields of ControlConfig)."""

    policy: Annotated[str, Field(max_length=32)]
    world_size: Annotated[int, Field(ge=1, le=MAX_WORLD)]
    global_batch: Annotated[int, Field(ge=1, le=MAX_BATCH)]
    memory_cap: Annotated[int, Field(ge=1, le=MAX_BATCH)] | None = None
    total_steps: Annotated[int, Field(ge=0, le=MAX_STEP)] = 0
    restart_cost_s: Annotated[float, Field(ge=0, le=1e7)] = 10.0
    max_restarts: Annotated[int, Field(ge=0, le=1000)] = 1
    window: Annotated[int, Field(ge=1, le=10_000)] = 5
    theta: Annotated[float, Field(ge=1.0, le=100.0)] = 1.3
    persistent_windows: Annotated[int, Field(ge=1, le=10_000)] = 3
    min_change: Annotated[float, Field(ge=0, le=1)] = 0.05
    lag_s: Annotated[float, Field(ge=0, le=3600)] = 1.0
    incarnation: Annotated[int, Field(ge=0, le=1 << 31)] = 0
    start_step: Annotated[int, Field(ge=0, le=MAX_STEP)] | None = None


StepTimeRow = tuple[Annotated[int, Field(ge=0, le=MAX_STEP)],          # [step, bpt, batch]
                    Annotated[float, Field(ge=MIN_BPT_S, le=MAX_BPT_S)],
                    Annotated[int, Field(ge=0, le=MAX_BATCH)]]


class Report(Strict):
    """POST /jobs/{job}/control/report."""

    rank: Annotated[int, Field(ge=0, lt=MAX_WORLD)]
    records: Annotated[list[StepTimeRow], Field(max_length=MAX_RECORDS, fail_fast=True)]
    device: Annotated[str, Field(max_length=64)] = ""
    incarnation: Annotated[int, Field(ge=0, le=1 << 31)]
    since: Annotated[int, Field(ge=0, le=1 << 31)] = 0


M = TypeVar("M", bound=Strict)
MAX_KEYS = 64               # keys of one object (the most fields of any request is 13)
MAX_OBJECTS = 64            # objects in one body (a restore has two)
SCAN_FIRST_BYTES = 4096     # bodies larger than this are scanned for keys before validation


def parse(model: type[M], body: bytes, source: str = "request body") -> M:
    """Validate a JSON body; the first problem becomes an InputError naming the field (a key
    given twice in one object too, at any size: which of the two counts differs between
    parsers)."""
    # A big body's keys are scanned first (C-speed, stops at the bound): an object of 90,000
    # unknown keys in 1 MiB made pydantic build an error per key, 0.7 s of the event loop.
    big = len(body) > SCAN_FIRST_BYTES
    if big:
        refuse_duplicate_keys(body, source)
    try:
        value = model.model_validate_json(body or b"{}")
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        field = ".".join(str(p) for p in err["loc"]) or None
        problem = err["msg"]
        if err["type"] == "json_invalid":
            problem = f"expected a JSON object ({err['msg']})"
        elif "input" in err and err["type"] not in ("missing", "extra_forbidden"):
            shown = repr(err["input"])
            problem += f", got {shown if len(shown) <= 60 else shown[:60] + '...'}"
        raise InputError(source, field, problem) from None
    if not big and body.count(b":") > 1:   # (one key cannot be given twice)
        refuse_duplicate_keys(body, source)
    return value


# One match is everything up to the next key or brace (values, strings included, so a brace
# or colon inside a string is never taken for structure), then that key (group 1: a string a
# colon follows), brace (group 2) or the end. Linear on any bytes, JSON or not (a big body is
# scanned before it is parsed): possessive, and a string always matches from its quote (to
# its closing quote or the end), so no start position fails and is retried from the next.
_STRING = rb'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)'
_NEXT_KEY_OR_BRACE = re.compile(rb'(?:[^"{}]++|' + _STRING + rb'(?![ \t\r\n]*+:))*+'
                                rb'(?:(' + _STRING + rb')[ \t\r\n]*+:|([{}])|\Z)', re.S)


def refuse_duplicate_keys(body: bytes, source: str = "request body") -> None:
    """InputError naming the first key given twice in one object of `body`, or when `body`
    has more than MAX_OBJECTS objects or one of more than MAX_KEYS keys (no request has that
    many; JSON or not, the scan's Python steps stay under MAX_OBJECTS * (MAX_KEYS + 2)).

    A scan of the bytes, not a second parse: only the keys of the objects still open are held
    (re-parsing a 64 MiB restore body made Python objects of every row again, so bodies over
    1 MiB went unchecked)."""
    open_keys: list[set[str]] = []
    objects = 0
    for m in _NEXT_KEY_OR_BRACE.finditer(body):
        raw = m.group(1)
        if raw is not None:
            try:
                key = json.loads(raw) if b"\\" in raw else raw[1:-1].decode("utf-8", "replace")
            except ValueError:   # an escape JSON does not have (`\q`, `\u12`): not JSON
                raise InputError(source, None, "expected a JSON object (a key of "
                                 f"{raw[:40].decode('utf-8', 'replace')} is no JSON string)"
                                 ) from None
            keys = open_keys[-1] if open_keys else set()
            if key in keys:
                raise InputError(source, key[:60], "given twice in one object; expected once")
            keys.add(key)
            if len(keys) > MAX_KEYS:
                raise InputError(source, key[:60], f"an object of more than {MAX_KEYS} keys;"
                                 " expected the request's fields")
        elif m.group(2) == b"{":
            objects += 1
            if objects > MAX_OBJECTS:
                raise InputError(source, None, f"more than {MAX_OBJECTS} JSON objects;"
                                 " expected the request's fields")
            open_keys.append(set())
        elif m.group(2) == b"}":
            if not open_keys:
                raise InputError(source, None, "expected a JSON object (a '}' closes none)")
            open_keys.pop()
