"""Red team round eight (issue 34): the analysis CLI on hostile step-time tables (the fourth
format `analyze` reads), NDTimeline and run files, and the services.

Each test is one defect class, marked xfail(strict=True) until its fix lands (then the mark goes):
a pass before the fix fails the suite, so each flips exactly when its defect is gone. Real
servers and real CLI processes in subprocesses (a hang or an abort must not take pytest along).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from test_hostile_services_round6 import clean_refusal, cli


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
