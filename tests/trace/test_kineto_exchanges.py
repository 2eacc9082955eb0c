"""Ring attention's send/recv read as exchanges among its group, a pipeline's as transfers:
a pipeline rank's first transfer of a step stands alone, a ring round sends and receives at
once (trace/kineto/exchanges.py)."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from stragglers.trace.kineto.exchanges import EXCHANGE, merge_exchanges
from stragglers.trace.kineto.ops import Coll, RankParts
from stragglers.trace.load import load_trace
from stragglers.trace.synth.kineto import GpuJob, write_gpu_job


def _p2p(path) -> list[dict]:
    """A rank's send/recv records, as the profiler wrote them."""
    doc = json.loads(gzip.decompress(path.read_bytes()))
    return [e for e in doc["traceEvents"] if e["name"] == "record_param_comms"
            and e["args"]["Collective name"] in ("send", "recv")]


def _coll(kind, start, end, peer, pg="cp", step=0, seq=None):
    return Coll(start=start, end=end, launch=start - 1, step=step, kind=kind, pg=pg, seq=seq,
                src=peer if kind == "recv" else None, dst=peer if kind == "send" else None)


def _parts(colls: list[Coll]) -> RankParts:
    empty = np.zeros(0)
    return RankParts("f", None, None, 0, None, {}, True, {}, "gpu", [1], [(0.0, 1e9)],
                     empty, empty, empty, empty, empty, colls)


def test_pairs_sent_and_received_at_once_from_the_first_transfer_become_one_exchange():
    ring = {r: _parts([_coll("send", 10, 20, (r + 1) % 3, seq=1),
                       _coll("recv", 10, 21, (r - 1) % 3, seq=2),
                       _coll("recv", 40, 50, (r - 1) % 3, seq=3),
                       _coll("send", 41, 49, (r + 1) % 3, seq=4)]) for r in range(3)}
    assert merge_exchanges(ring) == {"cp"}
    for p in ring.values():
        assert [(c.kind, c.start, c.end, c.seq) for c in p.colls] == \
            [(EXCHANGE, 10, 21, 1), (EXCHANGE, 40, 50, 3)]


def test_a_pipeline_whose_first_transfer_stands_alone_keeps_its_sends_and_receives():
    # 1F1B on two stages, two microbatches: stage 0 sends the first activation alone, then
    # sends the second while it receives the first gradient (one grouped launch), then receives
    # the second gradient; stage 1 mirrors it
    stage0 = [_coll("send", 10, 12, 1, pg="pp"), _coll("send", 30, 40, 1, pg="pp"),
              _coll("recv", 30, 41, 1, pg="pp"), _coll("recv", 60, 62, 1, pg="pp")]
    stage1 = [_coll("recv", 9, 12, 0, pg="pp"), _coll("send", 29, 40, 0, pg="pp"),
              _coll("recv", 29, 41, 0, pg="pp"), _coll("send", 59, 62, 0, pg="pp")]
    parts = {0: _parts(stage0), 1: _parts(stage1)}
    assert merge_exchanges(parts) == set()
    assert [c.kind for c in parts[0].colls] == ["send", "send", "recv", "recv"]


def test_one_lone_transfer_on_one_rank_in_one_step_keeps_the_whole_group_as_transfers():
    parts = {r: _parts([_coll("send", 10, 20, 1 - r, step=s) for s in (0, 1)]
                       + [_coll("recv", 10, 20, 1 - r, step=s) for s in (0, 1)])
             for r in range(2)}
    parts[1].colls.append(_coll("send", 50, 55, 0, step=1))
    assert merge_exchanges(parts) == set()


@pytest.mark.parametrize("ranks, cp", [(8, 4), (4, 2)])
def test_a_ring_attention_job_reads_as_exchanges_in_its_cp_groups(tmp_path, ranks, cp):
    write_gpu_job(GpuJob(ranks=ranks, steps=2, seed=3, cp_size=cp, cp_comm="ring"), tmp_path)
    trace = load_trace(tmp_path)
    names = trace.optype_names()
    assert trace.meta.pp_size == 1   # a ring of two is no two-stage pipeline
    assert not {"forward-send", "forward-recv", "backward-send", "backward-recv"} & set(names)
    for r in range(ranks):
        exchanges = sum(1 for i, n in enumerate(names) if n == "send-recv"
                        and int(trace.ops["rank"][i]) == r)
        assert exchanges == len(_p2p(tmp_path / f"rank-{r}.json.gz")) // 2 > 0   # one per pair
    assert any("read as exchanges" in n.message for n in trace.notes)
    assert not any(n.message.endswith(("no send/recv): every rank is a data-parallel rank at "
                                       "stage 0 with dp_rank = rank")) for n in trace.notes)


# A ring round's exchange ends when the rank's own transfers do (its neighbours'), so in a
# ring of three or more its ends are no clock sync point while the ranks share another
# collective: read as one, a healthy rank opposite a slow one had its clock moved by the
# time its neighbours waited (540 µs here) and its exchanges named `communication`.
def test_a_ring_rounds_ends_do_not_move_a_healthy_ranks_clock(tmp_path):
    job = GpuJob(ranks=8, steps=8, seed=200715, all_to_alls=1, jitter=0.0144,
                 clock_offset_us=460.2, host_jitter_us=188.8, expert_groups=2, cp_size=4,
                 cp_comm="ring", tp_size=2, slow_group=((0, 4, 7), 2.25))
    write_gpu_job(job, tmp_path)
    trace = load_trace(tmp_path)
    true = np.random.default_rng(job.seed).uniform(-job.clock_offset_us, job.clock_offset_us,
                                                   job.ranks)           # the generator's
    got = np.array([trace.meta.extra["clock_offsets_s"][str(r)] for r in range(8)]) * 1e6
    assert np.abs(got - (true - true[0])).max() < 20.0


@pytest.mark.slow
def test_no_healthy_cp_peer_of_a_slow_group_is_named(tmp_path):
    from stragglers.whatif import analyze

    truth = write_gpu_job(GpuJob(ranks=8, steps=8, seed=200715, all_to_alls=1,
                                 jitter=0.0144, clock_offset_us=460.2, host_jitter_us=188.8,
                                 expert_groups=2, cp_size=4, cp_comm="ring", tp_size=2,
                                 slow_group=((0, 4, 7), 2.25)), tmp_path)
    named = {(f.cause, int(w.rank)) for f in analyze(load_trace(tmp_path)).diagnosis
             for w in f.where.workers or []}
    assert named == {(c["cause"], r) for c in truth["causes"] for r in c["ranks"]}
