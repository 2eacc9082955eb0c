"""A recorded run's layout metadata (extra.layout, parallel, process_groups, group_sizes, mesh)
checked when meta.json is read: a hand-broken field is one line naming meta.json and the field,
never an internal error deep in the analysis, nor a wrong layout shown as the job's."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys

import pytest
from conftest import REPO

from stragglers.errors import InputError
from stragglers.trace.runformat import meta_from_dict

RUN = REPO / "tests" / "data" / "recorded" / "moe-hot-expert-beside-hogs"  # 4 ranks, ep 4


def recorded_meta() -> dict:
    return json.loads((RUN / "meta.json").read_text())


def entry(i: int, **change):
    def edit(m):
        m["extra"]["layout"][i].update(change)
    return edit


def extra(key: str, value):
    def edit(m):
        m["extra"][key] = value
    return edit


BROKEN = [
    (extra("layout", 5), "extra.layout", "expected a list of rank entries, got int"),
    (extra("layout", "ab"), "extra.layout", "expected a list of rank entries, got str"),
    (extra("layout", ["x"]), "extra.layout[0]", "expected a mapping, got str"),
    (entry(1, rank="x"), "extra.layout[1].rank", "expected an integer in 0..3"),
    (entry(1, rank=[1]), "extra.layout[1].rank", "expected an integer in 0..3"),
    (entry(1, rank=7), "extra.layout[1].rank", "expected an integer in 0..3"),
    (entry(1, rank=True), "extra.layout[1].rank", "expected an integer in 0..3"),
    (entry(1, rank=0), "extra.layout[1].rank", "rank 0 listed twice"),
    (entry(1, dp_rank="a"), "extra.layout[1].dp_rank", "expected an integer in 0..3"),
    (entry(1, dp_rank=0), "extra.layout[1]", "the place of rank 0"),
    (entry(1, stage=2), "extra.layout[1].stage", "expected an integer in 0..0"),
    (entry(1, host=5), "extra.layout[1].host", "expected a string, got int"),
    (entry(1, cpus=["0"]), "extra.layout[1].cpus", "expected a string, got list"),
    (entry(1, tp_rank=-1), "extra.layout[1].tp_rank", "expected an integer in 0..3"),
    (entry(1, threads=0), "extra.layout[1].threads", "expected an integer in 1..65536"),
    (entry(1, threads="2"), "extra.layout[1].threads", "expected an integer in 1..65536"),
    (entry(1, threads=1.5), "extra.layout[1].threads", "expected an integer in 1..65536"),
    (entry(1, threads=True), "extra.layout[1].threads", "expected an integer in 1..65536"),
    (entry(1, threads=1 << 40), "extra.layout[1].threads", "expected an integer in 1..65536"),
    (extra("parallel", "x"), "extra.parallel", "expected a mapping"),
    (extra("parallel", {"dp": 1, "tp": 3}), "extra.parallel.tp", "3 does not divide the world "
                                                                 "size 4"),
    (extra("parallel", {"dp": 2, "tp": "2"}), "extra.parallel.tp", "expected a positive integer"),
    (extra("parallel", {"dp": 2, "tp": 1}), "extra.parallel", "expected the world size 4"),
    (extra("parallel", {"dp": 1, "cp": 2, "pp": 2}), "extra.parallel.pp", "but pp_size is 1"),
    (extra("parallel", {"dp": 4, "ep": 3}), "extra.parallel.ep", "3 does not divide"),
    (extra("parallel", {"dp": 4, "xp": 1}), "extra.parallel.xp", "expected keys among"),
    (extra("process_groups", [[0, 9]]), "extra.process_groups[0]", "distinct ranks in 0..3"),
    (extra("process_groups", [[0, 0]]), "extra.process_groups[0]", "distinct ranks in 0..3"),
    (extra("process_groups", "x"), "extra.process_groups", "expected a list of rank lists"),
    (extra("group_sizes", {"ep": -4}), "extra.group_sizes.ep", "expected a size in 1..4"),
    (extra("mesh", 7), "extra.mesh", "expected a mapping of dimension name to size"),
    (extra("tp_size_implied", "two"), "extra.tp_size_implied", "expected a size in 1..4"),
    (extra("compute_split_at_collectives", "yes"), "extra.compute_split_at_collectives",
     "expected true or false"),
]


@pytest.mark.parametrize("edit,field,words", BROKEN, ids=[f"{b[1]}:{b[2][:20]}" for b in BROKEN])
def test_a_broken_layout_field_is_named(edit, field, words):
    raw = recorded_meta()
    edit(raw)
    with pytest.raises(InputError) as err:
        meta_from_dict(raw, "run/meta.json")
    message = str(err.value)
    assert message.startswith(f"run/meta.json: field '{field}': ") and words in message, message
    assert "\n" not in message


@pytest.mark.parametrize("edit", [
    lambda m: m["extra"]["layout"].pop(),                       # a rank not listed
    lambda m: [e.pop("host") for e in m["extra"]["layout"]],    # no hosts
    lambda m: m["extra"]["layout"][2].update(host=None),
    lambda m: m["extra"].pop("parallel"),
], ids=["rank-missing", "hosts-missing", "host-null", "no-parallel"])
def test_a_layout_that_only_says_less_is_read(edit):
    raw = recorded_meta()
    edit(raw)
    assert meta_from_dict(raw, "run/meta.json").world_size == 4


def test_the_recorded_runs_layouts_are_read_unchanged():
    for meta in sorted((REPO / "tests" / "data").glob("**/meta.json")):
        raw = json.loads(meta.read_text())
        assert meta_from_dict(raw, meta).extra == raw.get("extra", {})


@pytest.mark.parametrize("edit,field", [(entry(1, rank="x"), "extra.layout[1].rank"),
                                        (extra("layout", 5), "extra.layout"),
                                        (extra("parallel", {"dp": 1, "tp": 3}),
                                         "extra.parallel.tp")],
                         ids=["rank", "layout", "tp"])
def test_analyze_on_a_broken_layout_is_one_line(tmp_path, edit, field):
    # before: an internal error (int() of 'x', iterating an int), or tp 3 in the report's header
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    raw = copy.deepcopy(recorded_meta())
    edit(raw)
    (run / "meta.json").write_text(json.dumps(raw))
    proc = subprocess.run([sys.executable, "-m", "stragglers.cli", "analyze", str(run)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        line for line in proc.stderr.strip().splitlines() if line.startswith("error: ")]
    assert f"{run / 'meta.json'}: field '{field}'" in proc.stderr


def rank_pg(run, rank: int, pg: int) -> None:
    """Rewrite `rank`'s all-to-all rows of the copied run to process group `pg`."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    for path in sorted(run.glob(f"rank-{rank:05d}*.parquet")):
        table = pq.read_table(path)
        column = np.array(table.column("pg").to_pylist())
        column[np.array([o == "all-to-all" for o in table.column("optype").to_pylist()])] = pg
        i = table.schema.get_field_index("pg")
        pq.write_table(table.set_column(i, "pg", pa.array(column, table.schema.field(i).type)),
                       path)


@pytest.mark.parametrize("groups,pg,words", [
    (None, 5, "process group 5, but"),
    ([[0, 1, 2, 3], [0, 2]], 1, "rank 1's rows name process group 1 [0, 2], which does not hold "
                                "rank 1"),
], ids=["unlisted", "not-a-member"])
def test_a_row_in_a_group_that_is_not_its_ranks_is_one_line(tmp_path, groups, pg, words):
    # rank 1's all-to-alls in a group listed nowhere, or one without rank 1: its collectives
    # were read as ones of their own and rank 1 named as a communication straggler
    from stragglers.trace.runformat import read_run

    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    if groups is not None:
        raw = recorded_meta()
        raw["extra"]["process_groups"] = groups
        (run / "meta.json").write_text(json.dumps(raw))
    rank_pg(run, 1, pg)
    with pytest.raises(InputError) as err:
        read_run(run)
    message = str(err.value)
    assert message.startswith(f"{run / 'rank-00001'}*.parquet: field 'pg': ") and words in message


def test_analyze_on_a_row_in_a_group_listed_nowhere_is_one_line(tmp_path):
    # analyze reads a run by step partitions (whatif/partitioned.py), not read_run: it named
    # rank 1 a communication straggler here
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    rank_pg(run, 1, 5)
    proc = subprocess.run([sys.executable, "-m", "stragglers.cli", "analyze", str(run)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: {run / 'rank-00001'}*.parquet: field 'pg': process group 5, but "
        f"{run / 'meta.json'} lists 1 (extra.process_groups); expected an id among them or -1"]
