"""Putting the monitor together: store, ingest, watchers and the HTTP app under uvicorn."""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

from stragglers.errors import InputError
from stragglers.monitor.alerts import parse_rules, parse_webhooks
from stragglers.monitor.settings import MonitorConfig, load_config_file
from stragglers.serving import ConnectionLimits, base_url, is_loopback, listen_socket, serve_in_foreground, \
    serve_in_thread, uvicorn_server

log = logging.getLogger(__name__)


class MonitorServer:
    """The whole service; `start()` serves on a thread, `run()` in the foreground."""

    def __init__(self, db: Path | str, watch: list[Path] | tuple[Path, ...] = (), host: str = "127.0.0.1",
                 port: int = 8150, token: str | None = None, private: bool = False,
                 config_file: Path | None = None, data_dir: Path | None = None,
                 config: MonitorConfig | None = None, defaults: dict | None = None):
        from stragglers.monitor.app import create_app
        from stragglers.monitor.ingest_files import DirectoryWatcher
        from stragglers.monitor.service import Monitor
        from stragglers.monitor.store import is_postgres_url, open_store

        if not is_postgres_url(db):
            db = Path(db)
            if db.is_dir():
                raise InputError(db, None, "expected a SQLite file or a postgresql:// URL, got "
                                 "a directory")
            if not db.parent.is_dir():
                raise InputError(db, None, f"directory {db.parent} does not exist")
        if private and token is None:
            raise InputError("--private", None, "needs --token-file (reads are guarded by it)")
        if token is None and not is_loopback(host):
            raise InputError("--host", None, f"{host} is reachable from other machines; serving "
                             "there needs --token-file (every write is guarded by it)")
        raw = load_config_file(config_file)
        source = config_file or "config"
        settings = raw.get("settings")
        if settings is not None and not isinstance(settings, dict):
            raise InputError(source, "settings", "expected a mapping of the monitor's settings")
        if defaults:
            settings = {**defaults, **(settings or {})}  # the file's settings win
        cfg = config or MonitorConfig.from_mapping(settings, source)
        rules = parse_rules(raw.get("rules"), source)
        urls = parse_webhooks(raw.get("webhooks"), source)
        self.host, self.port = host, int(port)
        if not 0 <= self.port <= 65535:
            raise InputError("--port", None, f"expected 0..65535, got {port}")
        self.sock = listen_socket(host, self.port)
        self.port = self.sock.getsockname()[1]
        external = str(raw.get("external_url") or self.url)
        try:
            self.store = open_store(db, durable=cfg.durable)
        except BaseException:
            self.sock.close()
            raise
        monitor = watcher = None
        try:
            self.store.serve_alone()
            self.monitor = monitor = Monitor(self.store, cfg, rules, urls, data_dir, external,
                                             str(raw.get("receiver") or "stragglers"))
            self.watcher = watcher = DirectoryWatcher(monitor, list(watch)) if watch else None
            self.app = create_app(monitor, token, private)
        except BaseException:   # (refused: the store, its claim and the port are given up; a
            self._give_up(monitor, watcher)   # watch folder refused left them held, round 18)
            raise
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL of the service."""
        return base_url(self.host, self.port)

    def _uvicorn(self):
        cfg = self.monitor.config
        limits = ConnectionLimits(max_connections=cfg.max_connections,
                                  per_client=min(cfg.max_connections_per_client,
                                                 cfg.max_connections),
                                  header_timeout_s=cfg.header_timeout_s,
                                  body_min_bytes_per_s=cfg.body_min_bytes_per_s)
        hosts = [h for h in cfg.allowed_hosts.split(",") if h.strip()]
        return uvicorn_server(self.app, max_connections=cfg.max_connections,
                              keep_alive_s=cfg.keep_alive_s, graceful_s=5, limits=limits,
                              allowed_hosts=hosts or None, gate_bodies=True)

    def _give_up(self, monitor, watcher, app=None) -> None:
        """A start refused: what was begun is stopped, the store and the port are closed."""
        try:
            if app is not None:
                app.state.readers.shutdown(wait=False)
            if watcher is not None:
                watcher.stop()
            if monitor is not None:
                monitor.stop()
        finally:
            self.store.close()
            self.sock.close()

    def _begin(self) -> None:
        try:
            self._start_parts()
        except BaseException:   # (the monitor's threads, the store and the port: not left)
            self._give_up(self.monitor, self.watcher, self.app)
            raise
        self._server = self._uvicorn()

    def _start_parts(self) -> None:
        try:
            self.monitor.start()
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.OperationalError):
                raise
            # a damaged page of the store (torn write, bad sector) read at the start
            path = getattr(self.monitor.store, "path", "the monitor's store")
            raise InputError(path, None, f"cannot be read ({exc}): the store is damaged; "
                             "restore it from a backup, or move it aside to start a new one"
                             ) from None
        if self.watcher is not None:
            self.watcher.start()

    def run(self) -> None:
        """Serve until interrupted."""
        self._begin()
        try:
            serve_in_foreground(self._server, self.sock)   # SIGTERM too ends in _end()
        finally:
            self._end()

    def start(self, timeout: float = 60.0) -> "MonitorServer":
        """Serve on a daemon thread; returns once requests are answered."""
        self._begin()
        self._thread = serve_in_thread(self._server, self.sock, "stragglers-monitor-http",
                                       f"the monitor on {self.url}", timeout)
        return self

    def stop(self) -> None:
        """Stop serving and the threads behind it."""
        self.app.state.change_feed.close()  # open event streams end, so shutdown need not wait
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)
        self._end()

    def _end(self) -> None:
        self.app.state.readers.shutdown(wait=False)   # (their connections close with them)
        if self.watcher is not None:
            self.watcher.stop()
        self.monitor.stop()
        self.store.close()


