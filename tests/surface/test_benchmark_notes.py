"""Benchmark scripts write their own notes from what they measured, so a rerun regenerates the page."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import msgspec
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import advise_remedies  # noqa: E402
import cpu_contention_share  # noqa: E402
import kineto_memory  # noqa: E402
import results  # noqa: E402
from results import Load, Run  # noqa: E402


def _written(tmp_path: Path, name: str) -> Run:
    return msgspec.json.decode((tmp_path / f"{name}.json").read_bytes(), type=Run)


def test_advise_remedies_writes_medians_misses_and_shared_cores(tmp_path, monkeypatch) -> None:
    """Per row and remedy the medians over repetitions; each miss over 15% named with its A/A."""
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", ["advise_remedies.py"])
    monkeypatch.setattr(advise_remedies.os, "cpu_count", lambda: 2)

    def rep(row: str, n: int, aa: float, remedies: dict) -> dict:
        return {"row": row, "rep": n, "aa_spread": aa, "ranking": list(remedies),
                "remedies": remedies}

    report = [rep("slow-device", 0, 0.02, {"antdt-dd": {"applies": True, "predicted": 1.85,
                                                        "measured": 1.83}}),
              rep("slow-device", 1, 0.04, {"antdt-dd": {"applies": True, "predicted": 1.87,
                                                        "measured": 1.79}}),
              rep("stage", 0, 0.21, {"stage-split": {"applies": True, "predicted": 1.21,
                                                     "measured": 1.04}})]
    args = argparse.Namespace(only="slow-device,stage", reps=2, steps=30, measure_all=False)
    advise_remedies.write_results(report, args, 12.4)
    run = _written(tmp_path, "advise_remedies")
    assert run.figures[0].value == "2 of 3 comparisons (median |off| 4%)"
    assert run.figures[0].note == ("misses: stage-split on stage rep 0 16% (its two before runs "
                                   "differ by 21%)")
    first = run.table[0]
    assert first["row"] == "slow-device (4 ranks, rank 3's device takes 2.5× per sample)"
    assert (first["predicted (median over repetitions)"], first["measured"],
            first["repetitions"]) == ("×1.860", "×1.810", "2")
    assert run.table[1]["row"].startswith("stage (2 ranks, ")
    assert run.note == "12 minutes of real jobs (3 repetitions)."
    assert "shared them: slow-device (4 ranks)." in run.text[1]


def test_cpu_contention_share_notes_say_the_load_and_the_shares() -> None:
    """The load over a set of runs and the clean runs' CPU-wait shares come from the runs."""
    loads = [Load(min=4.7, median=5.7, max=5.9, samples=3, seconds=19.0),
             Load(min=5.9, median=6.5, max=8.1, samples=3, seconds=24.0)]
    assert cpu_contention_share.load_range(loads) == "4.7–8.1 (median 6.1)"
    clean = {"GPipe": [("cpu_contention", "61%")], "1F1B": [("communication", "27%")],
             "DualPipeV": [("none", "-")]}
    assert cpu_contention_share.shares_note(clean).startswith(
        "CPU waits explain 27–61% of the clean runs' late transfers")
    assert cpu_contention_share.shares_note({"x": [("none", "-")]}) == (
        "no clean run has a communication or cpu_contention finding")


@pytest.mark.slow
def test_kineto_memory_big_writes_its_result(tmp_path, monkeypatch) -> None:
    """--big writes kineto_memory_big.json; an input under 8 × 1 GB is not judged by the goal."""
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", ["kineto_memory.py", "--big", "--ranks", "2",
                                      "--kernels", "400", "--workdir", str(tmp_path / "w")])
    kineto_memory.main()
    run = _written(tmp_path, "kineto_memory_big")
    assert run.benchmark == "Kineto reader: 2 ranks × 0.0 GB of profiler JSON"
    assert run.command == (".venv/bin/python benchmarks/kineto_memory.py --big --ranks 2 "
                           "--kernels 400 --workdir " + str(tmp_path / "w"))
    peak = run.figures[0]
    assert peak.goal == "≤ 1.5 GB for 8 × 1 GB" and peak.met is None
    assert peak.note.endswith("smaller than the goal's 8 × 1 GB: not judged")
    pool = min(2, len(os.sched_getaffinity(0)))
    assert [row["parse workers"] for row in run.table] == ["1", f"CLI default (up to {pool})"]
    assert {row["rows"] for row in run.table} == {"32"}
