"""The slow-rank injection the trainer workers share: examples/injection.py's forward hook."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

from injection import burn, slow_down  # noqa: E402,F401
