"""Text read from files reaches the terminal as text: control characters (ESC, C1, the bidi
overrides) are written as escapes in the report and in the CLI's error lines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from stragglers.wording import printable, printable_all

REPO = Path(__file__).resolve().parents[2]


def test_control_characters_are_written_as_escapes_and_text_is_kept():
    assert printable("run\x1b[2J\x9b\u202e\x07") == "run\\x1b[2J\\x9b\\u202e\\x07"
    assert printable("tab\tand\nnewline, ünïcode ✓") == "tab\tand\nnewline, ünïcode ✓"
    assert printable_all({"h\x1b": ["a\x1b", 1.5, None, {"k": "\x00"}]}) == \
        {"h\\x1b": ["a\\x1b", 1.5, None, {"k": "\\x00"}]}


def test_an_error_line_quoting_a_path_writes_no_escape(tmp_path):
    # a path named with a terminal escape, handed on by a script: the one error line quotes it
    bad = tmp_path / "run\x1b]0;title\x07"
    bad.mkdir()
    done = subprocess.run([sys.executable, "-m", "stragglers.cli", "analyze", str(bad)],
                          capture_output=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert done.returncode == 2, done.stderr
    assert b"\x1b" not in done.stderr and b"\\x1b]0;title" in done.stderr, done.stderr


def test_the_advice_table_writes_a_run_names_escapes_as_text(tmp_path):
    import json

    from stragglers.trace.runformat import write_run
    from stragglers.trace.synth import generate

    run = write_run(tmp_path / "run", generate(dp=2, pp=1, microbatches=2, steps=4, seed=1))
    meta = json.loads((run / "meta.json").read_text())
    meta["name"] = "\x1b[2J\x1b]0;pwned\x07run"
    (run / "meta.json").write_text(json.dumps(meta))
    done = subprocess.run([sys.executable, "-m", "stragglers.cli", "advise", str(run)],
                          capture_output=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert done.returncode == 0, done.stderr[-1500:]
    assert b"\x1b" not in done.stdout and b"\\x1b[2J" in done.stdout, done.stdout[:300]
