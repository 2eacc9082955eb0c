"""The what-if on Dask (issue 32, item 3): a run directory read and replayed by step partitions on
a real LocalCluster gives the single-process result: S, per-step S, sim_error, attribution by op
type / stage / DP rank to 1e-9, and the same diagnosis."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("distributed")

from stragglers.errors import InputError  # noqa: E402
from stragglers.trace.ndtimeline import read_ndtimeline  # noqa: E402
from stragglers.trace.runformat import read_run, write_run  # noqa: E402
from stragglers.trace.synth import generate  # noqa: E402
from stragglers.whatif import analyze  # noqa: E402
from stragglers.whatif.dask_runner import analyze_with_client, dask_client  # noqa: E402
from same_results import PARTITION_JOBS, assert_same  # noqa: E402

JOBS = {
    "slow worker + gc": dict(dp=4, pp=2, microbatches=4, steps=6, slow_worker=(1, 1, 1.5),
                             gc=(1, 0.01), seed=3),
    **PARTITION_JOBS,
}


@pytest.fixture(scope="module")
def client():
    """A real LocalCluster of two in-process workers (the machine has two shared cores)."""
    with dask_client(workers=2, processes=False) as c:
        yield c


@pytest.mark.parametrize("name", list(JOBS))
def test_synthetic_jobs_match_the_single_process_path(client, tmp_path, name):
    run = write_run(tmp_path / "run", generate(**JOBS[name]))
    single = analyze(read_run(run))
    dask, _ = analyze_with_client(client, run)
    assert_same(single, dask)
    assert single.by_optype and single.diagnosis   # the attribution and findings were compared


@pytest.mark.slow
def test_more_partitions_than_workers_and_step_selections(client, tmp_path):
    run = write_run(tmp_path / "run", generate(dp=2, pp=2, microbatches=4, steps=7,
                                               slow_worker=(0, 1, 1.6), seed=11))
    trace = read_run(run)
    for steps in (None, "all", [1, 2, 4, 6]):
        single = analyze(trace, steps=steps)
        dask, _ = analyze_with_client(client, run, steps=steps, partitions=5)
        assert_same(single, dask)


def test_progress_names_the_partitions(client, tmp_path):
    run = write_run(tmp_path / "run", generate(dp=2, pp=2, microbatches=2, steps=4, seed=1))
    told: list[str] = []
    analyze_with_client(client, run, progress=told.append)
    assert told[0].startswith("reading 4 rank files in 2 step partitions on 2 Dask worker(s)")
    assert "2/2 step partitions read" in told and "diagnosis" in told


def test_each_worker_decodes_only_its_steps_row_groups(client, tmp_path):
    import re

    trace = generate(dp=2, pp=2, microbatches=16, steps=12, slow_worker=(1, 1, 1.5), seed=3)
    run = write_run(tmp_path / "run", trace)      # a row group per 6 steps in every file
    told: list[str] = []
    dask, _ = analyze_with_client(client, run, progress=told.append)
    assert_same(analyze(read_run(run)), dask)
    by_worker = [re.fullmatch(r"read by worker \S+: 1 partitions, ([\d,]+) rows, ([\d,]+) "
                              r"bytes decoded", m) for m in told if m.startswith("read by")]
    rows = [int(m.group(1).replace(",", "")) for m in by_worker if m]
    assert len(rows) == 2 and sorted(rows) == sorted(
        [int((trace.ops["step"] < 6).sum()), int((trace.ops["step"] >= 6).sum())])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ST", "AR", "SE"])
def test_ndtimeline_samples_match(client, tmp_path, ndtimeline_dir, name):
    run = write_run(tmp_path / name, read_ndtimeline(ndtimeline_dir / f"trace-{name}.parquet"))
    assert_same(analyze(read_run(run)), analyze_with_client(client, run)[0])


def test_bad_input_found_on_a_worker_is_a_one_line_error(client, tmp_path):
    run = write_run(tmp_path / "run", generate(dp=2, pp=2, microbatches=2, steps=4, seed=1))
    (run / "rank-00001.parquet").write_bytes(b"PAR1 not parquet")
    with pytest.raises(InputError, match=r"rank-00001.parquet.*not a readable Parquet file"):
        analyze_with_client(client, run)


@pytest.mark.slow
def test_bad_address_and_worker_count_are_one_line_errors():
    with pytest.raises(InputError, match=r"^--dask: cannot reach a Dask scheduler at "
                       r"'tcp://127.0.0.1:9'"):
        with dask_client(address="tcp://127.0.0.1:9", timeout=1):
            pass
    with pytest.raises(InputError, match=r"^--workers: 0: expected a number of local Dask "
                       r"workers ≥ 1"):
        with dask_client(workers=0):
            pass


@pytest.mark.slow
def test_cli_workers_gives_the_single_process_json(tmp_path):
    run = write_run(tmp_path / "run", generate(dp=2, pp=2, microbatches=4, steps=5,
                                               slow_worker=(1, 0, 1.5), seed=2))
    outs = {}
    for label, extra in (("single", []), ("dask", ["--workers", "1"])):
        outs[label] = tmp_path / f"{label}.json"
        proc = subprocess.run([sys.executable, "-m", "stragglers.cli", "analyze", str(run),
                               "--json", str(outs[label]), "-q", *extra],
                              capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr
    assert json.loads(outs["single"].read_text()) == json.loads(outs["dask"].read_text())
    bad = subprocess.run([sys.executable, "-m", "stragglers.cli", "analyze", str(run),
                          "--workers", "0", "-q"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "--workers: 0: expected a number of local Dask workers ≥ 1" in bad.stderr
