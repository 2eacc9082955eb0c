"""A real profiler trace: what its reader could not see reaches the console, the JSON and the HTML."""

from __future__ import annotations

import html
import json
import subprocess
import sys
from pathlib import Path

import pytest

SAMPLE = (Path(__file__).resolve().parents[2].parent / "shared" / "data" / "kineto-samples"
          / "trace_filter_sampled_rank-0.json.gz")  # one rank of HTA's 128-rank job


@pytest.fixture(scope="module")
def analysed(tmp_path_factory):
    if not SAMPLE.exists():
        pytest.skip(f"{SAMPLE} not present")
    out = tmp_path_factory.mktemp("notes")
    proc = subprocess.run([sys.executable, "-m", "stragglers.cli", "analyze", str(SAMPLE),
                           "--json", str(out / "r.json"), "--html", str(out / "r.html")],
                          capture_output=True, text=True, timeout=300,
                          env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads((out / "r.json").read_text()), (out / "r.html").read_text()


@pytest.mark.slow
def test_ranks_read_and_missing_in_every_output(analysed):
    console, result, page = analysed
    assert result["job"]["ranks_read"] == 1 and result["job"]["world_size"] == 128
    assert len(result["job"]["missing_workers"]) == 127
    ranks = [n["message"] for n in result["notes"] if n["kind"] == "ranks"]
    assert ranks and "1 of 128" in ranks[0] and "missing: 1-127" in ranks[0]
    assert "1 of 128 DP×PP workers traced; missing: pp 0: dp 1–127" in console
    assert "ranks: read 1 of 128 ranks" in console
    assert "missing: pp 0: dp 1–127" in page and "read 1 of 128 ranks" in page


@pytest.mark.slow
def test_every_reader_note_reaches_console_and_html(analysed):
    console, result, page = analysed
    kinds = {n["kind"] for n in result["notes"]}
    assert {"ranks", "layout"} <= kinds  # no pipeline info: the layout was assumed
    flat = " ".join(console.replace("│", " ").split())  # the panel's text, unwrapped
    for note in result["notes"]:
        assert " ".join(note["message"].split()) in flat, note
        assert html.escape(note["message"], quote=True) in page, note
