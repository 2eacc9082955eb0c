"""attach's native (C++) hooks: built here, the same rows as the Python hooks, their decoding,
and what happens without them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from test_record_attach import make, rows, train

from stragglers.record import attach, native
from stragglers.trace.model import OPTYPE_CODES
from stragglers.trace.runformat import read_run

FWD, BWD = OPTYPE_CODES["forward-compute"], OPTYPE_CODES["backward-compute"]
AR, GC = OPTYPE_CODES["grads-all-reduce"], OPTYPE_CODES["gc"]


def test_the_native_hooks_are_built_where_a_compiler_exists():
    # `make` builds them; a machine with a compiler that silently falls back would record at
    # ten times the cost per op without anyone noticing
    if not (shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")):
        pytest.skip("no C++ compiler: attach records with its Python hooks")
    assert native.load() is not None, native.last_error()


def recorded(tmp_path, name: str, hooks: str, monkeypatch, wrap: bool = False,
             seq: bool = False):
    """A short loop recorded with the native or the Python hooks: (trace, parameters).

    With `seq` (a seq_lens callback) the native forward hands each microbatch to Python;
    without, it times them in C++ alone."""
    monkeypatch.setenv(native.ENV, "1" if hooks == "native" else "0")
    model, opt = make()
    if wrap:
        model = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with attach(model, opt, tmp_path / name, flush_interval_s=0.01,
                seq_lens=(lambda x: [6, 2]) if seq else None) as att:
        assert (att._native is not None) == (hooks == "native")
        train(model, opt, steps=4, microbatches=3)
    return read_run(tmp_path / name), [p.detach().clone() for p in model.parameters()]


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def _same_recording(a, b, steps) -> None:
    for step in steps:
        # as multisets: a bucket's all-reduce starts where its backward span is split, an
        # instant both rows share under the native hooks (ties sort by end)
        assert sorted(rows(a.ops, step)) == sorted(rows(b.ops, step)), step
    # GC rows aside: a collection may pause one run and not the other
    ka, kb = a.ops["optype"] != GC, b.ops["optype"] != GC
    for col in ("attn_cost", "tokens", "bytes"):
        assert np.array_equal(np.sort(a.ops[col][ka]), np.sort(b.ops[col][kb]),
                              equal_nan=True), col


@pytest.mark.slow
@pytest.mark.skipif(native.load() is None, reason="native hooks not built")
@pytest.mark.parametrize("seq", [False, True])
def test_native_and_python_hooks_record_the_same_rows_of_a_plain_loop(tmp_path, monkeypatch,
                                                                      seq):
    py, p_params = recorded(tmp_path, "py", "python", monkeypatch, seq=seq)
    nat, n_params = recorded(tmp_path, "nat", "native", monkeypatch, seq=seq)
    _same_recording(py, nat, range(4))
    comp = np.isin(nat.ops["optype"], (FWD, BWD))
    assert np.all(nat.ops["tokens"][comp] == (8 if seq else -1))
    assert all(torch.equal(a, b) for a, b in zip(p_params, n_params))
    assert np.all(nat.ops["duration"] >= 0)


@pytest.mark.slow
@pytest.mark.skipif(native.load() is None, reason="native hooks not built")
def test_native_and_python_hooks_record_the_same_rows_under_ddp(tmp_path, monkeypatch,
                                                                one_rank_group):
    py, p_params = recorded(tmp_path, "py", "python", monkeypatch, wrap=True)
    nat, n_params = recorded(tmp_path, "nat", "native", monkeypatch, wrap=True)
    assert sorted(set(nat.ops["step"].tolist())) == [1, 2, 3]  # DDP's first step is not
    _same_recording(py, nat, range(1, 4))
    ar = nat.ops["optype"] == AR
    bwd = nat.ops["optype"] == BWD
    span_ends = nat.ops["start_ts"][bwd] + nat.ops["duration"][bwd]
    for start in nat.ops["start_ts"][ar]:  # each starts where a backward span was split
        assert np.min(np.abs(span_ends - start)) <= 1e-9, start
    # no no_sync in this loop: one bucket all-reduced per microbatch, 3 steps x 3 microbatches
    assert ar.sum() == 9 and np.all(nat.ops["bytes"][ar] == 4 * sum(p.numel() for p in n_params))
    assert all(torch.equal(a, b) for a, b in zip(p_params, n_params))


def stamp(kind, ident, t, nbytes=0):
    return np.array([kind, ident, t, nbytes], np.int64).tobytes()


def test_stamps_become_rows_split_at_buckets_with_gc_inside_and_queued_buckets_in_order():
    events = [stamp(native.FWD, 0, 20, 90),  # a forward: (mb, start, end)
              stamp(native.BWD_START, 0, 100), stamp(native.BUCKET_READY, 0, 150, 64),
              stamp(native.BUCKET_READY, 1, 180, 32), stamp(native.BUCKET_DONE, 0, 200),
              stamp(native.BWD_END, -1, 210), stamp(native.BUCKET_DONE, 1, 260)]
    gc = [(30, 40), (110, 120), (300, 310)]
    # drained in two batches, out of order within them: decoded in time order
    out = native.stamp_rows([b"".join(events[4:]), b"".join(events[:4])],
                            {0: (40.0, 8)}, gc, stage=2)
    fwd = [r for r in out if r[0] == FWD]
    bwd = [r for r in out if r[0] == BWD]
    ar = [r for r in out if r[0] == AR]
    assert [(r[1], r[2], r[3], r[6], r[7], r[9]) for r in fwd] == [(20, 90, 0, 40.0, 8, (10,))]
    assert [(r[1], r[2], r[3]) for r in bwd] == [(100, 150, 0), (150, 180, 0), (180, 210, 0)]
    assert [(r[6], r[7]) for r in bwd] == [(40.0, 8)] * 3
    assert [r[9] for r in bwd] == [(10,), (), ()]  # the pause inside the first span
    assert gc == [(300, 310)]                       # ... taken out; the one outside stays
    # bucket 1 was ready at 180 but waited behind bucket 0 until 200
    assert [(r[1], r[2], r[5], r[8]) for r in ar] == [(150, 200, 2, 64), (200, 260, 2, 32)]
    assert native.last_stamp([b"".join(events)]) == 260 and native.last_stamp([]) is None
    assert native.last_stamp([stamp(native.BWD_END, -1, 50), stamp(native.FWD, 1, 60, 75)]) == 75


def test_without_built_hooks_attach_says_so_once_and_records_with_python_hooks(
        tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "empty"))
    monkeypatch.delenv(native.ENV, raising=False)
    monkeypatch.setattr(native, "_loaded", native._Loaded())
    monkeypatch.setattr(native, "_told", False)
    model, opt = make()
    for k in range(2):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with attach(model, opt, tmp_path / f"run{k}", flush_interval_s=0.01) as att:
                train(model, opt, steps=2, microbatches=2)
        said = [str(w.message) for w in seen if "native hooks" in str(w.message)]
        assert att._native is None
        assert len(said) == (1 if k == 0 else 0), said
        if said:
            assert "not built" in said[0] and "stragglers.record.native" in said[0]
        assert rows(read_run(tmp_path / f"run{k}").ops, 1)  # recorded all the same


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to answer torch's checks")
def test_a_failed_build_is_one_line_and_a_nonzero_exit(tmp_path):
    # a compiler that answers torch's version checks as g++ does and fails to compile
    cxx = tmp_path / "cxx"
    cxx.write_text('#!/bin/sh\ncase "$*" in *--version*) exec g++ "$@";; esac\n'
                   'echo "cxx: error: no compiling today" >&2\nexit 1\n')
    cxx.chmod(0o755)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "CXX": str(cxx),
           "MAX_JOBS": "1"}
    proc = subprocess.run([sys.executable, "-m", "stragglers.record.native"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # one line: no traceback, none of torch's multi-line compiler banners
    assert proc.stderr.strip().splitlines() == [
        "stragglers.record.native: could not build the native hooks: cxx: error: no compiling "
        "today"], proc.stderr


@st.composite
def step_events(draw):
    """One step's stamps as the hooks make them: forwards, backward passes (some ended), and
    DDP buckets ready inside a pass, done later (some never)."""
    t, events, queued = 0, [], []
    for mb in range(draw(st.integers(0, 4))):
        t += draw(st.integers(1, 50))
        end = t + draw(st.integers(0, 50))
        events.append((native.FWD, mb, t, end))
        t = end + draw(st.integers(0, 20))
        events.append((native.BWD_START, mb, t, 0))
        for bucket in range(draw(st.integers(0, 3))):
            t += draw(st.integers(0, 30))
            events.append((native.BUCKET_READY, bucket, t, draw(st.integers(1, 1 << 20))))
            queued.append((bucket, t))
        if draw(st.booleans()) or mb < 3:  # the last pass may have raised: no end
            t += draw(st.integers(0, 30))
            events.append((native.BWD_END, -1, t, 0))
        for bucket, ready in queued:
            if draw(st.integers(0, 9)):  # a few never complete (the step was cut short)
                events.append((native.BUCKET_DONE, bucket, ready + draw(st.integers(0, 200)), 0))
        queued = []
    # no two instants alike (a clock read takes tens of ns): ties broken in causal order
    events = [(k, i, t * 1000 + n, v * 1000 + n if k == native.FWD else v)
              for n, (k, i, t, v) in enumerate(events)]
    draw(st.randoms()).shuffle(events)  # drained in any order: decoded in time order
    return [np.array(events, np.int64).reshape(-1, 4).tobytes()]


def read_one_by_one(stamps: list[bytes], stage: int) -> list[tuple]:
    """The reference: one step's stamps read event by event in time order, as the hooks mean
    them — (code, start, end, mb, mc, gmc, tokens, bytes) rows."""
    flat = np.frombuffer(b"".join(stamps), np.int64).reshape(-1, 4)
    rows, bwd, ready, last_end = [], None, {}, 0
    for kind, ident, t, value in flat[np.argsort(flat[:, 2], kind="stable")].tolist():
        if kind == native.FWD:
            rows.append((FWD, t, value, ident, 0, 0, -1, -1))
        elif kind == native.BWD_START:
            bwd = (ident, t)
        elif kind == native.BWD_END and bwd is not None:
            rows.append((BWD, bwd[1], t, bwd[0], 0, 0, -1, -1))
            bwd = None
        elif kind == native.BUCKET_READY:
            ready[ident] = (t, value)
            if bwd is not None:  # the span is cut where the bucket went out
                rows.append((BWD, bwd[1], t, bwd[0], 0, 0, -1, -1))
                bwd = (bwd[0], t)
        elif kind == native.BUCKET_DONE and ident in ready:
            start, nbytes = ready.pop(ident)
            start = min(max(start, last_end), t)  # queued behind the bucket before it
            last_end = max(last_end, t)
            rows.append((AR, start, t, -1, 0, stage, -1, nbytes))
    return rows


@pytest.mark.slow
@given(st.lists(step_events(), min_size=1, max_size=4))
@settings(max_examples=200, deadline=None)
def test_stamps_decoded_together_are_what_reading_them_event_by_event_makes(steps):
    cols = native.stamp_columns(list(range(len(steps))), steps, stage=1)
    together = sorted(zip(*(v.tolist() for v in (
        cols.step, cols.code, cols.start, cols.end, cols.mb, cols.mc, cols.gmc, cols.tokens,
        cols.bytes))))
    alone = sorted((s, *r) for s, stamps in enumerate(steps)
                   for r in read_one_by_one(stamps, stage=1))
    assert together == alone
    assert np.isnan(cols.attn).all()
    # the writer's path for steps with something to place gives the same rows
    assert sorted((s, *r[:6], r[7], r[8]) for s, stamps in enumerate(steps)
                  for r in native.stamp_rows(stamps, {}, [], stage=1)) == alone
