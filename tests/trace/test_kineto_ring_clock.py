"""Clocks of ranks linked to the reference only through ring attention's exchanges (CP ≥ 3).

A ring round ends on each rank with its own neighbours' transfers, so with a slow rank in the
ring a rank two hops away ends earlier every round: the ends' consensus took that for the
clock offset (−0.32 ms where the hosts differ by ≤ 39 µs) and the rank beside it had its
exchanges read ×9.8 and named `communication`. Causality pins the offset: an exchange ends a
transfer time after the latest post among the rank and its two neighbours, so a rank that
waited past its own side's posts waited for the other side's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from stragglers.trace.kineto.align import clock_offsets
from stragglers.trace.kineto.ops import RING_SYNC
from stragglers.trace.load import load_trace
from stragglers.trace.synth.kineto import GpuJob, write_gpu_job


def _true_offsets_us(job: GpuJob) -> np.ndarray:
    """The generator's host clock offsets (its first draw), relative to rank 0."""
    true = np.random.default_rng(job.seed).uniform(-job.clock_offset_us, job.clock_offset_us,
                                                   job.ranks)
    return true - true[0]


# Each rank its own host; EP pairs {0,1} {2,3} are the only collectives beside the ring, so
# the two halves meet through ring exchanges alone (or nothing but the ring links any two).
JOBS = {
    "seed12-job15": GpuJob(ranks=4, steps=6, seed=1200015, all_to_alls=1, buckets=3,
                           jitter=0.0201, clock_offset_us=39.2, host_jitter_us=29.5,
                           expert_groups=2, cp_size=4, cp_comm="ring", slow_rank=(0, 1.732)),
    "slow-rank-1": GpuJob(ranks=4, steps=6, seed=77, all_to_alls=1, jitter=0.02,
                          clock_offset_us=400.0, host_jitter_us=100.0, expert_groups=2,
                          cp_size=4, cp_comm="ring", slow_rank=(1, 2.0)),
    "slow-rank-3": GpuJob(ranks=4, steps=5, seed=78, all_to_alls=2, jitter=0.02,
                          clock_offset_us=250.0, host_jitter_us=0.0, expert_groups=2,
                          cp_size=4, cp_comm="ring", slow_rank=(3, 1.5)),
    "late-host-2": GpuJob(ranks=4, steps=6, seed=79, all_to_alls=1, jitter=0.02,
                          clock_offset_us=500.0, host_jitter_us=50.0, expert_groups=2,
                          cp_size=4, cp_comm="ring", late_rank=(2, 2500.0)),
    # no collective but the ring: every rank meets the others only there
    "ring-only-slow-0": GpuJob(ranks=4, steps=6, seed=6, all_to_alls=0, cp_size=4,
                               cp_comm="ring", clock_offset_us=300.0, host_jitter_us=100.0,
                               slow_rank=(0, 1.7)),
    "ring-only-slow-3": GpuJob(ranks=4, steps=6, seed=5, all_to_alls=0, cp_size=4,
                               cp_comm="ring", clock_offset_us=300.0, host_jitter_us=100.0,
                               slow_rank=(3, 1.7)),
    # ranks 1-3 placed one after another, each against the one before: they were off together
    "ring-only-slow-pair": GpuJob(ranks=4, steps=7, seed=4200045, all_to_alls=0, cp_size=4,
                                  cp_comm="ring",
                                  jitter=0.018372166015807587, clock_offset_us=387.1607080709216,
                                  host_jitter_us=268.492565323437, buckets=4,
                                  slow_group=((1, 2), 2.6437982206059782)),
}


@pytest.mark.parametrize("name", sorted(JOBS))
def test_ranks_linked_only_by_a_ring_get_their_hosts_clock(tmp_path, name):
    job = JOBS[name]
    write_gpu_job(job, tmp_path)
    trace = load_trace(tmp_path)
    got = np.array([trace.meta.extra["clock_offsets_s"][str(r)] for r in range(job.ranks)])
    # transfers take 30-50 µs: the offset is known to within their spread, not to the waits
    assert np.abs(got * 1e6 - _true_offsets_us(job)).max() < 30.0, got * 1e6
    json.dumps(trace.meta.extra["clock_alignment"], allow_nan=False)   # written as JSON


@pytest.mark.slow
@pytest.mark.parametrize("name", ["seed12-job15", "ring-only-slow-pair"])
def test_no_healthy_rank_beside_the_slow_one_is_named(tmp_path, name):
    from stragglers.whatif import analyze

    truth = write_gpu_job(JOBS[name], tmp_path)
    named = {(f.cause, int(w.rank)) for f in analyze(load_trace(tmp_path)).diagnosis
             for w in f.where.workers or []}
    assert named == {(c["cause"], r) for c in truth["causes"] for r in c["ranks"]}


def _ring_job(offsets_us, slow, steps=4, t_us=40.0, seed=0, spread=20.0, factor=1.8):
    """Ends, spans and ring peers of 4 ranks on clocks `offsets_us` apart (each its own host),
    `steps` times 3 ring rounds then an all-reduce in each half (ranks 0-1, 2-3: the halves
    share nothing but the ring). A round: a chunk of attention (×1.8 on rank `slow`), then the
    exchange, which ends t after the latest post of the rank and its two neighbours."""
    rng = np.random.default_rng(seed)
    n = len(offsets_us)
    sync: dict[int, dict[tuple, float]] = {r: {} for r in range(n)}
    spans: dict[int, dict[tuple, tuple[float, float]]] = {r: {} for r in range(n)}

    def record(r, key, start, end):
        spans[r][key] = ((start + offsets_us[r]) / 1e6, (end + offsets_us[r]) / 1e6)
        sync[r][key] = spans[r][key][1]

    ready = rng.uniform(0, 2.5 * spread, n)
    for step in range(steps):
        for k in range(3):
            chunk = rng.uniform(400 - spread, 400 + spread, n)
            chunk[slow] *= factor
            post = ready + chunk
            end = np.array([max(post[r - 1], post[r], post[(r + 1) % n])
                            for r in range(n)]) + t_us + rng.uniform(0, 10, n)
            for r in range(n):
                record(r, (RING_SYNC, "cp", "seq", 3 * step + k), post[r], end[r])
            ready = end
        post = ready + 1000.0 + rng.uniform(-5 * spread, 5 * spread, n)
        for pg, half in (("dp0", [0, 1]), ("dp1", [2, 3])):
            for r in half:
                record(r, (pg, "seq", step), post[r], post[half].max() + 20.0)
            ready[half] = post[half].max() + 20.0
        ready += rng.uniform(0, 5 * spread, n)
    peers = {r: {"cp": ((r - 1) % n, (r + 1) % n)} for r in range(n)}
    return sync, spans, peers


@pytest.mark.parametrize("slow", [0, 1, 2, 3])
def test_a_slow_rank_in_the_ring_does_not_move_the_other_halfs_clock(slow):
    offsets = np.array([0.0, 35.0, -120.0, 80.0])
    sync, spans, peers = _ring_job(offsets, slow)
    got, quality, _ = clock_offsets(sync, {}, spans, peers)
    assert np.abs(np.array([got[r] for r in range(4)]) * 1e6 - offsets).max() < 25.0
    assert "ring" in quality[2]


def test_where_no_rank_waited_across_the_bounds_place_the_halves():
    offsets = np.array([0.0, -60.0, 210.0, 150.0])
    sync, spans, peers = _ring_job(offsets, 0, spread=0.0, factor=1.0)
    got, quality, notes = clock_offsets(sync, {}, spans, peers)
    assert quality[2]["ring"]["waits_read"] == 0
    assert np.abs(np.array([got[r] for r in range(4)]) * 1e6 - offsets).max() < 25.0
    assert not notes


def test_without_a_traced_ring_neighbour_across_the_ends_place_the_halves_with_a_note():
    offsets = np.array([0.0, 35.0, -120.0, 80.0])
    sync, spans, _ = _ring_job(offsets, 1)
    elsewhere = {r: {"cp": (8, 9)} for r in range(4)}     # neighbours not among the files
    got, quality, notes = clock_offsets(sync, {}, spans, elsewhere)
    assert quality[2]["ring"]["bounds_s"] == [None, None]
    json.dumps(quality, allow_nan=False)                   # meta.extra is written as JSON
    assert any("rests on the exchanges' ends" in n for n in notes)


def _ring_with_a_slow_link(offsets_us, factor, slow, steps=5, seed=0):
    """As _ring_job, each transfer of its own time (40-50 µs) and those of the link between
    ranks 1 and 2 (the one joining the halves) ×`factor`: a link's transfer starts when both
    its ends posted; an exchange ends with its later link."""
    rng = np.random.default_rng(seed)
    n = len(offsets_us)
    sync: dict[int, dict[tuple, float]] = {r: {} for r in range(n)}
    spans: dict[int, dict[tuple, tuple[float, float]]] = {r: {} for r in range(n)}

    def record(r, key, start, end):
        spans[r][key] = ((start + offsets_us[r]) / 1e6, (end + offsets_us[r]) / 1e6)
        sync[r][key] = spans[r][key][1]

    ready = rng.uniform(0, 50, n)
    for step in range(steps):
        for k in range(3):
            chunk = rng.uniform(380, 420, n)
            chunk[slow] *= 1.8
            post = ready + chunk
            link = {a: max(post[a], post[(a + 1) % n]) + rng.uniform(40, 50)
                    * (factor if a == 1 else 1.0) for a in range(n)}
            end = np.array([max(link[(r - 1) % n], link[r]) for r in range(n)])
            for r in range(n):
                record(r, (RING_SYNC, "cp", "seq", 3 * step + k), post[r], end[r])
            ready = end
        post = ready + 1000.0 + rng.uniform(-100, 100, n)
        for pg, half in (("dp0", [0, 1]), ("dp1", [2, 3])):
            for r in half:
                record(r, (pg, "seq", step), post[r], post[half].max() + 20.0)
            ready[half] = post[half].max() + 20.0
        ready += rng.uniform(0, 100, n)
    return sync, spans, {r: {"cp": ((r - 1) % n, (r + 1) % n)} for r in range(n)}


# A slow link's transfer is no wait: read with one transfer time a round, the 400 µs of the
# link joining the halves moved their clocks 370-640 µs apart beside a slow rank.
@pytest.mark.parametrize("seed", range(3))
def test_a_slow_link_between_the_halves_is_no_clock_offset(seed):
    offsets = np.array([0.0, 35.0, -120.0, 80.0])
    sync, spans, peers = _ring_with_a_slow_link(offsets, 10.0, 2, seed=seed)
    got, _, _ = clock_offsets(sync, {}, spans, peers)
    assert np.abs(np.array([got[r] for r in range(4)]) * 1e6 - offsets).max() < 80.0
