"""An error inside torchrun's workers is reported once: one line from rank 0 naming the flag."""

from __future__ import annotations

import sys
import types

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


def test_before_the_group_only_rank_0_prints_a_refusal(monkeypatch, capsys):
    sys.path.insert(0, str(REPO / "examples"))
    from launch import main_once

    def refuse():
        raise SystemExit("--flag 3: expected at most 2")

    monkeypatch.setenv("RANK", "0")
    assert main_once(refuse) == 2
    assert capsys.readouterr().err == "error: --flag 3: expected at most 2\n"
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr("launch.time.sleep", lambda s: None)  # torchrun would end it here
    assert main_once(refuse) == 2
    assert capsys.readouterr().err == ""


def test_after_the_group_exists_the_rank_that_failed_prints_at_once(monkeypatch, capsys, tmp_path):
    dist = pytest.importorskip("torch.distributed")
    from stragglers.errors import InputError

    sys.path.insert(0, str(REPO / "examples"))
    from launch import main_once

    def fail():
        raise InputError("shards.db", None, "is damaged")

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        monkeypatch.setenv("RANK", "3")  # a failure of its own: no other rank would print it
        # launch's own `time` replaced, not time.sleep itself: the threads of other tests in
        # this worker (a service's heartbeat) sleep as usual
        monkeypatch.setattr("launch.time", types.SimpleNamespace(
            sleep=lambda s: pytest.fail("a failed rank waited")))
        assert main_once(fail) == 2
    finally:
        dist.destroy_process_group()
    assert capsys.readouterr().err == "error: rank 3: shards.db: is damaged\n"
