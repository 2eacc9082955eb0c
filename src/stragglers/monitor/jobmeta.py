"""A job's meta.json as the monitor takes it: checked in full before it is stored, and again
when it is read back (a bad stored row quarantines its job, never the service).

`meta_from_dict` checks the sizes; the monitor also relies on `extra.layout` (the ranks a
window waits for, each one's host) and `extra.clock` (the recorder's close marker), so those
are checked here too: a layout whose rank was "x", null, 1e400 or [1] once failed every
request of its job with a 500 and every later start of the monitor.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import msgspec

from stragglers.errors import InputError
from stragglers.monitor.part_names import MAX_RANK
from stragglers.trace.model import JobMeta
from stragglers.trace.runformat import meta_from_dict

# meta.json besides its per-rank lists (extra.layout, extra.clock): a 1 MiB meta re-sent in a
# loop once cost seconds of CPU per PUT and per job list; no recorder writes 1/16 of this
MAX_META_BYTES = 64 << 10
# what each rank may add (its extra.layout entry, its start and end clock estimates): the
# richest recorder entry (attach on a DeviceMesh, with device and CPU list) measured 367 bytes
# per rank, 22 MB for 65,536 ranks (test_meta_cost.recorder_meta); 1 KiB holds a 255-character host
PER_RANK_KEYS = ("layout", "clock")
META_BYTES_PER_RANK = 1 << 10
MAX_WORLD = 65_536   # (settings.max_world_size's default: the bound of a watched file's read)
MAX_DEPTH = 32
_HOST_CHARS = 255
# characters a name shown by the monitor may not hold (refused, as job names out of their
# pattern are): C0 and C1 controls and DEL (a NUL in a host reached /metrics' label values raw,
# which older Prometheus parsers break on) and the bidirectional marks, embeddings, overrides
# and isolates (U+202E in a host name showed it reversed, on the dashboard and in labels: a
# name disguised as another)
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_FLOAT_MAX = int(sys.float_info.max)


def meta_bytes_limit(max_bytes: int, world_size: int) -> int:
    """The largest meta.json of a job of `world_size` ranks: `max_bytes` besides its per-rank
    lists, and META_BYTES_PER_RANK for each rank."""
    return max_bytes + max(world_size, 0) * META_BYTES_PER_RANK


def check_meta(raw: object, source: Path | str, max_bytes: int = MAX_META_BYTES,
               stored: bool = False) -> JobMeta:
    """The JobMeta of a meta.json mapping; InputError naming `source` and the field unless
    every value is plain finite JSON (numbers within a float's range), of at most `max_bytes`
    besides `extra.layout` and `extra.clock`, which hold at most META_BYTES_PER_RANK per rank,
    the sizes agree, `extra.layout` is a list of {rank, [dp_rank], [stage], [host]}, one per
    rank of the world size, and `extra.clock` is a mapping. `stored`: a row read back from the
    store, whose `extra.started` that is not a start is ignored (stored before the key was
    the monitor's, it set the job aside)."""
    try:   # (the C encoder: sizes first, before any walk in Python)
        size = len(msgspec.json.encode(raw))
        extra = raw.get("extra") if isinstance(raw, dict) else None
        per_rank = sum(len(msgspec.json.encode(extra[k])) for k in PER_RANK_KEYS
                       if k in extra) if isinstance(extra, dict) else 0
    except (TypeError, ValueError, RecursionError, msgspec.EncodeError):
        per_rank = size = 0   # (named by _check_plain below)
    if size - per_rank > max_bytes:
        raise InputError(source, None, f"{size - per_rank} bytes of metadata besides extra."
                         f"layout and extra.clock; expected at most {max_bytes}")
    _check_plain(raw, source, "", 0)
    meta = meta_from_dict(raw, source)
    for key in ("name", "run_id"):
        check_name(raw.get(key) if isinstance(raw, dict) else None, source, key)
    if meta.world_size > MAX_RANK + 1:
        # the sizes' product is unbounded (dp 10^6 × pp 10^5 × tp 10^5 was a job of 10^16
        # ranks that no upload can complete: ranks stop at MAX_RANK)
        raise InputError(source, "world_size", f"{meta.world_size} ranks (the product of the "
                         f"sizes); expected at most {MAX_RANK + 1}")
    if per_rank > meta.world_size * META_BYTES_PER_RANK:
        raise InputError(source, "extra.layout", f"{per_rank} bytes in extra.layout and extra."
                         f"clock; expected at most {META_BYTES_PER_RANK} per rank "
                         f"({meta.world_size} ranks)")
    layout = meta.extra.get("layout")
    if layout is not None:
        _check_layout(layout, meta, source)
    clock = meta.extra.get("clock")
    if clock is not None and not isinstance(clock, dict):
        raise InputError(source, "extra.clock", f"expected a mapping, got {type(clock).__name__}")
    run = meta.extra.get("run")
    if run is not None and not is_run_token(run):
        raise InputError(source, "extra.run", f"expected a run token (1-64 letters, digits, "
                         f"'-' or '_'), got {str(run)[:40]!r}")
    started = meta.extra.get("started")
    if started is not None and run_started(meta) is None and not stored:
        raise InputError(source, "extra.started", f"expected when the run began, in seconds "
                         f"since 1970 (a number at least 0), got {str(started)[:40]!r}")
    return meta


_RUN_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")


def is_run_token(value: object) -> bool:
    """Whether `value` is a run token (what the recorder puts in extra.run and in the
    X-Stragglers-Run header of every upload: one value per run, shared by its ranks)."""
    return isinstance(value, str) and _RUN_TOKEN.fullmatch(value) is not None


def run_token(raw: object) -> str | None:
    """The run token of a meta.json mapping or JobMeta (None: a writer that sends none)."""
    extra = getattr(raw, "extra", None) if not isinstance(raw, dict) else raw.get("extra")
    run = extra.get("run") if isinstance(extra, dict) else None
    return run if is_run_token(run) else None


# How far two hosts' wall clocks may disagree about when runs began: a job restarted on another
# node whose clock is behind began "before" the run it replaces. NTP keeps hosts within
# milliseconds; ten minutes allows a host without it (or an NTP step); a run the job's row saw
# replaced is refused by its token however close (replaced.py).
STARTED_SKEW_S = 600.0


def started_in_future(raw: object, now: float) -> float | None:
    """extra.started when it lies more than STARTED_SKEW_S past `now` (no run began there: a
    run stamped in the future refused every later run of its job), else None."""
    began = run_started(raw)
    return began if began is not None and began > now + STARTED_SKEW_S else None


def clock_text(seconds: float) -> str:
    """A time in seconds as a message shows it: to the ms, or in 6 digits past 1e15 (1e300's
    300 digits were printed whole)."""
    return f"{seconds:.3f}" if abs(seconds) < 1e15 else f"{seconds:.6g}"


def run_started(raw: object) -> float | None:
    """When a run began by its writer's wall clock (extra.started, seconds since 1970): what
    orders two runs of one job name whose tokens say only that they differ; None when the
    meta.json does not say."""
    extra = getattr(raw, "extra", None) if not isinstance(raw, dict) else raw.get("extra")
    started = extra.get("started") if isinstance(extra, dict) else None
    if isinstance(started, bool) or not isinstance(started, (int, float)):
        return None
    try:   # (an integer past a float's range: 10**400 was a 500, OverflowError, every PUT)
        value = float(started)
    except OverflowError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


def _check_plain(value: object, source, where: str, depth: int) -> None:
    """Finite numbers, strings, booleans, null, lists and string-keyed mappings, not too deep."""
    if depth > MAX_DEPTH:
        raise InputError(source, where or None, f"nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(source, where or None, f"{value!r}; expected a finite number")
    if isinstance(value, int) and not isinstance(value, bool) and \
            not -_FLOAT_MAX <= value <= _FLOAT_MAX:
        # (every reader of the key takes a number as a float: extra.global_batch = 10**400
        # was a 500, OverflowError, at every PUT; the digits are not repeated)
        raise InputError(source, where or None, f"an integer of {len(str(abs(value)))} "
                         "digits; expected a number within a float's range (about 1.8e308)")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise InputError(source, where or None, "expected string keys")
            _check_plain(v, source, f"{where}.{k}" if where else k, depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_plain(v, source, f"{where}[{i}]", depth + 1)
    elif not (value is None or isinstance(value, (str, int, float, bool))):
        raise InputError(source, where or None, f"expected a JSON value, got "
                         f"{type(value).__name__}")


def _check_layout(layout: list, meta: JobMeta, source) -> None:
    """What the monitor adds to the run format's check of `extra.layout` (meta_from_dict: a
    list, each rank once at its own place inside the sizes): one entry per rank of the world
    size, and host names of bounded length."""
    if len(layout) != meta.world_size:
        # a window waits for the layout's ranks: one that left ranks out (or listed none) had
        # its windows cut without them, each analysed as a failure
        raise InputError(source, "extra.layout", f"{len(layout)} entries; expected one per "
                         f"rank of the world size ({meta.world_size}), as the recorder writes")
    for i, entry in enumerate(layout):
        host = entry.get("host")
        if host is not None and not (isinstance(host, str) and len(host) <= _HOST_CHARS):
            raise InputError(source, f"extra.layout[{i}].host", f"expected a name of at most "
                             f"{_HOST_CHARS} characters")
        check_name(host, source, f"extra.layout[{i}].host")


def check_name(value: object, source, where: str) -> None:
    """InputError naming `where` when the string `value` holds a control or bidirectional
    formatting character (_UNSAFE): the one check of every name a job gives that the
    dashboard, /metrics, alerts and logs show, at upload, in a watched meta.json and when a
    stored row is read back."""
    bad = _UNSAFE.search(value) if isinstance(value, str) else None
    if bad is not None:
        # (the character by its code point only: the name itself is not repeated)
        raise InputError(source, where, f"holds U+{ord(bad.group()):04X} at character "
                         f"{bad.start()}; expected a name without control or bidirectional "
                         "formatting characters")


def run_start(raw: object) -> str | None:
    """What identifies one run of a job: the recorder's start clock (one entry per rank, set
    once the ranks met), with the run id; None while it is not known yet."""
    try:
        run = msgspec.convert(raw, _RunMark)
    except msgspec.ValidationError:   # not a mapping, or an extra/clock that is not one
        return None
    start = run.extra.clock.start
    if not isinstance(start, list) or all(e is None for e in start):
        return None
    return json.dumps([run.run_id, start], sort_keys=True)


class _StartClock(msgspec.Struct):
    start: Any = None


class _Extra(msgspec.Struct):
    clock: _StartClock = msgspec.field(default_factory=_StartClock)


class _RunMark(msgspec.Struct):
    """What run_start reads of meta.json."""

    run_id: Any = None
    extra: _Extra = msgspec.field(default_factory=_Extra)


def is_new_run(stored: object, raw: object) -> bool:
    """Whether `raw` (meta.json as it is now) belongs to another run than `stored` (as the
    monitor holds it): the stored run had started (its start clock is known) and the new one
    has not yet, or started at another time. A recorder writes its start clock once and only
    adds the end clock after it, so a run rewriting its own meta.json is never a new run; a
    re-run (`--overwrite`, the same trace directory or job name) always is."""
    tokens = run_token(stored), run_token(raw)
    if None not in tokens:   # (both runs say who they are)
        return tokens[0] != tokens[1]
    old = run_start(stored)
    return old is not None and run_start(raw) != old


class _Twice(Exception):
    """A key given twice in one JSON object (raised while parsing)."""


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Twice(key)
        out[key] = value
    return out


def loads_meta(data: bytes | str, source: Path | str) -> object:
    """meta.json's JSON; InputError naming `source` when it does not parse or a key is given
    twice in one object (JSON leaves which one counts to the reader: the dashboard, the
    store and a script reading the file must not see different sizes)."""
    try:
        return json.loads(data, object_pairs_hook=_unique_pairs)
    except _Twice as exc:
        raise InputError(source, str(exc.args[0])[:80], "given twice in one object; expected "
                         "each key once") from None
    except (ValueError, RecursionError) as exc:
        raise InputError(source, None, f"not readable JSON ({str(exc)[:200]})") from None


class _Sizes(msgspec.Struct):
    """What declared_world reads of meta.json."""

    dp_size: Any = None   # (required, as meta_from_dict requires them)
    pp_size: Any = None
    tp_size: Any = 1
    dsp_size: Any = 1


def declared_world(data: bytes) -> int | None:
    """The world size meta.json's sizes declare, read by the C decoder without building the
    rest (a bound on the body before it is parsed in full); None where they are not integers."""
    try:
        s = msgspec.json.decode(data, type=_Sizes)
    except (msgspec.DecodeError, RecursionError):
        return None
    sizes = (s.dp_size, s.pp_size, s.tp_size, s.dsp_size)
    if not all(type(v) is int and 0 < v <= 10**7 for v in sizes):
        return None
    return sizes[0] * sizes[1] * sizes[2] * sizes[3]


def read_meta_file(path: Path, max_bytes: int = MAX_META_BYTES, within: str = "",
                   world: int = MAX_WORLD) -> object:
    """The JSON of a watched meta.json, opened without blocking and only if it is a regular
    file of at most meta_bytes_limit(`max_bytes`, `world`), and of its own declared world
    (a FIFO named meta.json would block the watcher for good) that lies in the folder `within`
    (when given) once links are followed and has no other name (a hard link), judged on the
    file opened; InputError naming the file otherwise (FileNotFoundError passes)."""
    import os
    import stat

    from stragglers.monitor.part_files import check_opened_within

    base, max_bytes = max_bytes, meta_bytes_limit(max_bytes, world)

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(path, None, "not a regular file; expected the job's JSON metadata")
        if within:
            check_opened_within(fd, st, path, within)
        if st.st_size > max_bytes:
            raise InputError(path, None, f"{st.st_size} bytes; expected at most {max_bytes}")
        data = os.read(fd, max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise InputError(path, None, f"more than {max_bytes} bytes; expected at most {max_bytes}")
    # held to its own world's bound before it is parsed in full (as an uploaded one)
    own = min(declared_world(data) or 0, world)
    if len(data) > meta_bytes_limit(base, own):
        raise InputError(path, None, f"{len(data)} bytes; expected at most "
                         f"{meta_bytes_limit(base, own)} for {own} ranks ({base} besides the "
                         f"per-rank lists, {META_BYTES_PER_RANK} per rank)")
    return loads_meta(data, path)
