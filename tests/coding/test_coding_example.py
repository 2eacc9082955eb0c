"""The torchrun example trains and compares schemes end to end."""

import pytest
from conftest import torchrun


@pytest.mark.distributed
def test_train_coded_example_runs_and_compares():
    out = torchrun("examples/train_coded.py", 3, "--scheme", "cyclic-mds", "--stragglers", "1",
                   "--steps", "6", "--delay-dist", "pareto", "--delay-scale", "0.003",
                   "--seed", "1", "--compare", timeout=240)
    lines = out.stdout.splitlines()
    rows = {line.split()[0]: line.split() for line in lines
            if line.split() and line.split()[0] in ("wait-for-all", "ignore-stragglers",
                                                    "cyclic-mds-real")}
    assert set(rows) == {"wait-for-all", "ignore-stragglers", "cyclic-mds-real"}, out.stdout
    # exact code: same final loss as wait-for-all
    assert rows["cyclic-mds-real"][4] == rows["wait-for-all"][4]
    assert all(int(r[2]) == 6 for r in rows.values())
