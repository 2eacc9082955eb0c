"""Every column of a run's rank file replaced by each kind of hostile value, read by both of
the CLI's ways (the whole trace, and step partitions), and of an NDTimeline trace: the analysis
or one InputError, never another exception and never a warning (the CLI prints both as more
than one line; the red team found these one column and one kind at a time)."""

from __future__ import annotations

import shutil
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stragglers.errors import StragglersError
from stragglers.trace.load import load_trace
from stragglers.trace.model import OPTIONAL_COLUMNS
from stragglers.trace.ndtimeline import write_ndtimeline
from stragglers.trace.runformat import write_run
from stragglers.trace.synth import generate
from stragglers.whatif import analyze
from stragglers.whatif.partitioned import analyze_run


def hostile(n: int) -> dict[str, pa.Array]:
    """Each kind of value a column may hold that a recorder never writes."""
    return {
        "nan": pa.array([float("nan")] * n), "inf": pa.array([float("inf")] * n),
        "-inf": pa.array([-float("inf")] * n), "1e300": pa.array([1e300] * n),
        "-1e300": pa.array([-1e300] * n),
        "nulls": pa.array([None] * n, pa.int64()),
        "float-nulls": pa.array([None] * n, pa.float64()),
        "one-null": pa.array([None] + [1] * (n - 1), pa.int64()),
        "strings": pa.array(["x"] * n), "dictionary": pa.array(["x"] * n).dictionary_encode(),
        "bools": pa.array([True] * n), "int64-max": pa.array([2 ** 63 - 1] * n, pa.int64()),
        "int64-min": pa.array([-2 ** 63] * n, pa.int64()),
        "uint64-max": pa.array([2 ** 64 - 1] * n, pa.uint64()),
        "-1": pa.array([-1] * n, pa.int64()), "0": pa.array([0] * n, pa.int64()),
        "int8": pa.array([1] * n, pa.int8()), "float16": pa.array(np.ones(n, np.float16)),
        "lists": pa.array([[1]] * n), "structs": pa.array([{"a": 1}] * n),
        "bytes": pa.array([b"\xff"] * n), "timestamps": pa.array([0] * n, pa.timestamp("s")),
        "decimals": pa.array([1] * n, pa.decimal128(5, 0)),
        "dates": pa.array([0] * n, pa.date32()), "empty-strings": pa.array([""] * n),
        "long-strings": pa.array(["y" * 100_000] * n),
    }


@pytest.fixture(scope="module", params=["run", "ndtimeline"])
def job(request, tmp_path_factory):
    """(folder, the file whose columns are spoiled, its readers) of a small job's trace."""
    where = tmp_path_factory.mktemp("sweep") / "job"
    trace = generate(dp=2, pp=2, microbatches=2, steps=4, seed=0, slow_worker=(1, 1, 2.0))
    if request.param == "run":
        write_run(where, trace)
        return where, sorted(where.glob("rank-*.parquet"))[0].name, {
            "whole": lambda d: analyze(load_trace(d)), "partitions": analyze_run}
    where.mkdir()
    path, _ = write_ndtimeline(trace, where / "trace-job.parquet")
    return where, path.name, {"whole": lambda d: analyze(load_trace(d / path.name))}


@pytest.mark.parametrize("column", ["rank", "dp_rank", "stage", "step", "optype", "start_ts",
                                    "duration", "seq_id", "mb_id", "mc", "gmc",
                                    *OPTIONAL_COLUMNS])
def test_a_column_of_any_hostile_kind_is_read_or_refused_in_one_error(job, tmp_path, column):
    folder, name, readers = job
    table = pq.read_table(folder / name)
    failures = []
    for kind, values in hostile(table.num_rows).items():
        copy = tmp_path / kind
        shutil.copytree(folder, copy)
        spoiled = (table.set_column(table.schema.get_field_index(column), column, values)
                   if column in table.column_names else table.append_column(column, values))
        pq.write_table(spoiled, copy / name)
        for way, read in readers.items():
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                try:
                    read(copy)
                except StragglersError:
                    pass
                except Exception as exc:  # noqa: BLE001 - what the test looks for
                    failures.append(f"{kind} ({way}): {type(exc).__name__}: {str(exc)[:120]}")
        shutil.rmtree(copy)
    assert not failures, "\n".join(failures)
