"""Cases a hostile client found (issue 34, red team): digits that are not ASCII, a name ending
in a newline, a name of dots only."""

from __future__ import annotations

import httpx
import pytest

from stragglers.adapt.service import EmbeddedServer

TOKEN = {"Authorization": "Bearer names-token-0123456789"}
CFG = {"policy": "nd", "world_size": 2, "global_batch": 64}


@pytest.mark.slow
def test_odd_digits_and_names_are_refused_in_one_line(tmp_path):
    srv = EmbeddedServer(tmp_path / "s.db").start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert c.post("/jobs/j/control/config", json=CFG, headers=TOKEN).status_code == 200
            # '²'.isdigit() is True and int('²') raises: it was a 500
            r = c.get("/jobs/j/control/actions", params={"since": "²"})
            assert r.status_code == 400 and r.json()["field"] == "since", r.text
            # `$` also matches before a final newline: 'd\n' was looked up as a data set
            r = c.get("/datasets/d%0A/status")
            assert r.status_code == 400 and r.json()["field"] == "name", r.text
            # a data set named '..' could be made, and no HTTP client reaches it by its path
            r = c.post("/datasets", headers=TOKEN,
                       json={"name": "..", "num_samples": 10, "shard_size": 1})
            assert r.status_code == 400 and "dots" in r.json()["error"], r.text
            assert c.get("/health").status_code == 200
    finally:
        srv.stop()
