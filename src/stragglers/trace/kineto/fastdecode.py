"""Decode a Kineto file with msgspec: typed structs that hold only the fields the reader uses.

The stdlib decoder builds every key and value of every event before the reader throws most of
them away (kernel launch geometry, occupancy, External id, Input Dims, …); a msgspec Struct
skips undeclared fields while parsing, without building them. The events array is first
split into raw byte slices (`msgspec.Raw`, views of the input) and each slice is decoded and
filed at once, so the decoded events never exist together: memory stays about the file's bytes
plus the compact tuples. msgspec is optional (extra `fast`); without it, `events` uses the
stdlib.
"""

from __future__ import annotations

from typing import Annotated, Any

try:
    import msgspec
except ImportError:  # the stdlib path in events.read_rank_events takes over
    msgspec = None

AVAILABLE = msgspec is not None

# Document keys the reader reads (events.RUN_ID_KEYS included); everything else is skipped.
_TOP_KEYS = ("distributedInfo", "baseTimeNanoseconds", "host_name", "record_shapes",
             "distinct_run_id", "run_id", "job_id", "TORCHELASTIC_RUN_ID")

if AVAILABLE:
    _UNSET = msgspec.UNSET

    class _Args(msgspec.Struct, gc=False):
        """The event args the reader reads; values stay untyped (checked by events.py)."""

        correlation: Any = None
        collective_name: Any = msgspec.field(default=None, name="Collective name")
        pg_name: Any = msgspec.field(default=None, name="Process Group Name")
        seq: Any = msgspec.field(default=None, name="Seq")
        src_rank: Any = msgspec.field(default=None, name="Src Rank")
        dst_rank: Any = msgspec.field(default=None, name="Dst Rank")
        # Lists, rarely needed: kept as raw JSON and decoded only when asked for.
        concrete_inputs: msgspec.Raw = msgspec.field(default=_UNSET, name="Concrete Inputs")
        pg_ranks: Any = msgspec.field(default=None, name="Process Group Ranks")

        def get(self, key: str, default: Any = None) -> Any:
            """dict.get over the JSON names, so events.py reads both decoders' args alike."""
            attr = _ARG_ATTR.get(key)
            if attr is None:
                return default
            value = getattr(self, attr)
            if attr == "concrete_inputs":
                if value is _UNSET:
                    return default
                value = msgspec.json.decode(value)
            return default if value is None else value

    _ARG_ATTR = {f.encode_name: f.name for f in msgspec.structs.fields(_Args)}
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
        """The document: the events as raw slices, and the few top-level keys read."""

        traceEvents: list[msgspec.Raw] = _UNSET  # noqa: N815  (the JSON name)
        distributedInfo: Any = _UNSET  # noqa: N815
        baseTimeNanoseconds: Any = _UNSET  # noqa: N815
        host_name: Any = _UNSET
        record_shapes: Any = _UNSET
        distinct_run_id: Any = _UNSET
        run_id: Any = _UNSET
        job_id: Any = _UNSET
        TORCHELASTIC_RUN_ID: Any = _UNSET  # noqa: N815

    _DOC = msgspec.json.Decoder(_Doc)
    _EVENT = msgspec.json.Decoder(_Event)


def decode_events(raw: bytes, collector) -> dict | None:
    """File every complete event of the JSON document `raw` through `collector.file(...)`
    (a collector made with checked=True: ts and dur arrive as finite floats).

    Returns the document's top-level keys the reader needs (as a dict, absent keys left out,
    `traceEvents` as an empty list when it is a list), or None when msgspec cannot decode the
    file as a plain trace (invalid JSON, NaN, a non-object event, non-object args): the caller
    then decodes it with the stdlib, whose errors name the place.
    """
    try:
        doc = _DOC.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    events = doc.traceEvents
    top = {k: getattr(doc, k) for k in _TOP_KEYS if getattr(doc, k) is not _UNSET}
    if events is _UNSET:
        return top  # events.py says it is missing
    doc = None
    decode, file, count = _EVENT.decode, collector.file, 0
    try:
        for i in range(len(events)):
            ev = decode(events[i])
            events[i] = None  # its slice is no longer needed
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
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    collector.out.events += count
    top["traceEvents"] = []
    return top
