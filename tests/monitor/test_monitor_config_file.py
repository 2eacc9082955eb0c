"""The monitor's YAML file: every wrong shape is one line naming the file and the key, exit 2,
before anything is opened or served."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, free_port

BAD = {
    "settings: [1, 2]\n": "settings",            # a list where the settings mapping goes
    "settings: 5\n": "settings",
    "webhooks: [5]\n": "webhooks",
    "webhooks: ftp://x\n": "webhooks",
    "colour: blue\n": "colour",                   # not a key of the file
    "[1, 2]\n": "expected a mapping",
}


@pytest.mark.slow
@pytest.mark.parametrize("text", list(BAD))
def test_a_wrong_config_file_is_one_line_naming_the_key(tmp_path, text):
    cfg = tmp_path / "monitor.yaml"
    cfg.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "stragglers.monitor", "serve", "--db",
                           str(tmp_path / "mon.db"), "--port", str(free_port()), "--config",
                           str(cfg)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert str(cfg) in lines[0] and BAD[text] in lines[0], lines[0]
    assert not (tmp_path / "mon.db").exists()     # refused before the store was opened
