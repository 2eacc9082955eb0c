"""The recorder in one process (no process group): rows, sampling, GC pauses, the run format."""

from __future__ import annotations

import gc
import math
import time

import numpy as np
import pytest
import torch

from stragglers.record import Recorder
from stragglers.record.writer import GC_CODE, place_gc_pauses
from stragglers.trace.model import OPTYPE_CODES, JobMeta
from stragglers.trace.runformat import read_run

FWD, BWD, OPT = (OPTYPE_CODES[n] for n in ("forward-compute", "backward-compute", "optimizer"))
AR = OPTYPE_CODES["grads-all-reduce"]


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def cycles(n: int) -> None:
    for _ in range(n):
        a: list = []
        a.append([a])


def test_records_sampled_steps_with_seq_lengths(tmp_path):
    meta = JobMeta(name="t", dp_size=1, pp_size=1)
    before = time.time()
    with Recorder(tmp_path, meta, dp_rank=0, stage=0, sample_every=2, flush_interval_s=0.01) as rec:
        for step in range(6):
            with rec.step(step) as sampled:
                assert sampled == (step % 2 == 0)
                for mb in range(3):
                    with rec.op("forward-compute", mb, seq_lens=[3, 4]):
                        spin(0.001)
                for mb in range(3):
                    with rec.op("backward-compute", mb, seq_lens=[3, 4]):
                        spin(0.002)
                with rec.op("optimizer"):
                    spin(0.0005)
    trace = read_run(tmp_path)
    ops = trace.ops
    assert sorted(set(ops["step"].tolist())) == [0, 2, 4]
    no_gc = ops["optype"] != GC_CODE
    per_step = np.bincount(ops["step"][no_gc])
    assert per_step[[0, 2, 4]].tolist() == [7, 7, 7]
    fwd = ops["optype"] == FWD
    assert ops["mb_id"][fwd].tolist() == [0, 1, 2] * 3
    assert ops["seq_id"][fwd].tolist() == [0, 1, 2] * 3
    assert np.all(ops["attn_cost"][fwd] == 25.0) and np.all(ops["tokens"][fwd] == 7)
    assert np.all(ops["duration"][ops["optype"] == BWD] >= 0.002)
    assert np.all(ops["duration"][fwd] < 1.0)
    # one clock, ops of a step in order, steps in order
    for s in (0, 2, 4):
        m = (ops["step"] == s) & no_gc
        order = np.argsort(ops["start_ts"][m])
        assert ops["optype"][m][order].tolist() == [FWD] * 3 + [BWD] * 3 + [OPT]
    # the CPUs the rank may run on, as the kernel lists them (/proc: another reading of it)
    allowed = next(line.split(":")[1].strip() for line in open("/proc/self/status")
                   if line.startswith("Cpus_allowed_list"))
    assert trace.meta.extra["layout"] == [{"rank": 0, "dp_rank": 0, "stage": 0,
                                           "host": trace.meta.extra["layout"][0]["host"],
                                           "cpus": allowed,
                                           "threads": torch.get_num_threads()}]
    assert trace.meta.extra["recorder"]["sample_every"] == 2
    # when the run began by the wall clock: the monitor refuses a meta.json of a run begun
    # before its current one (a stale uploader's), however many runs replaced it
    assert before <= trace.meta.extra["started"] <= time.time()


@pytest.mark.slow
def test_gc_pause_inside_an_op_moves_before_it(tmp_path):
    meta = JobMeta(name="t", dp_size=1, pp_size=1)
    gc.disable()  # only the explicit collection below pauses
    try:
        wall = run_with_pause_in_backward(tmp_path, meta)
    finally:
        gc.enable()
    ops = read_run(tmp_path).ops
    names = ops["optype"]
    gcs = np.flatnonzero(names == GC_CODE)
    bwd = int(np.flatnonzero(names == BWD)[0])
    assert len(gcs) == 1, "one gc row per slot (between forward 0 and backward 0)"
    g = gcs[0]
    assert ops["duration"][g] >= 50e-6
    # the pause precedes the backward, which keeps only its own time
    assert ops["start_ts"][g] + ops["duration"][g] <= ops["start_ts"][bwd] + 1e-9
    assert ops["duration"][bwd] >= 0.004
    assert ops["duration"][bwd] + ops["duration"][g] <= wall + 1e-6


def run_with_pause_in_backward(tmp_path, meta) -> float:
    """One step whose backward holds a real gc.collect(); returns the backward's wall time."""
    with Recorder(tmp_path, meta, dp_rank=0, stage=0, flush_interval_s=0.01) as rec:
        with rec.step(0):
            with rec.op("forward-compute", 0):
                spin(0.002)
            cycles(20000)
            t0 = time.perf_counter()
            with rec.op("backward-compute", 0):
                spin(0.002)
                gc.collect()  # a real pause inside the op
                spin(0.002)
            wall = time.perf_counter() - t0
            with rec.op("optimizer"):
                spin(0.001)
    return wall


def test_place_gc_pauses_merges_per_slot_and_keeps_tail_pauses_inside():
    # rows: [code, start, end, mb, mc, gmc, attn, tokens, bytes, pauses]
    def row(code, s, e, pauses=()):
        return [code, s, e, -1, 0, 0, math.nan, -1, -1, pauses]

    rows = [row(FWD, 0, 100), row(BWD, 100, 300, pauses=(20, 30)), row(AR, 300, 350),
            row(OPT, 360, 400, pauses=(10,))]
    free = [(5, 15)]  # inside slot 1 (after the forward started)
    gcs = place_gc_pauses(rows, free)
    assert rows[1][1] == 150 and rows[1][2] == 300  # backward shifted past its pauses
    assert rows[3][1] == 360  # the optimizer is after the first tail op: its pause stays inside
    assert [(g[1], g[2] - g[1]) for g in gcs] == [(5, 60)]
    assert gcs[0][2] <= rows[1][1]


@pytest.mark.parametrize("setting,value", [
    ("sample_every", 0), ("sample_every", 2.5), ("flush_every", 0),
    # a negative or NaN interval killed the writer thread (no step reached the disk); 0 spun
    ("flush_interval_s", -1.0), ("flush_interval_s", float("nan")), ("flush_interval_s", 0),
    ("gc_min_s", -1.0), ("clock_rounds", 0), ("monitor_close_timeout_s", float("inf"))])
def test_bad_settings_are_refused(tmp_path, setting, value):
    from stragglers.errors import InputError

    with pytest.raises(InputError) as err:
        Recorder(tmp_path, JobMeta(name="t", dp_size=1, pp_size=1), dp_rank=0, stage=0,
                 **{setting: value})
    assert err.value.field == setting and "\n" not in str(err.value)


def test_world_size_mismatch_is_refused(tmp_path):
    from stragglers.errors import StragglersError

    rec = Recorder(tmp_path, JobMeta(name="t", dp_size=2, pp_size=1), dp_rank=0, stage=0)
    with pytest.raises(StragglersError, match="world_size"):
        rec.start()


def test_a_step_that_raises_is_dropped_and_earlier_steps_kept(tmp_path):
    meta = JobMeta(name="t", dp_size=1, pp_size=1)
    with pytest.raises(RuntimeError, match="peer died"):
        with Recorder(tmp_path, meta, dp_rank=0, stage=0, flush_interval_s=0.01) as rec:
            for step in range(3):
                with rec.step(step):
                    with rec.op("forward-compute", 0):
                        spin(0.001)
                    if step == 2:
                        raise RuntimeError("peer died")
    ops = read_run(tmp_path).ops
    assert sorted(set(ops["step"].tolist())) == [0, 1]


def test_a_directory_holding_another_run_is_refused_unless_overwrite(tmp_path):
    from stragglers.errors import InputError

    meta = JobMeta(name="t", dp_size=1, pp_size=1)

    def record(**kw) -> None:
        with Recorder(tmp_path, meta, dp_rank=0, stage=0, flush_interval_s=0.01, **kw) as rec:
            with rec.step(0):
                with rec.op("forward-compute", 0):
                    spin(0.001)

    record()
    (tmp_path / "notes.txt").write_text("the user's own file")
    with pytest.raises(InputError, match="not empty.*overwrite=True") as err:
        record()
    assert "\n" not in str(err.value) and str(tmp_path) in str(err.value)
    assert len(read_run(tmp_path).ops["step"]) == 1  # the earlier run is untouched
    record(overwrite=True)
    parts = sorted(p.name for p in tmp_path.iterdir())
    assert parts == ["meta.json", "notes.txt", "rank-00000.part-000000.parquet"]


def test_settings_are_one_recorder_config_and_keywords_override_it(tmp_path):
    from stragglers.errors import InputError
    from stragglers.record import RecorderConfig

    meta = JobMeta(name="t", dp_size=1, pp_size=1)
    rec = Recorder(tmp_path, meta, dp_rank=0, stage=0,
                   config=RecorderConfig(sample_every=3, gc_min_s=1e-3), overwrite=True)
    assert (rec.config.sample_every, rec.config.gc_min_s, rec.config.overwrite) == (3, 1e-3, True)
    assert (rec.sample_every, rec.gc_min_ns, rec.overwrite) == (3, 1_000_000, True)
    assert Recorder(tmp_path, meta, dp_rank=0, stage=0).config == RecorderConfig()
    for kwargs, field in (({"sample_evry": 2}, "sample_evry"), ({"config": {"x": 1}}, "config"),
                          ({"monitor": 8150}, "monitor")):
        with pytest.raises(InputError) as err:
            Recorder(tmp_path, meta, dp_rank=0, stage=0, **kwargs)
        assert err.value.field == field and "\n" not in str(err.value)


def test_only_the_recorder_reads_its_private_state():
    # attach and its FSDP2 / model-parallel / pipelining recorders use the hook interface
    # (README: "The hook interface"), never a Recorder's underscored attributes
    import re
    from pathlib import Path

    import stragglers.record as record

    pattern = re.compile(r"\b(?:recorder|rec)\._[a-z]\w*")
    found = {p.name: pattern.findall(p.read_text())
             for p in Path(record.__file__).parent.glob("*.py") if p.name != "recorder.py"}
    assert {k: v for k, v in found.items() if v} == {}
