"""Red team round 17: the monitor's analysis process when it cannot be started, dies, or its
service dies (real spawned processes, real resource limits, no mocks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil

from conftest import REPO

_SPAWN_FAILS = textwrap.dedent("""
    import os, resource, sys
    sys.path.insert(0, sys.argv[1])
    from monitor_jobs import closed_windows
    from stragglers.monitor.analyser import WindowAnalyser

    def main():
        first, second = closed_windows(2)
        analyser = WindowAnalyser()
        def open_fds():
            return len(os.listdir("/proc/self/fd")) - 1   # (less listdir's own)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        before = open_fds()
        # room for the two pipes (4 handles) and no more: the spawn itself runs out of handles
        resource.setrlimit(resource.RLIMIT_NOFILE, (before + 4, hard))
        analyser.warm()   # (was: OSError out of the job's tracker creation)
        row, refused = analyser.analyse(first)   # (was: OSError, the window dropped)
        assert open_fds() == before, (open_fds(), before)   # no pipe end left open
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        print("ROW1", row.idx, row.slowdown, row.error, flush=True)
        row2, _ = analyser.analyse(second)
        print("ROW2", row2.idx, row2.slowdown, row2.error, flush=True)
        analyser.close()


    if __name__ == "__main__":   # (the spawned process imports this file too)
        main()
""")


def test_a_window_whose_analysis_process_cannot_be_spawned_keeps_an_error_row(tmp_path):
    """Out of file handles (RLIMIT_NOFILE lowered in a real process): the window gets an error
    row (before: OSError raised out of analyse, the window never stored) and its pipes are
    closed; the next window is analysed in a new process."""
    script = tmp_path / "spawn_fails.py"
    script.write_text(_SPAWN_FAILS)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run([sys.executable, str(script), str(REPO / "tests" / "monitor")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    idx, slowdown, error = lines["ROW1"].split(" ", 2)
    assert (idx, slowdown) == ("0", "None"), lines
    assert "analysis failed: the analysis process could not be started" in error
    assert "Too many open files" in error and "the next window tries a new process" in error
    idx, slowdown, error = lines["ROW2"].split(" ", 2)
    assert idx == "1" and error == "None" and float(slowdown) > 1.3, lines
