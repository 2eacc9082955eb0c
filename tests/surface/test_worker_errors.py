"""An error inside torchrun's workers is reported once: one line from rank 0 naming the flag."""

from __future__ import annotations

import pytest
from conftest import REPO, torchrun


@pytest.mark.distributed
def test_an_earlier_run_in_the_trace_dir_is_one_line_naming_overwrite(tmp_path):
    trace_dir = tmp_path / "gpt"
    trace_dir.mkdir()
    (trace_dir / "meta.json").write_text("{}")  # an earlier run
    proc = torchrun(REPO / "examples" / "train_gpt.py", 2, "--pp", "2", "--steps", "2",
                    "--trace-dir", str(trace_dir), check=False, timeout=300)
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(ours) == 1, proc.stderr[-4000:]            # once, not once per rank
    assert str(trace_dir) in ours[0] and "--overwrite" in ours[0]
    assert "overwrite=True" not in proc.stderr              # the script's flag, not the API's
    assert "[rank" not in proc.stderr                       # no worker tracebacks
    assert (trace_dir / "meta.json").read_text() == "{}"   # the earlier run is untouched
