"""Red team round six (issue 34) on the shard service: `stragglers adapt serve` as an operator
starts it, in a subprocess (a start that dies must not take pytest along).

Each test is one defect class, marked xfail(strict=True) until its fix lands (then the mark goes).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TOKEN = "hostile-round6-token-0123456789"


def start(tmp: Path, db: str) -> tuple[int | None, str]:
    """(exit status, or None while it still serves; what it said) of `adapt serve --db DB`."""
    token = tmp / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    proc = subprocess.Popen([sys.executable, "-m", "stragglers.cli", "adapt", "serve", "--db", db,
                             "--port", "0", "--token-file", str(token)], cwd=tmp,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        # a liveness bound: a refusal ends at once; a service that took the file keeps serving
        out, _ = proc.communicate(timeout=20)
        return proc.returncode, out.decode(errors="replace")
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
        return None, out.decode(errors="replace")


@pytest.mark.slow
def test_a_db_that_is_not_a_file_is_refused_in_one_line(tmp_path):
    """`--db :memory:` holds nothing across connections (and nothing durable): one line naming
    --db, exit 2, before it says it serves."""
    status, said = start(tmp_path, ":memory:")
    lines = [line for line in said.splitlines() if line.strip()]
    assert status == 2, (status, said[-1500:])
    assert len(lines) == 1 and ":memory:" in lines[0] and "internal error" not in said, said
