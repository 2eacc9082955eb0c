"""Parts checked together (one check per column for a batch): the same result as one by one,
and a bad part in a batch is named while the others are kept."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from monitor_jobs import parts_of, slow_job
from stragglers.errors import InputError
from stragglers.monitor.parts import read_part_file, read_part_files
from stragglers.trace.runformat import write_rank


def test_a_batch_reads_like_each_part_alone_and_names_the_bad_ones(tmp_path):
    trace = slow_job(steps=6, slow=(0, 1, 3.0))
    parts = parts_of(trace, steps_per_part=2)
    paths = [write_rank(tmp_path, r, cols, part=p) for r, p, cols in parts]
    # an optional column only some parts have: they form their own group
    r, p, cols = parts[1]
    paths[1] = write_rank(tmp_path, r, {**cols, "tokens": np.full(len(cols["step"]), 7)},
                          part=p)
    # a part holding another rank's rows, and one that is not Parquet
    r, p, cols = parts[2]
    paths[2] = write_rank(tmp_path, r, {**cols, "rank": np.full(len(cols["rank"]), r + 1)},
                          part=p)
    paths[3].write_bytes(b"not parquet")
    got = read_part_files(paths)
    assert len(got) == len(paths)
    assert isinstance(got[2], InputError) and got[2].field == "rank" \
        and str(paths[2]) in str(got[2])
    assert isinstance(got[3], InputError) and "not a readable Parquet file" in str(got[3])
    for i, (path, data) in enumerate(zip(paths, got)):
        if i in (2, 3):
            continue
        alone = read_part_file(path)
        assert (data.rank, data.part, data.nbytes) == (alone.rank, alone.part, alone.nbytes)
        assert sorted(data.columns) == sorted(alone.columns)
        for k, v in alone.columns.items():
            assert data.columns[k].dtype == v.dtype and np.array_equal(data.columns[k], v), k
    assert "tokens" in got[1].columns and "tokens" not in got[0].columns


def test_parts_with_different_optype_dictionaries_are_decoded_right(tmp_path):
    trace = slow_job(steps=4, slow=(0, 1, 3.0))
    (r0, p0, a), (r1, p1, b) = parts_of(trace, steps_per_part=4)[:2]
    import pyarrow.parquet as pq
    from stragglers.trace.columns import columns_to_table
    from stragglers.trace.model import OPTYPES
    # the second part spells optype as plain strings in reverse dictionary order
    tb = columns_to_table(b)
    names = pa.array([OPTYPES[int(c)] for c in b["optype"]])
    tb = tb.set_column(tb.schema.get_field_index("optype"), "optype",
                       names.dictionary_encode())
    pq.write_table(columns_to_table(a), tmp_path / f"rank-{r0:05d}.part-{p0:06d}.parquet")
    pq.write_table(tb, tmp_path / f"rank-{r1:05d}.part-{p1:06d}.parquet")
    got = read_part_files(sorted(tmp_path.glob("*.parquet")))
    assert np.array_equal(got[0].columns["optype"], a["optype"])
    assert np.array_equal(got[1].columns["optype"], b["optype"])


def _write(path, cols, **kw):
    import pyarrow.parquet as pq
    from stragglers.trace.columns import columns_to_table
    pq.write_table(columns_to_table(cols), path, **kw)
    return path


def test_a_footer_tells_what_a_whole_read_would_refuse_and_sends_the_rest_to_be_read(tmp_path):
    from stragglers.monitor.parts import PartFile, check_file_in_job, read_part_footer
    trace = slow_job(steps=4, slow=(0, 1, 3.0))
    r, p, cols = parts_of(trace, steps_per_part=4)[1]
    name = f"rank-{r:05d}.part-{p:06d}.parquet"
    n = len(cols["step"])

    (tmp_path / "a").mkdir()
    good = read_part_footer(_write(tmp_path / "a" / name, cols))
    alone = read_part_file(tmp_path / "a" / name)
    assert isinstance(good, PartFile)
    assert (good.rank, good.part, good.records, good.first_step, good.last_step, good.nbytes) == \
        (r, p, alone.records, alone.first_step, alone.last_step, alone.nbytes)
    with np.testing.assert_raises(InputError):
        check_file_in_job(good, type("M", (), {"pp_size": int(cols["stage"].max()),
                                              "dp_size": 8})(), "x")

    bad = [  # (field the footer names, columns that a whole read refuses for that field)
        ("rank", {**cols, "rank": np.where(np.arange(n) == 3, r + 1, r)}),
        ("duration", {**cols, "duration": np.where(np.arange(n) == 2, -0.5, cols["duration"])}),
        ("start_ts", {**cols, "start_ts": np.where(np.arange(n) == 1, np.inf, cols["start_ts"])}),
        ("step", {**cols, "step": np.where(np.arange(n) == 0, -1, cols["step"])}),
        # epoch milliseconds read as seconds, and a duration no clock measures
        ("start_ts", {**cols, "start_ts": cols["start_ts"] * 1e3 + 1.8e12}),
        ("duration", {**cols, "duration": np.where(np.arange(n) == 2, 2e11, cols["duration"])}),
    ]
    for i, (field, c) in enumerate(bad):
        d = tmp_path / f"bad{i}"
        d.mkdir()
        got = read_part_footer(_write(d / name, c))
        assert isinstance(got, InputError) and got.field == field, (field, got)
        with np.testing.assert_raises(InputError):
            read_part_file(d / name)

    # a column the op table does not have (here a nested one, first) is refused by name
    import pyarrow.parquet as pq
    from stragglers.trace.columns import columns_to_table
    d = tmp_path / "nested"
    d.mkdir()
    table = columns_to_table(cols)
    pq.write_table(table.add_column(0, "extra", pa.array([{"a": 1, "b": 2.0}] * n)), d / name)
    nested = read_part_footer(d / name)
    assert isinstance(nested, InputError) and nested.field == "extra", nested
    with np.testing.assert_raises(InputError):
        read_part_file(d / name)

    # what the footer cannot tell goes to a whole read: no statistics, a step range with gaps
    d = tmp_path / "nostats"
    d.mkdir()
    assert read_part_footer(_write(d / name, cols, write_statistics=False)) is None
    d = tmp_path / "gaps"
    d.mkdir()
    assert read_part_footer(_write(d / name, {**cols, "step": cols["step"] * 10**6})) is None
    # NaN is not in Parquet's min/max: the footer passes it, the window's read refuses it
    d = tmp_path / "nan"
    d.mkdir()
    nan = {**cols, "duration": np.where(np.arange(n) == 4, np.nan, cols["duration"])}
    assert isinstance(read_part_footer(_write(d / name, nan)), PartFile)


def test_schema_checks_remembered_per_schema_never_mix_two_schemas(tmp_path):
    # the footer check keeps what a schema tells (columns, types, leaves) for the next parts
    # of that schema: parts of different schemas, interleaved, each get their own verdict
    import pyarrow.parquet as pq
    from stragglers.monitor.parts import PartFile, read_part_footer
    from stragglers.trace.columns import columns_to_table

    trace = slow_job(steps=4, slow=(0, 1, 3.0))
    r, p, cols = parts_of(trace, steps_per_part=4)[1]
    name = f"rank-{r:05d}.part-{p:06d}.parquet"
    table = columns_to_table(cols)
    kinds = {
        "good": table,
        "text": table.set_column(table.schema.get_field_index("duration"), "duration",
                                 pa.array([str(x) for x in cols["duration"]])),
        "float ids": table.set_column(table.schema.get_field_index("step"), "step",
                                      pa.array(cols["step"].astype(float))),
        "missing": table.drop_columns(["stage"]),
    }
    for round_ in range(2):
        for kind, t in kinds.items():
            d = tmp_path / f"{kind}-{round_}"
            d.mkdir()
            pq.write_table(t, d / name)
            got = read_part_footer(d / name)
            if kind == "good":
                assert isinstance(got, PartFile) and got.records == len(cols["step"])
            elif kind == "float ids":
                assert got is None   # whole numbers stored as floats: read row by row
            else:
                assert isinstance(got, InputError), (kind, got)
                assert got.field == ("duration" if kind == "text" else "stage")
                assert str(d / name) in str(got)   # the error names this part, not the first


def test_a_part_whose_start_times_go_back_against_its_seq_ids_is_refused_alone(tmp_path):
    # a part's start times reversed (valid values each) made the engine find cyclic
    # dependencies: an error row for every rank of its window; now the part is refused, named,
    # and the others of its batch are kept
    trace = slow_job(steps=4, slow=None)
    parts = parts_of(trace, steps_per_part=2)
    paths = [write_rank(tmp_path, r, cols, part=p) for r, p, cols in parts]
    r, p, cols = parts[1]
    paths[1] = write_rank(tmp_path, r, {**cols, "start_ts": cols["start_ts"][::-1].copy()},
                          part=p)
    got = read_part_files(paths)
    assert isinstance(got[1], InputError) and got[1].field == "start_ts", got[1]
    assert "start order" in got[1].problem
    assert not any(isinstance(g, InputError) for i, g in enumerate(got) if i != 1)
    # equal start times are no reversal
    r, p, cols = parts[2]
    flat = {**cols, "start_ts": np.zeros_like(cols["start_ts"])}
    assert not isinstance(read_part_files([write_rank(tmp_path / "flat", r, flat, part=p)])[0],
                          InputError)
