"""The data-sharding service: a FastAPI app over ShardStore, plus the control plane (monitor/controller).

Run standalone with `stragglers shard-server --db FILE`, or embedded in rank 0 with
`EmbeddedServer(db).start()` (a uvicorn server on a daemon thread).
"""

from __future__ import annotations

import asyncio
import queue
import socket
import threading
import time
from dataclasses import asdict
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from stragglers.adapt.controller import ControlConfig, Controller
from stragglers.adapt.shards import DatasetConfig, LeaseLost, ShardStore
from stragglers.errors import InputError, StragglersError


class ControlPlane:
    """Holds the job's Controller; agents post step records and poll actions (in memory)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.controller: Controller | None = None

    def configure(self, body: dict) -> dict:
        """(Re)start the controller for a new job incarnation."""
        try:
            cfg = ControlConfig(**body)
        except TypeError as exc:
            raise InputError("control config", None, str(exc)) from exc
        with self._lock:
            self.controller = Controller(cfg)
        return {"ok": True}

    def report(self, body: dict) -> dict:
        """Feed step records [[step, bpt, batch], ...] of one rank; reply with actions >= since."""
        with self._lock:
            ctl = self._need()
            try:
                rank, device = int(body["rank"]), str(body.get("device", ""))
                since = max(0, int(body.get("since", 0)))
                if body.get("incarnation", ctl.config.incarnation) == ctl.config.incarnation:
                    for step, bpt, batch in body["records"]:
                        ctl.observe(rank, int(step), float(bpt), int(batch), device)
            except (KeyError, TypeError, ValueError) as exc:
                raise InputError("control report", None, f"expected rank and records ({exc})") from exc
            return {"incarnation": ctl.config.incarnation,
                    "actions": [asdict(a) for a in ctl.actions[since:]]}

    def actions(self, since: int) -> dict:
        """Every action with seq >= since."""
        with self._lock:
            ctl = self._need()
            return {"incarnation": ctl.config.incarnation,
                    "actions": [asdict(a) for a in ctl.actions[since:]]}

    def state(self) -> dict:
        """The controller's view (config, classes, batch sizes, actions)."""
        with self._lock:
            return self._need().state()

    def _need(self) -> Controller:
        if self.controller is None:
            raise InputError("control plane", "config", "no job configured (POST /control/config first)")
        return self.controller


class GroupCommitter:
    """Runs store calls on one writer thread, committing everything queued meanwhile at once.

    While a commit waits for fsync, the event loop keeps parsing requests; the next batch then
    shares one fsync. Each call still sees a consistent state (savepoints, see run_batch).
    """

    def __init__(self, store: ShardStore, max_batch: int = 256):
        self.store, self.max_batch = store, max_batch
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.batches = self.calls = 0
        threading.Thread(target=self._loop, name="group-commit", daemon=True).start()

    async def run(self, call):
        """Queue `call` (no arguments) and wait until its transaction is durable."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((call, future, loop))
        return await future

    def _loop(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < self.max_batch:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            results = self.store.run_batch([call for call, _, _ in batch])
            self.batches += 1
            self.calls += len(batch)
            for (_, future, loop), (ok, value) in zip(batch, results):
                loop.call_soon_threadsafe(_settle, future, ok, value)


def _settle(future: asyncio.Future, ok: bool, value) -> None:
    if not future.done():
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)


def create_app(store: ShardStore) -> FastAPI:
    """The HTTP API; see README.md for the protocol."""
    app = FastAPI(title="stragglers shard service")
    control = ControlPlane()
    commit = GroupCommitter(store)

    @app.exception_handler(StragglersError)
    async def _user_error(request: Request, exc: StragglersError):
        code = 409 if isinstance(exc, LeaseLost) else 400
        return JSONResponse({"error": str(exc), "kind": type(exc).__name__}, status_code=code)

    async def _json(request: Request) -> dict:
        try:
            body = await request.json()
        except ValueError as exc:
            raise InputError("request body", None, f"expected JSON ({exc})") from exc
        if not isinstance(body, dict):
            raise InputError("request body", None, "expected a JSON object")
        return body

    def _field(body: dict, name: str, typ=str):
        if name not in body:
            raise InputError("request body", name, "missing")
        try:
            return typ(body[name])
        except (TypeError, ValueError) as exc:
            raise InputError("request body", name, f"expected {typ.__name__}") from exc

    @app.get("/health")
    async def health():
        return {"ok": True, "db": store.db, "commit_batches": commit.batches,
                "commit_calls": commit.calls}

    @app.post("/datasets")
    async def create_dataset(request: Request):
        body = await _json(request)
        try:
            cfg = DatasetConfig(**body)
        except TypeError as exc:
            raise InputError("request body", None, f"bad data set config ({exc})") from exc
        return await commit.run(lambda: store.create_dataset(cfg))

    @app.post("/datasets/{name}/lease")
    async def lease(name: str, request: Request):
        body = await _json(request)
        worker, count = _field(body, "worker"), _field(body, "count", int) if "count" in body else 1
        if count == 1:
            # JSONResponse directly: FastAPI's generic encoder walks every index otherwise.
            return JSONResponse(await commit.run(lambda: store.lease(name, worker)))
        if not 1 <= count <= 256:
            raise InputError("request body", "count", f"expected 1..256 shards, got {count}")
        # Several shards for one worker (prefetch): queued together, so usually one commit.
        replies = await asyncio.gather(*[commit.run(lambda: store.lease(name, worker))
                                         for _ in range(count)])
        leases = [r["lease"] for r in replies if r["status"] == "ok"]
        status = "ok" if leases else replies[-1]["status"]
        return JSONResponse({"status": status, "leases": leases, "failed": replies[-1]["failed"]})

    @app.post("/datasets/{name}/ack")
    async def ack(name: str, request: Request):
        b = await _json(request)
        args = (_field(b, "worker"), _field(b, "epoch", int), _field(b, "shard", int),
                _field(b, "consumed", int))
        return JSONResponse(await commit.run(lambda: store.ack(name, *args)))

    @app.post("/datasets/{name}/release")
    async def release(name: str, request: Request):
        b = await _json(request)
        args = (_field(b, "worker"), bool(b.get("failure", True)), b.get("error"))
        return await commit.run(lambda: store.release(name, *args))

    @app.post("/datasets/{name}/retry-failed")
    async def retry_failed(name: str):
        return await commit.run(lambda: store.retry_failed(name))

    @app.get("/datasets/{name}/status")
    async def status(name: str):
        return await commit.run(lambda: store.status(name))

    @app.get("/datasets/{name}/snapshot")
    async def snapshot(name: str):
        return await commit.run(lambda: store.snapshot(name))

    @app.post("/datasets/{name}/restore")
    async def restore(name: str, request: Request):
        snap = await _json(request)
        if snap.get("dataset", {}).get("name") != name:
            raise InputError("snapshot", "dataset.name", f"expected '{name}'")
        return await commit.run(lambda: store.restore(snap))

    @app.post("/control/config")
    async def control_config(request: Request):
        return control.configure(await _json(request))

    @app.post("/control/report")
    async def control_report(request: Request):
        return control.report(await _json(request))

    @app.get("/control/actions")
    async def control_actions(since: int = 0):
        return control.actions(max(0, since))

    @app.get("/control/state")
    async def control_state():
        return control.state()

    return app


def _uvicorn_server(store: ShardStore):
    import uvicorn

    config = uvicorn.Config(create_app(store), log_level="warning", access_log=False,
                            lifespan="off", timeout_keep_alive=60)
    return uvicorn.Server(config)


def serve(db: str | Path, host: str = "127.0.0.1", port: int = 8151, durable: bool = True) -> None:
    """Run the service in the foreground until interrupted."""
    store = ShardStore(db, durable=durable)
    sock = _bind(host, port)
    try:
        _uvicorn_server(store).run(sockets=[sock])
    finally:
        store.close()


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Linux copies TCP_NODELAY to accepted sockets; without it Nagle + delayed ACK add ~40 ms
    # to every keep-alive request whose response uvicorn writes in two pieces.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise InputError(f"{host}:{port}", "port", f"cannot listen there ({exc.strerror})") from exc
    sock.listen(1024)
    return sock


class EmbeddedServer:
    """The service on a daemon thread of this process (rank 0 in embedded mode)."""

    def __init__(self, db: str | Path, host: str = "127.0.0.1", port: int = 0, durable: bool = True):
        self.db, self.host, self.port, self.durable = db, host, port, durable
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL of the running server."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "EmbeddedServer":
        """Bind (port 0 picks a free one), start serving, return once requests are answered."""
        store = ShardStore(self.db, durable=self.durable)
        sock = _bind(self.host, self.port)
        self.port = sock.getsockname()[1]
        self._server = _uvicorn_server(store)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="shard-service", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise StragglersError(f"shard service on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Ask uvicorn to exit and wait for the thread."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
