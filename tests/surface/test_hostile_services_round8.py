"""Red team round eight (issue 34): the analysis CLI on hostile step-time tables (the fourth
format `analyze` reads), NDTimeline and run files, and the services.

Each test is one defect class, marked xfail(strict=True) until its fix lands (then the mark goes):
a pass before the fix fails the suite, so each flips exactly when its defect is gone. Real
servers and real CLI processes in subprocesses (a hang or an abort must not take pytest along).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import REPO
from test_hostile_services_round6 import clean_refusal, cli, small_run

sys.path.insert(0, str(REPO / "tests" / "monitor"))
from monitor_jobs import slow_job  # noqa: E402


def step_rows(workers: list[str], steps: int) -> str:
    """A long step-time table's rows: every worker's time for each step."""
    return "".join(f"{w},{s},{1.0 + 0.1 * k}\n" for s in range(steps)
                   for k, w in enumerate(workers))


def test_analyze_takes_or_refuses_workers_named_with_digit_like_signs(tmp_path):
    """Workers given by name, one of them '²' (a digit to str.isdigit(), no number to int()
    nor float()): analysed (exit 0) or refused in one line naming the file — not 'internal
    error: ValueError' from the natural sort of the names (exit 4)."""
    table = tmp_path / "times.csv"
    table.write_text("worker,step,step_time\n" + step_rows(["²", "node-a"], 4))
    status, err = cli("analyze", str(table), "-q", cwd=tmp_path)
    if status != 0:
        clean_refusal(status, err, "times.csv")


def late_bad_utf8(table: Path) -> None:
    """A byte that is not UTF-8 past the first 64 KiB (the part sniffed when it is recognised)."""
    body = "worker,step,step_time\n" + step_rows(["0", "1", "2", "3"], 3000)
    table.write_bytes(body.encode() + b"0,3000,1.0\xff\n")


def cell_over_csv_field_limit(table: Path) -> None:
    """A quoted cell of 200,000 characters (the csv module's field limit is 131,072)."""
    table.write_text('worker,step,step_time\n0,0,1.0\n1,0,"' + "x" * 200_000 + '"\n')


@pytest.mark.parametrize("spoil", [late_bad_utf8, cell_over_csv_field_limit],
                         ids=["bad-utf8-past-64KiB", "cell-over-field-limit"])
def test_analyze_refuses_a_step_time_table_it_cannot_decode_in_one_line(tmp_path, spoil):
    """A .csv step-time table whose header is fine and whose later text cannot be read
    (UnicodeDecodeError, csv.Error): one line naming the file, exit 2 — not 'internal error'
    (exit 4): only the first 64 KiB are read when the format is recognised."""
    table = tmp_path / "times.csv"
    spoil(table)
    status, err = cli("analyze", str(table), "-q", cwd=tmp_path)
    clean_refusal(status, err, "times.csv")


def run_with_extra(tmp: Path, fmt: str, key: str, value) -> Path:
    """A small job with `extra[key] = value` in its metadata: a run directory (meta.json) or
    an NDTimeline trace (meta-<name>.yaml beside it); the path `analyze` is given."""
    import json

    import yaml

    from stragglers.trace.ndtimeline import write_ndtimeline

    if fmt == "run":
        run = small_run(tmp / "run")
        meta = json.loads((run / "meta.json").read_text())
        meta["extra"][key] = value
        (run / "meta.json").write_text(json.dumps(meta))
        return run
    trace_path, meta_path = write_ndtimeline(slow_job(steps=4, slow=(0, 1, 3.0)),
                                             tmp / "trace-job.parquet")
    raw = yaml.safe_load(meta_path.read_text())
    raw["extra"][key] = value
    meta_path.write_text(yaml.safe_dump(raw))
    return trace_path


@pytest.mark.parametrize("command", ["analyze", "advise"])
@pytest.mark.parametrize("fmt", ["run", "ndtimeline"])
@pytest.mark.parametrize("key", ["notes", "ranks_missing"])
def test_extra_keys_the_engine_reads_are_checked_when_a_file_is_read(tmp_path, command, fmt,
                                                                     key):
    """meta.json's (or the NDTimeline YAML's) `extra.notes: 5` / `extra.ranks_missing: 5`:
    one line naming the field, exit 2 — as the monitor's jobmeta.py already refuses them
    ('notes: 5 once failed every window of its job') — not 'internal error: TypeError'."""
    path = run_with_extra(tmp_path, fmt, key, 5)
    status, err = cli(command, str(path), "-q", cwd=tmp_path)
    clean_refusal(status, err, key)


@pytest.mark.parametrize("key, value", [("calibration", "x"), ("calibration", [1]),
                                        ("global_batch", float("inf"))],
                         ids=["calibration-str", "calibration-list", "global_batch-inf"])
@pytest.mark.parametrize("fmt", ["run", "ndtimeline"])
def test_advise_checks_the_extra_keys_it_reads(tmp_path, fmt, key, value):
    """`advise` on a job whose metadata says `extra.calibration: "x"` (what
    train_advised.py --calibrate writes is a mapping) or `extra.global_batch: .inf`: advised
    without it, or one line naming the field, exit 2 — not 'internal error' (AttributeError,
    OverflowError). (`analyze` reads neither and is not affected.)"""
    path = run_with_extra(tmp_path, fmt, key, value)
    status, err = cli("advise", str(path), "-q", cwd=tmp_path)
    if status != 0:
        clean_refusal(status, err, key)


def with_column(run: Path, name: str, values) -> None:
    """rank-00000.parquet of `run` with its column `name` (added if absent) set to `values`
    (a pyarrow array, one value a row)."""
    import pyarrow.parquet as pq

    path = run / "rank-00000.parquet"
    table = pq.read_table(path)
    values = values(table.num_rows)
    if name in table.column_names:
        table = table.set_column(table.schema.get_field_index(name), name, values)
    else:
        table = table.append_column(name, values)
    pq.write_table(table, path)


@pytest.mark.parametrize("values", [
    lambda n: __import__("pyarrow").array([float("nan")] * n),
    lambda n: __import__("pyarrow").array([float("inf")] * n),
    lambda n: __import__("pyarrow").array([None] * n, __import__("pyarrow").int64()),
    lambda n: __import__("pyarrow").array(["x"] * n),
], ids=["nan", "inf", "nulls", "strings"])
def test_analyze_refuses_a_run_whose_step_column_is_not_whole_numbers_in_one_line(tmp_path,
                                                                                  values):
    """A run directory whose rank-00000.parquet has a `step` column of NaN, infinities, nulls or
    strings: one line naming the file and `step`, exit 2 — as `table_to_columns` says
    'expected a number column' / 'null values' — not 'internal error' (ValueError,
    OverflowError: the step partition reads the column before the checks)."""
    run = small_run(tmp_path / "run")
    with_column(run, "step", values)
    status, err = cli("analyze", str(run), "-q", cwd=tmp_path)
    clean_refusal(status, err, "step")


@pytest.mark.parametrize("fmt", ["run", "ndtimeline"])
@pytest.mark.parametrize("command", ["analyze", "advise"])
def test_an_optional_column_of_integers_with_nulls_is_read_or_refused_in_one_line(
        tmp_path, fmt, command):
    """`cpu_wait` (seconds, NaN where unknown) written as an int64 column with nulls (a
    writer that kept whole seconds, or pandas' nullable Int64): read with the nulls as
    unknown, or one line naming `cpu_wait`, exit 2 — not 'internal error: ArrowInvalid:
    Could not convert nan with type float: tried to convert to int64' (the fill for the
    float column's nulls is NaN, put into the integer column)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def values(n: int) -> pa.Array:
        return pa.array([None] + [0] * (n - 1), pa.int64())

    if fmt == "run":
        path = small_run(tmp_path / "run")
        with_column(path, "cpu_wait", values)
    else:
        from stragglers.trace.ndtimeline import write_ndtimeline

        path, _ = write_ndtimeline(slow_job(steps=4, slow=(0, 1, 3.0)),
                                   tmp_path / "trace-job.parquet")
        table = pq.read_table(path)
        pq.write_table(table.append_column("cpu_wait", values(table.num_rows)), path)
    status, err = cli(command, str(path), "-q", cwd=tmp_path)
    if status != 0:
        clean_refusal(status, err, "cpu_wait")


@pytest.mark.parametrize("values", [
    lambda n: __import__("pyarrow").array([2 ** 63 - 1] * n, __import__("pyarrow").int64()),
    lambda n: __import__("pyarrow").array([-2 ** 63] * n, __import__("pyarrow").int64()),
    lambda n: __import__("pyarrow").array(__import__("numpy").ones(n, "float16")),
], ids=["int64-max", "int64-min", "float16"])
def test_a_step_column_at_int64s_ends_or_of_half_floats_is_one_line_or_read(tmp_path, values):
    """Found by sweeping every column of a run through hostile values (lead, session 46): the
    step partition's span of steps at int64's ends overflowed numpy's scalar arithmetic, and
    float16 columns overflowed comparing with int64's bounds — a RuntimeWarning printed as a
    second line of a refusal, or beside a report."""
    run = small_run(tmp_path / "run")
    with_column(run, "step", values)
    status, err = cli("analyze", str(run), "-q", cwd=tmp_path)
    if status != 0:
        clean_refusal(status, err, "step")
    else:
        assert "Warning" not in err, err


def test_analyze_refuses_a_wide_table_without_a_single_time_in_one_line(tmp_path):
    """A wide table (a step column, one time column per worker) whose every time cell is
    empty: one line naming the file, exit 2 — not 'internal error: ValueError: zero-size
    array to reduction operation fmax'."""
    table = tmp_path / "times.csv"
    table.write_text("step,gpu0,gpu1\n0,,\n1,,\n")
    status, err = cli("analyze", str(table), "-q", cwd=tmp_path)
    clean_refusal(status, err, "times.csv")


def cpu_seconds(pid: int) -> float:
    """User + system CPU a live process has used (/proc/PID/stat), in seconds."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1000, 4096])
def test_advise_on_thousands_of_workers_takes_seconds_of_cpu_not_minutes(tmp_path, workers):
    """A step-time table of 1,000 (21 KB) or 4,096 workers (88 KB) and 2 steps. `advise` prices
    StragglAR with the phase-2 schedule for n = the DP size: for 1,000 the greedy synthesis is
    ~n⁴ (5.7 s of CPU at 400 workers, minutes at 1,000); for 4,096 (a power of two) the
    schedule's n²/2 = 8.4 M transfers are built as objects (>30 s of CPU, 2.2 GB). 1,024
    workers take 3.5 s of CPU for the whole advise; `analyze` of 4,096 takes 0.9 s. Judged on
    the CPU the command uses, not the wall clock: it must end within 15 s of CPU (killed
    there), in a 3 GiB address space."""
    import os
    import resource
    import subprocess
    import time

    from conftest import REPO

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    table = tmp_path / "times.csv"
    table.write_text("worker,step,step_time\n" + "".join(
        f"{w},{s},{3.0 if w == 0 else 1.0}\n" for s in range(2) for w in range(workers)))
    proc = subprocess.Popen([sys.executable, "-m", "stragglers.cli", "advise", str(table), "-q"],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, preexec_fn=limit,
                            env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    used, deadline = 0.0, time.monotonic() + 600   # (the wall bound only stops a blocked run)
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                used = cpu_seconds(proc.pid)
            except (OSError, IndexError, ValueError):   # it ended between poll and read
                break
            if used > 15:
                break
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
        err = proc.communicate()[1].decode(errors="replace")
    assert proc.returncode == 0, f"stopped after {used:.1f} s of CPU ({proc.returncode}): " \
                                 f"{err[-500:]}"


BIG = "9" * 400     # an integer no float holds: math.isfinite() raises OverflowError on it


@pytest.mark.parametrize("args, field", [
    (lambda run, tmp: ["analyze", str(run), "-q", "--set", f"seed={BIG}"], "seed"),
    (lambda run, tmp: ["advise", str(run), "-q", "--s", BIG], "s"),
    (lambda run, tmp: ["monitor", "serve", "--db", str(tmp / "m.db"), "--port", "0",
                       "--config", str(tmp / "monitor.yaml")], "window_steps"),
    (lambda run, tmp: ["adapt", "serve", "--db", str(tmp / "s.db"), "--port", "0",
                       "--set", f"max_datasets={BIG}"], "max_datasets"),
], ids=["analyze-set", "advise-option", "monitor-config-file", "adapt-serve-set"])
def test_a_setting_too_large_for_a_float_is_refused_in_one_line(tmp_path, args, field):
    """An integer setting given 400 digits — on the command line or in the monitor's config
    file: one line naming the setting, exit 2 (as '1e400' and 10**6 already are) — not
    'internal error: OverflowError' (exit 4), and no service started on it. The check is
    shared by every Config (DiagnosisConfig, AdviceConfig, MonitorConfig, ServiceConfig)."""
    run = small_run(tmp_path / "run")
    (tmp_path / "monitor.yaml").write_text(f"settings: {{window_steps: {BIG}}}\n")
    status, err = cli(*args(run, tmp_path), cwd=tmp_path)
    if err.startswith("Usage:"):   # a command-line option's bad value: click's usage error,
        # as every option's (the usage, a hint, then the one line naming it), exit 2
        assert status == 2 and f"'--{field}'" in err.splitlines()[-1], err
        assert "internal error" not in err, err
        return
    clean_refusal(status, err, field)


def run_with_sizes(tmp: Path, **sizes: int) -> Path:
    """small_run's four rank files under a meta.json declaring other sizes, no layout."""
    import json

    run = small_run(tmp / "run")
    meta = json.loads((run / "meta.json").read_text())
    meta.update(sizes)
    meta["extra"].pop("layout", None)
    (run / "meta.json").write_text(json.dumps(meta))
    return run


@pytest.mark.slow
def test_analyze_of_a_run_declaring_a_billion_ranks_is_bounded_in_memory(tmp_path):
    """A run of four rank files whose meta.json says dp_size 2^29, world_size 2^30 (a few
    bytes changed): refused in one line naming meta.json (the monitor refuses a world past
    max_world_size, 65,536, for this reason), or analysed in bounded memory — not held
    per declared rank (6.4 GB after a minute and growing here). The command runs with its
    address space limited to 3 GiB (a four-rank analysis needs ~150 MB): before the fix it
    ends 'internal error: MemoryError'."""
    import os
    import resource
    import subprocess

    from conftest import REPO

    run = run_with_sizes(tmp_path, dp_size=2**29, world_size=2**30)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    try:
        done = subprocess.run([sys.executable, "-m", "stragglers.cli", "analyze", str(run), "-q"],
                              cwd=tmp_path, capture_output=True, timeout=300,
                              stdin=subprocess.DEVNULL, preexec_fn=limit,
                              env={**os.environ, "PYTHONPATH": str(REPO / "src")})
        status, err = done.returncode, done.stderr.decode(errors="replace")
    except subprocess.TimeoutExpired:
        status, err = None, "no end in 300 s"
    if status != 0:
        clean_refusal(status, err, "meta.json")


def test_a_refusal_naming_missing_stages_is_one_line_of_bounded_length(tmp_path):
    """meta.json says pp_size 100,000 (world 200,000) over a run of 2 stages: refused, exit 2,
    in one line — that names a few of the missing stages and how many, not all 99,998 of
    them (a 689 KB line, every number written out; a terminal or CI log takes it whole)."""
    run = run_with_sizes(tmp_path, pp_size=100_000, world_size=200_000)
    status, err = cli("analyze", str(run), "-q", cwd=tmp_path)
    clean_refusal(status, err, "meta.json")
    assert len(err) < 2_000, f"a refusal of {len(err):,} characters: {err[:200]}..."


@pytest.mark.slow
@pytest.mark.parametrize("command, flag, name", [
    ("analyze", "--json", "result.json"),
    ("analyze", "--html", "report.html"),
    ("advise", "--json", "plan.json"),
], ids=["analyze-json", "analyze-html", "advise-json"])
def test_a_report_written_to_a_full_disk_is_one_line_naming_it(tmp_path, small_disk, command,
                                                               flag, name):
    """`analyze --json/--html` or `advise --json` into a folder on a real full file system
    (a 4 MiB tmpfs, filled): one line naming the file and that the disk is full (exit 2, or
    3 for an environment failure), as a folder that does not exist already is — not
    'internal error: OSError: [Errno 28]' (the error of write() carries no file name, so
    the CLI takes it for a bug)."""
    from conftest import fill

    run = small_run(tmp_path / "run")
    fill(small_disk)
    status, err = cli(command, str(run), "-q", flag, str(small_disk / name), cwd=tmp_path)
    lines = [line for line in err.splitlines() if line.strip()]
    assert status in (2, 3) and len(lines) == 1, (status, err[-800:])
    assert name in lines[0] and "internal error" not in lines[0], err[-800:]


@pytest.mark.slow
def test_a_step_time_table_is_read_in_memory_proportionate_to_its_size(tmp_path):
    """A 16 MB step-time table (two workers' 1,000 steps written over and over: repeats are
    read once, so the analysis itself is small). Its reading may hold a few times its size,
    not the whole text as lists of Python strings (50 MB took 1.8 GB and 43 s of CPU here;
    the reader's bound is 1 GiB, ~38 GB). Measured above the same command on the table's
    first 2,000 rows, in the same process tree; at most 16x the file's size above it."""
    from test_hostile_services_round7 import peak_rss

    rows = "".join(f"{w},{s},{1.0 + w}\n" for s in range(1000) for w in range(2))
    small = tmp_path / "small.csv"
    small.write_text("worker,step,step_time\n" + rows)
    big = tmp_path / "big.csv"
    big.write_text("worker,step,step_time\n" + rows * (16_000_000 // len(rows)))
    status, err, base = peak_rss("analyze", str(small), "-q", cwd=tmp_path)
    assert status == 0, err[-500:]
    status, err, rss = peak_rss("analyze", str(big), "-q", cwd=tmp_path)
    assert status in (0, 2), err[-500:]
    size = big.stat().st_size
    assert rss - base < 16 * size, \
        f"{(rss - base) / 2**20:.0f} MiB above a 2,000-row table's run for a {size:,}-byte table"
