"""Red team round fourteen (issue 34): the live monitor's answers written below the app, by the
shared serving layer itself (a head its HTTP parser refuses, a head over its bound), which
the app's guard never sees: their headers, their words and their bodies.

Each test is one defect class, marked xfail(strict=True) until its fix lands (then the mark goes):
a pass before the fix fails the suite, so each flips exactly when its defect is gone. Real
servers on loopback (the monitor on a thread of this process), real SQLite.
"""

from __future__ import annotations

import json
import socket
import sys

import pytest

from conftest import REPO
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.runformat import table_bytes

sys.path.insert(0, str(REPO / "tests" / "monitor"))
from monitor_jobs import parts_of, slow_job  # noqa: E402

TOKEN = "hostile-round14-token-0123456789"
MONITOR = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05)
# what the README promises of "every response" ("HTTP API": Host allow-list and headers)
SECURITY = ("content-security-policy", "x-frame-options", "x-content-type-options")


@pytest.fixture(scope="module")
def monitor(tmp_path_factory):
    """One monitor on loopback for the module's cases (each refused, or a job of its own)."""
    s = MonitorServer(tmp_path_factory.mktemp("r14") / "mon.db", port=0, token=TOKEN,
                      config=MONITOR).start()
    yield s
    s.stop()


def _exchange(port: int, data: bytes) -> tuple[str, dict[str, str], bytes]:
    """Send `data` on a new connection and read until the server closes it: (status line,
    headers lower-cased, body bytes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as k:
        k.sendall(data)
        k.shutdown(socket.SHUT_WR)   # (the refusal closes the connection: read to its end)
        out = b""
        while True:
            got = k.recv(65536)
            if not got:
                break
            out += got
    head, _, body = out.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return lines[0], headers, body


def _host(s: MonitorServer) -> str:
    return f"Host: 127.0.0.1:{s.port}\r\n"


# heads the serving layer's parser refuses before any app sees them
PARSER_REFUSED = {
    "garbage request line": "GARBAGE\r\n\r\n",
    "head over 64 KiB": "GET /health HTTP/1.1\r\n{host}X-Pad: " + "a" * 70_000 + "\r\n\r\n",
    "negative Content-Length": "PUT /api/jobs/j/meta HTTP/1.1\r\n{host}Content-Length: -1\r\n\r\n",
    "CONNECT": "CONNECT 127.0.0.1:22 HTTP/1.1\r\n{host}\r\n",
}


@pytest.mark.parametrize("case", list(PARSER_REFUSED))
def test_a_refusal_written_below_the_app_carries_the_security_headers(monitor, case):
    status, headers, body = _exchange(monitor.port,
                                      PARSER_REFUSED[case].format(host=_host(monitor)).encode())
    assert status.split()[1] in ("400", "431"), status
    assert "error" in json.loads(body)          # (the JSON shape holds already)
    missing = [h for h in SECURITY if h not in headers]
    assert missing == [], f"{case}: {status} without {missing}"


# refusals whose cause the parser knows: the answer must name the header or part at fault
NAMED = {
    "negative Content-Length": (
        "PUT /api/jobs/j/meta HTTP/1.1\r\n{host}Content-Length: -1\r\n\r\n", "content-length"),
    "Content-Length beside chunked": (
        "PUT /api/jobs/j/meta HTTP/1.1\r\n{host}Content-Length: 5\r\n"
        "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", "content-length"),
    "a control byte in a header value": (
        "GET /health HTTP/1.1\r\n{host}X-Trace: a\x01b\r\n\r\n", "header"),
    "a byte past ASCII in the target": (
        "GET /api/jobs/\xff HTTP/1.1\r\n{host}\r\n", "target"),
}


@pytest.mark.parametrize("case", list(NAMED))
def test_a_head_the_parser_refuses_is_answered_naming_what_is_wrong(monitor, case):
    raw, word = NAMED[case]
    status, _, body = _exchange(monitor.port, raw.format(host=_host(monitor)).encode("latin-1"))
    assert status.split()[1] == "400", status
    error = json.loads(body)["error"]
    assert word in error.lower(), f"{case}: {error!r} does not name the {word}"


def test_a_refused_head_request_is_answered_without_a_body(monitor):
    status, headers, body = _exchange(
        monitor.port, f"HEAD /api/jobs/\xff HTTP/1.1\r\n{_host(monitor)}\r\n".encode("latin-1"))
    assert status.split()[1] == "400", status
    assert body == b"", body


@pytest.fixture(scope="module")
def hasty(tmp_path_factory):
    """A monitor whose request heads must arrive within 0.5 s (its 408 is quick to see)."""
    config = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, header_timeout_s=0.5)
    s = MonitorServer(tmp_path_factory.mktemp("r14h") / "mon.db", port=0, token=TOKEN,
                      config=config).start()
    yield s
    s.stop()


def test_a_head_timeout_answer_carries_the_security_headers(hasty):
    with socket.create_connection(("127.0.0.1", hasty.port), timeout=10) as k:
        k.sendall(b"G")     # the first byte of a head that never ends: 408 after 0.5 s
        out = b""
        while True:
            got = k.recv(65536)
            if not got:
                break
            out += got
    head = out.partition(b"\r\n\r\n")[0].decode("latin-1").lower()
    assert head.startswith("http/1.1 408"), head
    missing = [h for h in SECURITY if f"\r\n{h}:" not in head]
    assert missing == [], f"408 without {missing}"


def test_the_per_client_connection_cap_counts_an_ipv6_hosts_64_as_one_client():
    from types import SimpleNamespace

    from stragglers.serving_guard import _client
    from stragglers.serving_quota import AnonymousPace

    # (no second IPv6 address can connect on loopback: the keying is judged as the cap uses it)
    one, two = "2001:db8:1:2::1", "2001:db8:1:2::beef"
    assert AnonymousPace.address(one) == AnonymousPace.address(two)   # the service's own rule
    assert _client(SimpleNamespace(client=(one, 40000))) == \
        _client(SimpleNamespace(client=(two, 40001)))


@pytest.mark.parametrize("url", ["http://", "http://[::1", "http://alerts:99999/",
                                 "http://alert manager/"])
def test_a_webhook_that_cannot_be_posted_to_is_refused_at_the_start(tmp_path, url):
    from stragglers.errors import InputError

    config = tmp_path / "rules.yaml"
    config.write_text(json.dumps({"webhooks": [url]}))
    try:
        s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config_file=config)
    except InputError as exc:
        assert "webhooks" in str(exc), str(exc)
        return
    s.store.close()
    s.sock.close()
    pytest.fail(f"webhook {url!r} taken")


def test_an_http10_request_with_transfer_encoding_is_refused_and_stores_nothing(monitor):
    import httpx

    body = json.dumps({"name": "r14", "dp_size": 1, "pp_size": 1, "world_size": 1,
                       "run_id": "0"})
    raw = (f"PUT /api/jobs/te10/meta HTTP/1.0\r\n{_host(monitor)}"
           f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
           f"Transfer-Encoding: chunked\r\n\r\n{len(body):x}\r\n{body}\r\n0\r\n\r\n")
    status, _, answer = _exchange(monitor.port, raw.encode())
    with httpx.Client(base_url=monitor.url, timeout=30,
                      headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        stored = c.get("/api/jobs/te10").status_code
    assert status.split()[1] == "400" and stored == 404, (status, answer, stored)


def test_a_new_runs_dropped_parts_are_reported_after_the_old_runs(monitor):
    import httpx

    def run_of(seed: int, start: float) -> tuple[dict, dict]:
        trace = slow_job(steps=5, seed=seed)
        meta = trace.meta.to_dict()
        meta["extra"]["clock"] = {"start": [start] * meta["world_size"]}
        meta["extra"]["run"] = f"run-{start:.0f}"   # the recorder's run token
        return meta, parts_of(trace, 5)[0][2]       # rank 0's part 0

    with httpx.Client(base_url=monitor.url, timeout=60,
                      headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        for seed, start, dropped in ((1, 1000.0, "5"), (2, 2000.0, "2")):
            meta, cols = run_of(seed, start)
            assert c.put("/api/jobs/drops/meta", json=meta).status_code == 200
            r = c.put("/api/jobs/drops/ranks/0/parts/0", content=table_bytes(cols),
                      headers={"X-Stragglers-Dropped": dropped,
                               "X-Stragglers-Run": f"run-{start:.0f}"})
            assert r.status_code == 200, r.text
        shown = c.get("/api/jobs/drops").json()["upload_dropped"]
        scraped = [line for line in c.get("/metrics").text.splitlines()
                   if line.startswith('stragglers_upload_dropped{job="drops"')]
    # the new run's uploader dropped 2 parts: shown as its, not hidden under the old run's 5
    assert shown == {"0": 2}, shown
    assert scraped == ['stragglers_upload_dropped{job="drops",rank="0"} 2.0'], scraped


def test_a_drop_count_sent_with_a_retried_part_is_stored(monitor):
    import httpx

    trace = slow_job(steps=5, seed=3)
    cols = parts_of(trace, 5)[0][2]   # rank 0's part 0
    with httpx.Client(base_url=monitor.url, timeout=60,
                      headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        assert c.put("/api/jobs/retried/meta", json=trace.meta.to_dict()).status_code == 200
        replies = [c.put("/api/jobs/retried/ranks/0/parts/0", content=table_bytes(cols),
                         headers={"X-Stragglers-Dropped": n}) for n in ("5", "7")]
        shown = c.get("/api/jobs/retried").json()["upload_dropped"]
    # (the second is the retry of a part whose first answer the uploader did not get, its
    # buffer having dropped two more parts meanwhile)
    assert [r.json()["status"] for r in replies] == ["stored", "duplicate"], replies
    assert shown == {"0": 7}, shown
