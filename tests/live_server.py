"""A real plancache server for tests: uvicorn on 127.0.0.1 in a background thread (configured as ``plancache
serve`` configures it), SQLite under ``tmp_path`` or the store it is given. The one way tests run a live server
in-process; :func:`free_port` is also for tests that start ``plancache serve`` itself.

::

    with LiveServer(tmp_path) as srv:
        httpx.get(f"{srv.url}/healthz")
        token = srv.token("reader")          # created once per role through the store
        srv.store.put_spec(key, spec)        # seed directly
        srv.delay = 2.0                      # every request now waits 2 s before it is handled
        srv.stop(); srv.start()              # down and back up on the same port
        srv.requests["/v1/plans/resolve"]    # HTTP requests received, by path

The runner's heap is frozen (:func:`gc.freeze`) while a server runs: the server shares the test process, and a full
collection of everything the suite's earlier tests left (millions of objects) stalled it for 4 s on a loaded CI
machine, which says nothing about the server. A server's own objects are still collected.

The helper owns the store (opened and migrated on construction, closed on exit) unless it is given one
(``store=``, e.g. the ``store`` fixture: any database and blob store), which it leaves open. The store
survives :meth:`LiveServer.stop`/:meth:`LiveServer.start`; a stopped server refuses connections.
Extra keyword arguments become :class:`~plancache.settings.Settings` fields.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from plancache.protocol import Role
from plancache.server import create_app
from plancache.server.serving import uvicorn_config
from plancache.settings import Settings
from plancache.store import open_store

_running = 0  # live servers started and not stopped: the runner's heap stays frozen while any runs
_running_lock = threading.Lock()


def _server_started() -> None:
    global _running
    with _running_lock:
        _running += 1
        if _running == 1:
            gc.freeze()


def _server_stopped() -> None:
    global _running
    with _running_lock:
        _running -= 1
        if _running == 0:
            gc.unfreeze()


def free_port() -> int:
    """A loopback port free at the time of the call."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LiveServer:
    """See the module docstring. ``delay`` (seconds, default 0) is slept before each HTTP request."""

    def __init__(self, tmp_path: Path, *, store: Any = None, admin_token: str = "admin-test-token",
                 open_reads: bool = False, lease_seconds: float = 120.0, start_timeout: float = 20.0,
                 **settings: Any) -> None:
        self.settings = Settings(database_url=f"sqlite:///{Path(tmp_path) / 'srv.db'}", admin_token=admin_token,
                                 open_reads=open_reads, lease_seconds=lease_seconds, **settings)
        self.admin_token = admin_token
        self._owns_store = store is None
        self.store = (open_store(self.settings.database_url, create=True, blob_store=self.settings.blob_store)
                      if store is None else store)
        self.app = create_app(self.settings, store=self.store)
        self.delay = 0.0
        self.requests: Counter[str] = Counter()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.start_timeout = start_timeout
        self._tokens: dict[str, str] = {}
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    async def _asgi(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.requests[scope["path"]] += 1
            if self.delay > 0:
                await asyncio.sleep(self.delay)
        await self.app(scope, receive, send)

    def start(self) -> None:
        """Serve on :attr:`port` and return once ``/healthz`` answers."""
        if self._thread is not None:
            raise RuntimeError("the server is already running")
        config = uvicorn_config(self._asgi, self.settings, host="127.0.0.1", port=self.port, log_level="warning",
                                access_log=False, lifespan="on", interface="asgi3", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)  # signal handlers are only installed on the main thread
        self._thread = threading.Thread(target=self._server.run, name=f"live-server-{self.port}", daemon=True)
        _server_started()
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                self._thread = None
                _server_stopped()
                raise RuntimeError(f"the server on port {self.port} exited during start-up")
            if self._server.started:
                try:
                    if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"the server on port {self.port} did not answer /healthz within {self.start_timeout} s")

    def stop(self) -> None:
        """Shut the server down (in-flight requests get about a second); the port then refuses connections."""
        if self._thread is None or self._server is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout=15)
        if self._thread.is_alive():
            raise RuntimeError(f"the server on port {self.port} did not stop")
        self._thread = None
        self._server = None
        _server_stopped()

    def token(self, role: Role) -> str:
        """A bearer token of ``role`` (created through the store on first use, then reused)."""
        if role not in self._tokens:
            self._tokens[role], _ = self.store.create_token(f"test-{role}", role)
        return self._tokens[role]

    def __enter__(self) -> LiveServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            if self._owns_store:
                self.store.close()
