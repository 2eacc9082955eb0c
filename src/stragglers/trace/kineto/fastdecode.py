"""Decode a Kineto file with msgspec: typed structs that hold only the fields the reader uses.

The stdlib decoder builds every key and value of every event before the reader throws most of
them away (kernel launch geometry, occupancy, External id, Input Dims, …); a msgspec Struct
skips undeclared fields while parsing, without building them. The file is read a chunk at a
time (1 MB): the events up to the last boundary between two events in the chunk are decoded,
filed as compact tuples and dropped, so neither the file's text nor its decoded events exist
whole; memory is one chunk plus the tuples kept. msgspec is a base dependency but optional at run time; without
it, `events` uses the stdlib.
"""

from __future__ import annotations

import re
import zlib
from typing import Annotated, Any

from stragglers.trace.jsontypes import JsonValue
from stragglers.trace.kineto.events import RUN_ID_KEYS, TOP_KEYS, TopLevel

try:
    import msgspec
except ImportError:  # the stdlib path in events.read_rank_events takes over
    # mypy types the name as the module; None is how this file says it is absent
    msgspec = None  # type: ignore[assignment]

AVAILABLE = msgspec is not None

if AVAILABLE:
    _UNSET = msgspec.UNSET

    class _Args(msgspec.Struct, gc=False):
        """events.EventArgs: the event args the reader reads; values unchecked (events.py)."""

        correlation: Any = None
        collective_name: Any = msgspec.field(default=None, name="Collective name")
        pg_name: Any = msgspec.field(default=None, name="Process Group Name")
        seq: Any = msgspec.field(default=None, name="Seq")
        src_rank: Any = msgspec.field(default=None, name="Src Rank")
        dst_rank: Any = msgspec.field(default=None, name="Dst Rank")
        # Lists, rarely needed: kept as raw JSON and decoded only when asked for.
        concrete: msgspec.Raw | msgspec.UnsetType = msgspec.field(
            default=_UNSET, name="Concrete Inputs")
        dims: msgspec.Raw | msgspec.UnsetType = msgspec.field(default=_UNSET, name="Input Dims")
        pg_ranks: Any = msgspec.field(default=None, name="Process Group Ranks")
        out_split: Any = msgspec.field(default=None, name="Out split size")
        in_split: Any = msgspec.field(default=None, name="In split size")

        def concrete_inputs(self) -> JsonValue:
            """'Concrete Inputs' decoded (kept raw until asked for), or None."""
            if self.concrete is _UNSET:
                return None
            return msgspec.json.decode(self.concrete)

        def input_dims(self) -> JsonValue:
            """'Input Dims' decoded (kept raw until asked for), or None."""
            if self.dims is _UNSET:
                return None
            return msgspec.json.decode(self.dims)

    _NO_ARGS = _Args()

    class _Event(msgspec.Struct, gc=False):
        """One trace event, reduced to what the reader reads."""

        # Finite numbers here, or the file goes to the stdlib decoder and its exact errors.
        ts: Annotated[float, msgspec.Meta(ge=-1e300, le=1e300)]
        ph: Any = _UNSET
        name: Any = None
        cat: Any = None
        dur: Annotated[float, msgspec.Meta(ge=0.0, le=1e300)] = 0.0
        tid: Any = None
        args: _Args | None = None

    class _Doc(msgspec.Struct, gc=False):
        """The document without its events, and the few top-level keys read."""

        traceEvents: list[msgspec.Raw] | msgspec.UnsetType = _UNSET  # noqa: N815  (the JSON name)
        distributedInfo: Any = _UNSET  # noqa: N815
        baseTimeNanoseconds: Any = _UNSET  # noqa: N815
        host_name: Any = _UNSET
        record_shapes: Any = _UNSET
        distinct_run_id: Any = _UNSET
        run_id: Any = _UNSET
        job_id: Any = _UNSET
        TORCHELASTIC_RUN_ID: Any = _UNSET  # noqa: N815

    _DOC = msgspec.json.Decoder(_Doc)
    _EVENTS = msgspec.json.Decoder(list[_Event])


# Bytes read at a time: events are decoded a chunk at a time, so memory holds about one chunk
# of text and its decoded events, not the whole file.
CHUNK_BYTES = 1 << 20
# Give up streaming (and let the stdlib report the problem) when no event boundary decodes
# within this much text.
MAX_PENDING_BYTES = 64 << 20
_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
# Candidate cuts between two events: '}' ',' '{' (a cut inside a string or a nested object
# makes the chunk invalid JSON, which the decoder then refuses, so a wrong guess is safe).
_BETWEEN = re.compile(rb"\}\s*(,)\s*\{")
_END = re.compile(rb"\}\s*(\])|\[\s*(\])")


def decode_stream(stream, collector) -> TopLevel | None:
    """File every complete event of the JSON document read from the binary `stream` through
    `collector.file(...)` (a collector made with checked=True: ts and dur arrive as finite
    floats), a chunk at a time.

    Returns the document's top-level keys the reader needs (`traceEvents` an empty list),
    or None when this decoder cannot take the file as a plain
    trace (invalid JSON, NaN, a non-object event or args, no `traceEvents` array): the caller
    then decodes it with the stdlib, whose errors name the place.
    """
    try:
        return _decode_stream(stream, collector)
    except (msgspec.DecodeError, msgspec.ValidationError, EOFError, OSError, zlib.error):
        return None


def _decode_stream(stream, collector) -> TopLevel | None:
    buf = bytearray()
    while True:  # the text before the events array
        m = _EVENTS_KEY.search(buf)
        if m:
            break
        chunk = stream.read(CHUNK_BYTES)
        if not chunk or len(buf) > MAX_PENDING_BYTES:
            return None
        buf += chunk
    prefix = bytes(buf[:m.end() - 1])
    del buf[:m.end() - 1]  # buf starts with the array's '['
    count, eof = 0, False
    while True:
        taken = _take(buf, _BETWEEN, last=True)
        if taken is None and eof:
            taken = _take(buf, _END, last=False)
            if taken is None:
                return None
            count += _file_events(taken[1], collector)
            # the document without its events, in place: a copy of a long tail (up to
            # MAX_PENDING_BYTES) would double what is held
            del buf[:taken[0] + 1]
            buf[:0] = prefix + b"[]"
            break
        if taken is not None:
            count += _file_events(taken[1], collector)
            del buf[:taken[0]]
            buf[0] = 0x5B  # the ',' after the last filed event opens the next chunk: '['
            continue
        if len(buf) > MAX_PENDING_BYTES:
            return None
        chunk = stream.read(CHUNK_BYTES)
        eof = not chunk
        buf += chunk
    doc = _DOC.decode(buf)
    del buf
    if doc.traceEvents != []:
        return None  # the key found was not the document's own events array
    collector.out.events += count
    present = {attr: getattr(doc, key) for key, attr in TOP_KEYS.items()
               if key != "traceEvents" and getattr(doc, key) is not _UNSET}
    run_ids = {k: getattr(doc, k) for k in RUN_ID_KEYS if getattr(doc, k) is not _UNSET}
    return TopLevel(events=[], **present, run_ids=run_ids)


def _take(buf: bytearray, pattern: re.Pattern, last: bool) -> tuple[int, list] | None:
    """(index of the separator, decoded events) for the events from buf[0] ('[') up to a
    separator: a ',' between two events (the last that decodes, looked for in the buffer's
    tail) or the array's closing ']' (the first that decodes). None when no candidate decodes
    (the caller reads more). A well-formed chunk with a wrong type raises ValidationError."""
    start = max(0, len(buf) - (1 << 16)) if last else 0
    # each alternative of the separator patterns has one group: a match always sets lastindex
    found = [m.start(m.lastindex or 0) for m in pattern.finditer(buf, start)]
    for pos in (found[::-1] if last else found)[:4]:
        try:
            return pos, _EVENTS.decode(bytes(buf[:pos]) + b"]")
        except msgspec.DecodeError:
            continue
    return None


def _file_events(events: list, collector) -> int:
    """File the complete events of a decoded chunk; returns how many events it held."""
    file, count = collector.file, 0
    for ev in events:
        ph = ev.ph
        if ph is _UNSET:
            continue  # not an event (the stdlib hook keeps such objects, unread)
        count += 1
        if ph == "X":
            a = ev.args
            if a is None:
                file(ev.name, ev.cat, ev.ts, ev.dur, ev.tid, None, _NO_ARGS)
            else:
                file(ev.name, ev.cat, ev.ts, ev.dur, ev.tid, a.correlation, a)
    return count
