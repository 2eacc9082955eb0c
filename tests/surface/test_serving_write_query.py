"""Every write route of the shard service, by every method it takes but GET, refuses a query
string 400 `query` with nothing done (the fields of a write are its body's); PUT and PATCH, which
no route takes, are 405 and change nothing."""

from __future__ import annotations

import httpx

OWNER = {"Authorization": "Bearer owner-write-query-token-0123456789"}


def _state(c: httpx.Client) -> tuple:
    return (c.get("/datasets/d/snapshot").content, c.get("/jobs/j/control/state").content)


def test_no_write_with_a_query_string_changes_anything(tmp_path):
    from stragglers.adapt.service import EmbeddedServer, ServiceConfig

    # (refusals answered at once: their pause is another test's)
    config = ServiceConfig(refusal_delay_s=0, auth_failure_delay_s=0)
    server = EmbeddedServer(tmp_path / "s.db", config=config).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60, headers=OWNER) as c:
            r = c.post("/datasets", json={"name": "d", "num_samples": 8, "shard_size": 2})
            assert r.status_code == 200, r.text
            fence = c.post("/datasets/d/join", json={"worker": "w"}).json()["fence"]
            r = c.post("/jobs/j/control/config", json={"policy": "bsp", "world_size": 2,
                                                        "global_batch": 8})
            assert r.status_code == 200, r.text
            before = _state(c)
            writes = [(m, route.path) for route in server.app.app.routes
                      for m in sorted(route.methods - {"GET", "HEAD"})]
            assert {m for m, _ in writes} == {"POST", "DELETE"}, writes
            answers = {}
            for method, path in writes + [("PUT", "/datasets/{name}"),
                                          ("PATCH", "/datasets/{name}/lease")]:
                target = path.format(name="d", job="j") + "?dry_run=1&fence=%d" % fence
                body = {"worker": "w", "fence": fence, "name": "d", "num_samples": 8,
                        "shard_size": 2}
                r = c.request(method, target, json=None if method == "DELETE" else body)
                answers[method, path] = (r.status_code, r.json().get("field"))
            refused = {k: v for k, v in answers.items() if k[0] in ("POST", "DELETE")}
            assert set(refused.values()) == {(400, "query")}, refused
            assert answers["PUT", "/datasets/{name}"][0] == 405, answers
            assert answers["PATCH", "/datasets/{name}/lease"][0] == 405, answers
            assert _state(c) == before   # nothing done
            # (the same writes without the query are done: the check above can fail)
            assert c.delete("/jobs/j/control").status_code == 200
            assert c.delete("/datasets/d").status_code == 200
    finally:
        server.stop()
