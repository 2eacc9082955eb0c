"""Conversion is lossless, starting from a run the recorder really wrote (one process, CPU)."""

from __future__ import annotations

import json
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stragglers.trace.convert import convert
from stragglers.trace.model import OPTIONAL_COLUMNS, JobMeta
from stragglers.trace.ndtimeline import read_ndtimeline
from stragglers.trace.runformat import read_run
from stragglers.whatif import analyze

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory):
    """A 1-process run with sequence lengths on compute ops, written in one part per step."""
    from stragglers.record import Recorder

    out = tmp_path_factory.mktemp("rec") / "run"
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    meta = JobMeta(name="tiny", dp_size=1, pp_size=1, extra={"injections": []})
    with Recorder(out, meta, dp_rank=0, stage=0, flush_every=1, flush_interval_s=0.05) as rec:
        for step in range(5):
            with rec.step(step):
                for mb in range(3):
                    x = torch.randn(8, 16)
                    lens = [4 + mb, 4 - mb + step]
                    with rec.op("forward-compute", mb, seq_lens=lens):
                        loss = model(x).square().mean()
                    with rec.op("backward-compute", mb, seq_lens=lens):
                        loss.backward()
                with rec.op("optimizer"):
                    opt.step()
                    opt.zero_grad()
            # the writer takes every step pending when it wakes: on a busy machine it may
            # wake once for all five, so each step waits for its part (parts are the point here)
            deadline = time.monotonic() + 120
            while rec._writer.parts_written < step + 1 and time.monotonic() < deadline:
                time.sleep(0.01)
    return out


def ordered(trace):
    """The trace's columns in one canonical row order."""
    o = trace.ops
    key = np.lexsort((o["seq_id"], o["optype"], o["step"], o["rank"]))
    return {k: v[key] for k, v in o.items()}


def assert_same(a, b):
    oa, ob = ordered(a), ordered(b)
    assert set(oa) == set(ob), (sorted(oa), sorted(ob))
    for col in oa:
        assert oa[col].dtype == ob[col].dtype, col
        np.testing.assert_array_equal(oa[col], ob[col], err_msg=col)
    assert a.meta == b.meta
    assert a.notes == b.notes


def test_recorded_run_carries_the_optional_columns(recorded_run):
    trace = read_run(recorded_run)
    assert {"attn_cost", "tokens"} <= set(trace.ops)
    fwd = trace.ops["optype"] == 0
    assert (trace.ops["tokens"][fwd] > 0).all() and np.isfinite(trace.ops["attn_cost"][fwd]).all()
    assert len(list(recorded_run.glob("rank-*.part-*.parquet"))) >= 2  # several parts per rank


def test_run_to_ndtimeline_to_run_is_lossless(recorded_run, tmp_path):
    original = read_run(recorded_run)
    original.note("clock", "single process: one clock")  # notes travel too
    from stragglers.trace.runformat import write_run

    write_run(tmp_path / "noted", original)
    convert(tmp_path / "noted", tmp_path / "nd" / "trace-tiny.parquet")
    nd = read_ndtimeline(tmp_path / "nd" / "trace-tiny.parquet")
    assert_same(original, nd)
    convert(tmp_path / "nd" / "trace-tiny.parquet", tmp_path / "back")
    back = read_run(tmp_path / "back")
    assert_same(original, back)
    # The same trace gives the same analysis, whichever file it came from.
    a, b = analyze(original).to_dict(), analyze(back).to_dict()
    a["job"].pop("source"), b["job"].pop("source")
    assert a == b


def test_optional_column_missing_from_some_files_is_kept(recorded_run, tmp_path):
    convert(recorded_run, tmp_path / "copy")
    original = read_run(tmp_path / "copy")
    # One more rank file without the optional columns: the other ranks' values must survive.
    victim = sorted((tmp_path / "copy").glob("rank-*.parquet"))[0]
    table = pq.read_table(victim)
    twin = table.drop_columns([c for c in OPTIONAL_COLUMNS if c in table.column_names])
    ones = pa.array(np.ones(twin.num_rows, dtype=np.int32))
    for col in ("rank", "dp_rank"):  # the same ops, as a second DP rank
        twin = twin.set_column(twin.column_names.index(col), col, ones)
    pq.write_table(twin, tmp_path / "copy" / "rank-00001.parquet")
    meta = json.loads((tmp_path / "copy" / "meta.json").read_text())
    meta.update(dp_size=2, world_size=2)
    (tmp_path / "copy" / "meta.json").write_text(json.dumps(meta))
    mixed = read_run(tmp_path / "copy")
    assert {"attn_cost", "tokens"} <= set(mixed.ops)
    mine = mixed.ops["rank"] == 0
    np.testing.assert_array_equal(np.sort(mixed.ops["tokens"][mine]),
                                  np.sort(original.ops["tokens"]))
    assert (mixed.ops["tokens"][~mine] == -1).all()
    assert np.isnan(mixed.ops["attn_cost"][~mine]).all()
