"""Readers, writers and convert: lossless round trips and one-line errors for bad input."""

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stragglers.errors import InputError, StragglersError
from stragglers.trace.convert import convert
from stragglers.trace.load import load_trace, parse_steps
from stragglers.trace.ndtimeline import read_ndtimeline
from stragglers.trace.runformat import read_run


def cli(*args):
    return subprocess.run([sys.executable, "-m", "stragglers.cli", *map(str, args)],
                          capture_output=True, text=True)


def same(a, b):
    assert len(a) == len(b)
    ka = np.lexsort((a.ops["seq_id"], a.ops["optype"], a.ops["step"], a.ops["rank"]))
    kb = np.lexsort((b.ops["seq_id"], b.ops["optype"], b.ops["step"], b.ops["rank"]))
    for col in a.ops:
        np.testing.assert_array_equal(a.ops[col][ka], b.ops[col][kb], err_msg=col)
    assert a.meta == b.meta


def test_round_trip_ndtimeline_run_ndtimeline(ndtimeline_dir, tmp_path):
    original = read_ndtimeline(ndtimeline_dir / "trace-ST.parquet")
    convert(ndtimeline_dir / "trace-ST.parquet", tmp_path / "run")
    run = read_run(tmp_path / "run")
    same(original, run)
    convert(tmp_path / "run", tmp_path / "back" / "trace-ST.parquet")
    back = read_ndtimeline(tmp_path / "back" / "trace-ST.parquet")
    same(original, back)
    assert (tmp_path / "back" / "meta-ST.yaml").exists()


@pytest.mark.slow
def test_convert_cli(ndtimeline_dir, tmp_path):
    proc = cli("convert", ndtimeline_dir / "trace-AR.parquet", tmp_path / "ar")
    assert proc.returncode == 0, proc.stderr
    assert len(list((tmp_path / "ar").glob("rank-*.parquet"))) == 16


def write_trace(tmp_path, table, meta="trial_name: X\ndp_size: 1\npp_size: 1\nworld_size: 1\n"):
    path = tmp_path / "trace-X.parquet"
    pq.write_table(table, path)
    (tmp_path / "meta-X.yaml").write_text(meta)
    return path


def good_table(n=4):
    return pa.table({"dp_rank": [0] * n, "stage": [0] * n, "rank": [0] * n, "step": [1] * n,
                     "optype": ["forward-compute"] * n, "start_ts": [0.1 * i for i in range(n)],
                     "duration": [0.05] * n, "seq_id": list(range(n)), "mc": [0] * n,
                     "gmc": [0] * n, "mb_id": list(range(n))})


@pytest.mark.slow
@pytest.mark.parametrize("mutate,field", [
    (lambda t: t.drop_columns(["duration"]), "duration"),
    (lambda t: t.set_column(6, "duration", pa.array(["a", "b", "c", "d"])), "duration"),
    (lambda t: t.set_column(6, "duration", pa.array([0.1, float("nan"), 0.1, 0.1])), "duration"),
    (lambda t: t.set_column(6, "duration", pa.array([0.1, -0.5, 0.1, 0.1])), "duration"),
    (lambda t: t.set_column(4, "optype", pa.array(["forward-compute", "teleport", "x", "y"])), "optype"),
])
def test_bad_columns_name_file_and_field(tmp_path, mutate, field):
    path = write_trace(tmp_path, mutate(good_table()))
    with pytest.raises(InputError) as err:
        read_ndtimeline(path)
    assert str(path) in str(err.value) and f"'{field}'" in str(err.value)
    proc = cli("analyze", path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and field in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_empty_truncated_and_meta_errors(tmp_path):
    empty = write_trace(tmp_path, good_table(0))
    assert "no ops" in str(pytest.raises(InputError, read_ndtimeline, empty).value)
    data = empty.read_bytes()
    path = write_trace(tmp_path, good_table())
    path.write_bytes(path.read_bytes()[:-30])
    assert "Parquet" in str(pytest.raises(InputError, read_ndtimeline, path).value)
    path = write_trace(tmp_path, good_table(), meta="trial_name: X\n")
    assert "dp_size" in str(pytest.raises(InputError, read_ndtimeline, path).value)
    path = write_trace(tmp_path, good_table(), meta="dp_size: 2\npp_size: 1\nworld_size: 3\n")
    assert "world_size" in str(pytest.raises(InputError, read_ndtimeline, path).value)
    path = write_trace(tmp_path, good_table(), meta="dp_size: [oops\n")
    assert "YAML" in str(pytest.raises(InputError, read_ndtimeline, path).value)
    assert data  # the empty file was a valid Parquet file


def test_run_dir_errors(tmp_path):
    (tmp_path / "run").mkdir()
    assert "meta.json" in str(pytest.raises(InputError, read_run, tmp_path / "run").value)
    (tmp_path / "run" / "meta.json").write_text(json.dumps({"dp_size": 1, "pp_size": 1}))
    assert "rank-" in str(pytest.raises(InputError, read_run, tmp_path / "run").value)
    with pytest.raises(InputError):
        load_trace(tmp_path / "nothing-here")


@pytest.mark.slow
def test_cycle_is_reported_with_op_names(ndtimeline_dir, tmp_path):
    t = pq.read_table(ndtimeline_dir / "trace-ST.parquet")
    cols = {c: t.column(c).to_pylist() for c in t.column_names}
    # Make the optimizer run before the first forward of stage 0: the step tail then feeds its head.
    for i, (op, st_, seq) in enumerate(zip(cols["optype"], cols["stage"], cols["seq_id"])):
        if op == "forward-compute" and st_ == 0 and seq == 0:
            cols["start_ts"][i] += 100.0
    path = tmp_path / "trace-ST.parquet"
    pq.write_table(pa.table(cols), path)
    (tmp_path / "meta-ST.yaml").write_text((ndtimeline_dir / "meta-ST.yaml").read_text())
    proc = cli("analyze", path)
    assert proc.returncode == 2, proc.stdout
    assert "cyclic" in proc.stderr and "forward-compute" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(
    st.sampled_from(["dp_rank", "stage", "rank", "step", "optype", "start_ts", "duration",
                     "seq_id", "mc", "gmc", "mb_id"]),
    st.lists(st.one_of(st.integers(-3, 3), st.floats(allow_nan=True, allow_infinity=True),
                       st.sampled_from(["forward-compute", "gc", "optimizer", "bogus", ""])),
             min_size=1, max_size=6),
    min_size=1))
def test_reader_fuzz_never_crashes(tmp_path, columns):
    n = min(len(v) for v in columns.values())
    cols = {}
    for name, values in columns.items():
        values = values[:n]
        try:
            cols[name] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            cols[name] = pa.array([str(v) for v in values])
    path = write_trace(tmp_path, pa.table(cols),
                       meta="trial_name: X\ndp_size: 4\npp_size: 4\nworld_size: 16\n")
    try:
        trace = read_ndtimeline(path)
        from stragglers.whatif import analyze
        analyze(trace)
    except StragglersError:
        pass


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(min_size=0, max_size=300))
def test_garbage_bytes_are_a_clear_error(tmp_path, blob):
    path = tmp_path / "trace-X.parquet"
    path.write_bytes(blob)
    (tmp_path / "meta-X.yaml").write_text("dp_size: 1\npp_size: 1\n")
    with pytest.raises(InputError):
        read_ndtimeline(path)


def test_bad_file_in_run_directory_is_named(ndtimeline_dir, tmp_path):
    convert(ndtimeline_dir / "trace-ST.parquet", tmp_path / "run")
    victim = sorted((tmp_path / "run").glob("rank-*.parquet"))[3]
    table = pq.read_table(victim)
    durations = table.column("duration").to_pylist()
    durations[5] = float("nan")
    pq.write_table(table.set_column(table.column_names.index("duration"), "duration",
                                    pa.array(durations)), victim)
    with pytest.raises(InputError) as err:
        read_run(tmp_path / "run")
    assert victim.name in str(err.value) and "'duration'" in str(err.value)
    victim.write_bytes(b"PAR1 not really")
    with pytest.raises(InputError) as err:
        read_run(tmp_path / "run")
    assert victim.name in str(err.value)


def one_line_error(proc, *words):
    """The CLI failed with exit 2 and one line on stderr naming every word."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


def st_two_stages(ndtimeline_dir, tmp_path, meta_text):
    """The ST sample cut to its first two stages, with the given metadata beside it."""
    t = pq.read_table(ndtimeline_dir / "trace-ST.parquet")
    mask = pa.compute.less(t.column("stage"), 2)
    path = tmp_path / "trace-ST2.parquet"
    pq.write_table(t.filter(mask), path)
    (tmp_path / "meta-ST2.yaml").write_bytes(meta_text if isinstance(meta_text, bytes)
                                            else meta_text.encode())
    return path


@pytest.mark.slow
def test_metadata_that_disagrees_with_the_trace_is_refused(ndtimeline_dir, tmp_path):
    # pp_size 4 in the YAML but only stages 0-1 in the table: the pipeline would be wrong.
    path = st_two_stages(ndtimeline_dir, tmp_path,
                         "trial_name: ST2\ndp_size: 2\npp_size: 4\nworld_size: 8\n")
    with pytest.raises(InputError) as err:
        read_ndtimeline(path)
    assert err.value.field == "pp_size" and err.value.source.endswith("meta-ST2.yaml")
    assert "2 stage(s)" in str(err.value) and "stage(s) 2-3" in str(err.value)
    one_line_error(cli("analyze", path), "meta-ST2.yaml", "pp_size")
    # With pp_size 2 the same table reads and analyses.
    (tmp_path / "meta-ST2.yaml").write_text("trial_name: ST2\ndp_size: 2\npp_size: 2\n")
    assert read_ndtimeline(path).meta.pp_size == 2


@pytest.mark.slow
def test_metadata_that_disagrees_in_a_run_directory_is_refused(ndtimeline_dir, tmp_path):
    convert(ndtimeline_dir / "trace-ST.parquet", tmp_path / "run")
    for victim in sorted((tmp_path / "run").glob("rank-*.parquet")):
        if pq.read_table(victim).column("stage")[0].as_py() >= 2:
            victim.unlink()  # stages 2 and 3 gone, meta.json still says pp_size 4
    one_line_error(cli("analyze", tmp_path / "run"), "meta.json", "pp_size")


@pytest.mark.slow
@pytest.mark.parametrize("meta, words", [
    ("trial_name: X\ndp_size: null\npp_size: 1\n", ["meta-X.yaml", "'dp_size'", "null"]),
    ("trial_name: X\ndp_size: 1\npp_size: ~\n", ["meta-X.yaml", "'pp_size'", "null"]),
    ("trial_name: X\ndp_size: 1\npp_size: 1\ntp_size: two\n", ["meta-X.yaml", "'tp_size'"]),
    ("trial_name: X\ndp_size: 1\npp_size: 1\nextra: [1, 2]\n", ["meta-X.yaml", "'extra'"]),
    (b"trial_name: \xff\xfeX\ndp_size: 1\npp_size: 1\n", ["meta-X.yaml", "UTF-8", "0xff"]),
])
def test_bad_metadata_is_one_line(tmp_path, meta, words):
    path = tmp_path / "trace-X.parquet"
    pq.write_table(good_table(), path)
    (tmp_path / "meta-X.yaml").write_bytes(meta if isinstance(meta, bytes) else meta.encode())
    with pytest.raises(InputError):
        read_ndtimeline(path)
    one_line_error(cli("analyze", path), *words)


def test_null_optional_sizes_take_their_defaults(tmp_path):
    path = write_trace(tmp_path, good_table(),
                       meta="trial_name: X\ndp_size: 1\npp_size: 1\ntp_size: null\nworld_size: null\n")
    meta = read_ndtimeline(path).meta
    assert (meta.tp_size, meta.world_size) == (1, 1)


@pytest.mark.slow
def test_all_zero_durations_are_an_error_not_nan(ndtimeline_dir, tmp_path):
    t = pq.read_table(ndtimeline_dir / "trace-ST.parquet")
    zeros = pa.array(np.zeros(t.num_rows, dtype=np.float32))
    path = tmp_path / "trace-Z.parquet"
    pq.write_table(t.set_column(t.column_names.index("duration"), "duration", zeros), path)
    (tmp_path / "meta-Z.yaml").write_text((ndtimeline_dir / "meta-ST.yaml").read_text())
    out = tmp_path / "z.json"
    one_line_error(cli("analyze", path, "--json", out), "trace-Z.parquet", "'duration'", "zero")
    assert not out.exists()  # no half-written, NaN-bearing JSON


@pytest.mark.slow
@pytest.mark.parametrize("start, duration, field, words", [
    (1.8e12, 0.05, "start_ts", ["beyond", "milliseconds"]),   # epoch ms read as seconds
    (1e300, 0.05, "start_ts", ["beyond"]),                    # was "every op has zero duration"
    (1.7e9, 3e11, "duration", ["beyond"]),                    # a duration no clock measures
    (9e10, 1e-6, "start_ts", ["float64 steps by", "median duration"]),  # µs ops unresolvable
])
def test_timestamps_beyond_any_clock_are_one_line_errors(tmp_path, start, duration, field, words):
    t = good_table()
    t = t.set_column(t.column_names.index("start_ts"), "start_ts",
                     pa.array([start + 1e-3 * i for i in range(t.num_rows)]))
    t = t.set_column(t.column_names.index("duration"), "duration", pa.array([duration] * 4))
    path = write_trace(tmp_path, t)
    with pytest.raises(InputError) as err:
        read_ndtimeline(path)
    assert err.value.field == field
    one_line_error(cli("analyze", path), "trace-X.parquet", f"'{field}'", *words)


def test_epoch_seconds_with_microsecond_ops_are_accepted(tmp_path):
    t = good_table()
    t = t.set_column(t.column_names.index("start_ts"), "start_ts",
                     pa.array([1.8e9 + 1e-5 * i for i in range(t.num_rows)]))
    t = t.set_column(t.column_names.index("duration"), "duration", pa.array([2e-6] * 4))
    trace = read_ndtimeline(write_trace(tmp_path, t))
    assert np.all(np.diff(trace.ops["start_ts"]) > 0)


@pytest.mark.slow
@pytest.mark.parametrize("meta, field", [
    (b'{"dp_size": null, "pp_size": 4}', "'dp_size'"),
    (b'{"dp_size": 2, "pp_size": 4, "name": "\xff"}', "JSON"),
    (b'{"dp_size": 2, "pp_size": 4, "notes": [{"kind": "gossip", "message": "x"}]}', "'notes'"),
])
def test_bad_meta_json_is_one_line(ndtimeline_dir, tmp_path, meta, field):
    convert(ndtimeline_dir / "trace-ST.parquet", tmp_path / "run")
    (tmp_path / "run" / "meta.json").write_bytes(meta)
    one_line_error(cli("analyze", tmp_path / "run"), "meta.json", field)


@pytest.mark.parametrize("spec,expected", [("12,20-23", [12, 20, 21, 22, 23]), ("3, 1,,2", [1, 2, 3]),
                                           ("5-5,4", [4, 5]),
                                           # overlapping spans count each step once
                                           ("0-600000,1-600000", list(range(600001))),
                                           ("7,7,7,3-8,8", [3, 4, 5, 6, 7, 8])])
def test_step_selections(spec, expected):
    assert parse_steps(spec) == expected


def test_a_selection_of_many_parts_counts_each_step_once():
    # ~230 kB, a command line's worth; 60,000 parts naming 1,000 steps are 1,000 steps (the
    # former count summed every part again per part: quadratic, minutes here; BENCHMARKS.md)
    spec = ",".join(str(i % 1000) for i in range(60_000))
    assert parse_steps(spec) == list(range(1000))


@pytest.mark.parametrize("spec,words", [
    ("5-2", "cannot read '5-2'"), ("-1", "cannot read"), ("a", "cannot read"), (",", "no steps"),
    # a huge range is refused before it is expanded (it got the analysis killed for memory)
    ("0-99999999999999999999", "more than 1,000,000 steps"),
    # a step past the op table's 64-bit step column ('internal error: OverflowError')
    ("9" * 29, "expected step numbers in 0..9223372036854775807"),
    ("0-600000,700000-1300000", "selects 1,200,002 steps, more than 1,000,000")])
def test_bad_step_selections_are_one_line(spec, words):
    with pytest.raises(InputError, match=words) as err:
        parse_steps(spec)
    assert err.value.source == "--steps" and "\n" not in str(err.value)


def test_options_of_another_format_are_refused_not_ignored(ndtimeline_dir, tmp_path):
    from conftest import KINETO

    nd = ndtimeline_dir / "trace-ST.parquet"
    run = tmp_path / "run"
    convert(nd, run)
    cases = [((run,), {"dp_size": 3}, "--dp-size", "run directory"),
             ((run,), {"pp_size": 2}, "--pp-size", "run directory"),
             ((nd,), {"pp_size": 2}, "--pp-size", "NDTimeline"),
             ((KINETO / "trace_filter_sampled_rank-0.json.gz", nd.with_name("meta-ST.yaml")), {},
              str(nd.with_name("meta-ST.yaml")), "--meta is for NDTimeline")]
    for args, kwargs, source, words in cases:
        with pytest.raises(InputError, match=words) as err:
            load_trace(*args, **kwargs)
        assert err.value.source == source and "\n" not in str(err.value)


def _meta_with(layout, timer="perf_counter_ns"):
    from stragglers.trace.model import JobMeta

    meta = JobMeta(name="t", dp_size=len(layout), pp_size=1, world_size=len(layout))
    meta.extra.update(layout=layout, recorder={"timer": timer})
    return meta


@pytest.mark.parametrize("cpus,timer,expected", [
    # four ranks on one host allowed the same two CPUs: they take turns on them
    (["0-1"] * 4, "perf_counter_ns", ["host h: 4 ranks share 2 CPUs"]),
    # pinned one CPU each, to distinct CPUs: each has its own
    (["0", "1", "2", "3"], "perf_counter_ns", []),
    # pinned one CPU each, two to the same one: three CPUs for four ranks
    (["0", "1", "2", "2"], "perf_counter_ns", ["host h: 4 ranks share 3 CPUs"]),
    (["0-1,4-7"] * 4, "perf_counter_ns", []),
    # timed on GPUs: the host's CPUs do not run the compute
    (["0-1"] * 4, "cuda-events", []),
    # not a kernel CPU list (or none: a recorder before the field): nothing said, no error
    (["0-1", "0-1", "0-1", "x"], "perf_counter_ns", []),
    (["0-1", "0-1", "0-1", "1-0"], "perf_counter_ns", []),
    (["0-1", "0-1", "0-1", "\u0661"], "perf_counter_ns", []),
    (["0-1", "0-1", "0-1", 2], "perf_counter_ns", []),
    ([None] * 4, "perf_counter_ns", []),
    (["0-99999999"] * 4, "perf_counter_ns", []),
])
def test_a_host_whose_ranks_outnumber_their_cpus_is_noted(cpus, timer, expected):
    from stragglers.trace.runformat import crowded_hosts

    layout = [{"rank": r, "dp_rank": r, "stage": 0, "host": "h", "cpus": c}
              for r, c in enumerate(cpus)]
    notes = crowded_hosts(_meta_with(layout, timer))
    assert [n.message.split(":")[0] + ":" + n.message.split(":")[1] for n in notes] == expected
    assert all(n.kind == "layout" for n in notes)


def test_the_crowded_host_note_is_said_once_after_a_conversion(tmp_path):
    from stragglers.trace.runformat import write_run
    from stragglers.trace.synth import generate

    trace = generate(dp=4, pp=1, steps=3, seed=0)
    trace.meta.extra.update(recorder={"timer": "perf_counter_ns"}, layout=[
        {"rank": r, "dp_rank": r, "stage": 0, "host": "h", "cpus": "0-1"} for r in range(4)])
    write_run(tmp_path / "a", trace)
    first = read_run(tmp_path / "a")
    assert [n.message[:28] for n in first.notes] == ["host h: 4 ranks share 2 CPUs"]
    convert(tmp_path / "a", tmp_path / "b")
    assert read_run(tmp_path / "b").notes == first.notes
