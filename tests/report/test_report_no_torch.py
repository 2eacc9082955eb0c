"""The report path imports and runs without torch (the analysis extra has no torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
from rich.console import Console
from stragglers.report import print_report, render_html
print_report({"slowdown": 1.2}, Console(file=open("/dev/null", "w")))
assert "1.200" in render_html({"slowdown": 1.2})
print("ok")
"""


@pytest.mark.slow
def test_report_runs_without_torch():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
