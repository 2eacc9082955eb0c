"""What one client may create, whatever tokens it mints: without a service token anyone on the
machine may create, and the per-token quotas alone let one client take every controller and
data set slot by minting a token per 16 controllers. Each client address has a quota too."""

from __future__ import annotations

import httpx

from stragglers.adapt.service import EmbeddedServer, ServiceConfig

CFG = {"policy": "nd", "world_size": 2, "global_batch": 64}


def minted(i: int) -> dict:
    return {"Authorization": f"Bearer minted-token-{i:08d}"}


def client_from(address: str) -> httpx.Client:
    return httpx.Client(timeout=60, transport=httpx.HTTPTransport(local_address=address))


def test_one_client_minting_tokens_cannot_take_every_controller_slot(tmp_path):
    srv = EmbeddedServer(tmp_path / "s.db").start()   # no service token, default quotas
    try:
        with client_from("127.0.0.1") as greedy, client_from("127.0.0.2") as job:
            made = 0
            for i in range(300):
                r = greedy.post(f"{srv.url}/jobs/j{i}/control/config", json=CFG,
                                headers=minted(i))
                if r.status_code != 200:
                    break
                made += 1
            assert made == 256, made     # max_jobs_per_client: a quarter of the 1,024 slots
            assert r.status_code == 429 and r.json()["kind"] == "QuotaExceeded", r.text
            assert "max_jobs_per_client" in r.json()["error"]
            # another client's job still gets its controller
            r = job.post(f"{srv.url}/jobs/mine/control/config", json=CFG, headers=minted(999))
            assert r.status_code == 200, r.text
            # a job's later incarnation is no new slot, even at the limit
            r = greedy.post(f"{srv.url}/jobs/j0/control/config",
                            json={**CFG, "incarnation": 1}, headers=minted(0))
            assert r.status_code == 200, r.text
    finally:
        srv.stop()


def test_one_client_minting_tokens_cannot_take_every_data_set_slot(tmp_path):
    config = ServiceConfig(max_datasets_per_client=3)
    srv = EmbeddedServer(tmp_path / "s.db", config=config).start()
    try:
        with client_from("127.0.0.1") as greedy, client_from("127.0.0.2") as job:
            codes = [greedy.post(f"{srv.url}/datasets", headers=minted(i),
                                 json={"name": f"d{i}", "num_samples": 10, "shard_size": 1}
                                 ).status_code for i in range(5)]
            assert codes == [200, 200, 200, 429, 429], codes
            r = greedy.post(f"{srv.url}/datasets/d9/restore", headers=minted(9),
                            content=b"{}")   # creating by restore counts too, before the body
            assert r.status_code == 429 and "max_datasets_per_client" in r.json()["error"]
            r = job.post(f"{srv.url}/datasets", headers=minted(99),
                         json={"name": "mine", "num_samples": 10, "shard_size": 1})
            assert r.status_code == 200, r.text
        # the count survives a restart (it is stored with the data set)
        srv.stop()
        srv = EmbeddedServer(tmp_path / "s.db", config=config).start()
        with client_from("127.0.0.1") as greedy:
            r = greedy.post(f"{srv.url}/datasets", headers=minted(50),
                            json={"name": "d50", "num_samples": 10, "shard_size": 1})
            assert r.status_code == 429, r.text
    finally:
        srv.stop()
