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
