"""What one client may create, whatever tokens it mints: without a service token anyone on the
machine may create, and the per-token quotas alone let one client take every controller and
data set slot by minting a token per 16 controllers. Each client address has a quota too —
but not a loopback one (every local process is 127.0.0.0/8: one would take every local
client's share) — and new tokens are rate-limited per client address and in all."""

from __future__ import annotations

import socket

import httpx
import pytest

from stragglers.adapt.service import EmbeddedServer, ServiceConfig

CFG = {"policy": "nd", "world_size": 2, "global_batch": 64}
SERVICE = "service-token-0123456789abcdef"


def minted(i: int, service: bool = False) -> dict:
    headers = {"Authorization": f"Bearer minted-token-{i:08d}"}
    return {**headers, "X-Service-Token": SERVICE} if service else headers


def client_from(address: str) -> httpx.Client:
    return httpx.Client(timeout=60, transport=httpx.HTTPTransport(local_address=address))


def outside_address() -> str:
    """A non-loopback IPv4 address of this machine (no packet is sent), or skip."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("203.0.113.1", 9))
            address = s.getsockname()[0]
    except OSError:
        address = ""
    if not address or address.startswith("127."):
        pytest.skip("this machine has no non-loopback IPv4 address to be another client from")
    return address


@pytest.mark.slow
def test_a_local_process_minting_tokens_leaves_other_local_clients_their_share(tmp_path):
    # every local process connects from loopback, and may pick 127.0.0.2, .3, ... as it likes:
    # an address quota there made one process's 4 controllers every local client's limit
    config = ServiceConfig(max_jobs_per_client=4, max_jobs_per_token=2,
                           max_datasets_per_client=2, new_tokens_per_minute=1000)
    srv = EmbeddedServer(tmp_path / "s.db", config=config).start()
    try:
        with client_from("127.0.0.1") as greedy, client_from("127.0.0.1") as job:
            codes = [greedy.post(f"{srv.url}/jobs/j{i}/control/config", json=CFG,
                                 headers=minted(i // 2)).status_code for i in range(6)]
            assert codes == [200] * 6, codes   # 3 tokens × max_jobs_per_token
            r = greedy.post(f"{srv.url}/jobs/j6/control/config", json=CFG, headers=minted(0))
            assert r.status_code == 429 and "max_jobs_per_token" in r.json()["error"], r.text
            for i in range(3):
                assert greedy.post(f"{srv.url}/datasets", headers=minted(i), json={
                    "name": f"d{i}", "num_samples": 10, "shard_size": 1}).status_code == 200
            r = job.post(f"{srv.url}/jobs/mine/control/config", json=CFG, headers=minted(99))
            assert r.status_code == 200, r.text
            r = job.post(f"{srv.url}/datasets", headers=minted(99),
                         json={"name": "mine", "num_samples": 10, "shard_size": 1})
            assert r.status_code == 200, r.text
    finally:
        srv.stop()


@pytest.mark.slow
def test_one_client_address_minting_tokens_cannot_take_every_slot(tmp_path):
    address = outside_address()
    config = ServiceConfig(max_jobs_per_client=4, max_jobs_per_token=2,
                           max_datasets_per_client=3, new_tokens_per_minute=1000,
                           new_tokens_per_client_per_minute=1000)
    srv = EmbeddedServer(tmp_path / "s.db", host="0.0.0.0", service_token=SERVICE,
                         config=config).start()
    url = f"http://{address}:{srv.port}"
    try:
        with client_from(address) as greedy, client_from("127.0.0.1") as job:
            codes = [greedy.post(f"{url}/jobs/j{i}/control/config", json=CFG,
                                 headers=minted(i, True)).status_code for i in range(5)]
            assert codes == [200, 200, 200, 200, 429], codes
            r = greedy.post(f"{url}/jobs/j9/control/config", json=CFG, headers=minted(9, True))
            assert r.json()["kind"] == "QuotaExceeded" and \
                "max_jobs_per_client" in r.json()["error"], r.text
            # another client's job still gets its controller
            r = job.post(f"{srv.url}/jobs/mine/control/config", json=CFG,
                         headers=minted(999, True))
            assert r.status_code == 200, r.text
            # a job's later incarnation is no new slot, even at the limit
            r = greedy.post(f"{url}/jobs/j0/control/config", json={**CFG, "incarnation": 1},
                            headers=minted(0, True))
            assert r.status_code == 200, r.text
            codes = [greedy.post(f"{url}/datasets", headers=minted(i, True), json={
                "name": f"d{i}", "num_samples": 10, "shard_size": 1}).status_code
                for i in range(5)]
            assert codes == [200, 200, 200, 429, 429], codes
            r = greedy.post(f"{url}/datasets/d9/restore", headers=minted(9, True),
                            content=b"{}")   # creating by restore counts too, before the body
            assert r.status_code == 429 and "max_datasets_per_client" in r.json()["error"]
        # the count survives a restart (it is stored with the data set)
        srv.stop()
        srv = EmbeddedServer(tmp_path / "s.db", host="0.0.0.0", service_token=SERVICE,
                             config=config).start()
        with client_from(address) as greedy:
            r = greedy.post(f"http://{address}:{srv.port}/datasets", headers=minted(50, True),
                            json={"name": "d50", "num_samples": 10, "shard_size": 1})
            assert r.status_code == 429, r.text
    finally:
        srv.stop()


@pytest.mark.slow
def test_new_tokens_are_rate_limited_per_client_and_in_all(tmp_path):
    address = outside_address()
    config = ServiceConfig(new_tokens_per_minute=4, new_tokens_per_client_per_minute=2)
    srv = EmbeddedServer(tmp_path / "s.db", host="0.0.0.0", service_token=SERVICE,
                         config=config).start()
    outside, local = f"http://{address}:{srv.port}", srv.url
    try:
        with client_from(address) as far, client_from("127.0.0.1") as near:
            def create(http, base, i, name=None):
                return http.post(f"{base}/datasets", headers=minted(i, True), json={
                    "name": name or f"d{i}", "num_samples": 10, "shard_size": 1})

            assert [create(far, outside, i).status_code for i in range(2)] == [200, 200]
            r = create(far, outside, 2)   # a third new token from that address this minute
            assert r.status_code == 429 and r.json()["kind"] == "RateLimited", r.text
            assert "client" in r.json()["error"] and int(r.headers["retry-after"]) >= 1
            # a token it minted already is no new one: it creates again at once
            assert create(far, outside, 0, "d0b").status_code == 200
            # loopback has no address bucket; the total (4 a minute) bounds it
            assert [create(near, local, i).status_code for i in (10, 11)] == [200, 200]
            r = create(near, local, 12)
            assert r.status_code == 429 and "in all" in r.json()["error"], r.text
            r = near.post(f"{local}/jobs/j/control/config", json=CFG, headers=minted(13, True))
            assert r.status_code == 429 and r.json()["kind"] == "RateLimited", r.text
            # a known token's controller is no new token either
            r = near.post(f"{local}/jobs/j/control/config", json=CFG, headers=minted(10, True))
            assert r.status_code == 200, r.text
        # the owners of stored data sets are known after a restart: no new tokens
        srv.stop()
        srv = EmbeddedServer(tmp_path / "s.db", host="0.0.0.0", service_token=SERVICE,
                             config=config.replace(new_tokens_per_minute=0.1)).start()
        with client_from("127.0.0.1") as near:
            r = near.post(f"{srv.url}/datasets", headers=minted(11, True), json={
                "name": "d11b", "num_samples": 10, "shard_size": 1})
            assert r.status_code == 200, r.text
    finally:
        srv.stop()
