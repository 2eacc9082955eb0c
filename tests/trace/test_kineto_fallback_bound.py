"""What the streaming profiler decoder refuses (one NaN, invalid JSON) is read again by the
standard library only up to MAX_STDLIB_BYTES of text: its objects take up to about twelve
times the text, and a 260 KB .json.gz of floats with one NaN held 2.9 GB before its one-line
refusal at a 256 MiB bound."""

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
    probe = ("import json, resource, subprocess, sys\n"
             "done = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
             "rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024\n"
             "print(json.dumps([done.returncode, done.stderr, rss]))\n")
    done = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m", "stragglers.cli",
                           "analyze", str(bomb), "-q"], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    rc, err, rss = json.loads(done.stdout)
    assert rc == 2 and "rank-0.json.gz" in err and len(err.strip().splitlines()) == 1, err
    assert rss < 8 * MAX_STDLIB_BYTES, f"{rss / 2**20:.0f} MiB held for a {bomb.stat().st_size:,}-byte file"
