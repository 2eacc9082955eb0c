"""What the streaming profiler decoder refuses (one NaN, invalid JSON) is read again by the
standard library only up to MAX_STDLIB_BYTES of text: its objects take up to about twelve
times the text, and a 260 KB .json.gz of floats with one NaN held 2.9 GB before its one-line
refusal at a 256 MiB bound. Memory is measured above a small refused file's run, in the same
test: the imports alone (numpy, pyarrow, scipy) take some 140 MiB, more with newer wheels."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

from stragglers.trace.kineto.events import MAX_STDLIB_BYTES

REPO = Path(__file__).resolve().parents[2]


def test_a_small_gzip_of_floats_the_streaming_decoder_refuses_is_read_in_bounded_memory(tmp_path):
    bomb = tmp_path / "rank-0.json.gz"
    with gzip.open(bomb, "wb", compresslevel=9) as out:
        out.write(b'{"traceEvents": [], "pad": [')
        chunk = b"0.5," * (1 << 18)                     # 1 MiB of floats
        for _ in range((MAX_STDLIB_BYTES >> 20) + 8):   # past the bound
            out.write(chunk)
        out.write(b'0.5], "baseTimeNanoseconds": NaN}')
    small = tmp_path / "rank-1.json.gz"
    with gzip.open(small, "wb") as out:
        out.write(b'{"traceEvents": [], "pad": [0.5], "baseTimeNanoseconds": NaN}')
    rc, err, rss = _peak_of_analyze(bomb)
    assert rc == 2 and "rank-0.json.gz" in err and len(err.strip().splitlines()) == 1, err
    rc, err, imports = _peak_of_analyze(small)
    assert rc == 2 and "baseTimeNanoseconds" in err, err
    # the streaming pass held its tail and two copies of it, the fallback one read of the text
    # gathered in pieces and joined: 120 MiB above the imports; now one buffer each
    assert rss - imports < 2 * MAX_STDLIB_BYTES, (
        f"{(rss - imports) / 2**20:.0f} MiB held for a {bomb.stat().st_size:,}-byte file")


def _peak_of_analyze(path: Path) -> tuple[int, str, int]:
    """(exit status, stderr, peak resident bytes) of `stragglers analyze path` in a child."""
    probe = ("import json, resource, subprocess, sys\n"
             "done = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
             "rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024\n"
             "print(json.dumps([done.returncode, done.stderr, rss]))\n")
    done = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m", "stragglers.cli",
                           "analyze", str(path), "-q"], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    rc, err, rss = json.loads(done.stdout)
    return rc, err, rss
