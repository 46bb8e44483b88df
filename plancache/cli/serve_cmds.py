"""``plancache serve``: bind the port, migrate the configured database to head, then serve the HTTP API with
uvicorn. The ``listening on`` line is printed once the server accepts requests on a migrated database, so a
script may wait for it (or for ``/readyz``) before it uses the server or the database."""

from __future__ import annotations

import contextlib
import enum
import errno
import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from .. import logs
from ..settings import ServerSettings
from .database import open_database
from .failures import ExitCode, Failure, command, database_place
from .options import database_url_option


class LogLevel(enum.StrEnum):
    """uvicorn's log levels."""

    critical = "critical"
    error = "error"
    warning = "warning"
    info = "info"
    debug = "debug"
    trace = "trace"


#: uvicorn's default listen backlog.
BACKLOG = 2048


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` (as uvicorn would bind it); a busy or unusable address is a failure.
    Connections wait in its backlog until the server has started."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise Failure(f"cannot listen on {host}:{port}: the address is already in use",
                          "stop the process that holds it (another plancache serve?) or choose another --port",
                          ExitCode.OS_ERROR) from None
        raise Failure(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                      "give --host an address of this machine (127.0.0.1, 0.0.0.0, ::) and --port a free port "
                      "(below 1024 needs privileges)", ExitCode.OS_ERROR) from None
    return sock


def _announcing_server(config: Any, announce: Callable[[], None]) -> Any:
    """A uvicorn server that calls ``announce`` once it has started (app started, socket listening)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started and not self.should_exit:
                announce()

    return Server(config)


def _report_blob_store(store: Any) -> None:
    """Say on stderr what is wrong with the blob store, if anything (:func:`~plancache.store.blobs.probe_blob_store`):
    after start-up, so that a server started while its bucket is unreachable serves what needs no blob meanwhile."""
    from ..store.blobs import probe_blob_store

    problem = probe_blob_store(store.db, store.blob_store)
    if problem:
        typer.echo(f"warning: {problem}; serving what needs no blob (records-only resolves, health, admin routes), "
                   "blob reads answer 503 with Retry-After until it is fixed", err=True)


@command
def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on"),
    port: int = typer.Option(8787, "--port", min=1, max=65535, help="TCP port"),
    database_url: str | None = database_url_option(),
    log_level: LogLevel = typer.Option(LogLevel.info, "--log-level",
                                       help="least severe log lines printed (uvicorn's and plancache's); 'warning' "
                                            "leaves out the access log"),
) -> None:
    """Serve the plancache API (OpenAPI at /docs). Configuration: PLANCACHE_* environment variables."""
    settings = ServerSettings()
    if database_url is not None:
        settings = settings.model_copy(update={"database_url": database_url})
    created = claim_sqlite_file(settings.database_url)
    try:
        _serve(settings, host, port, log_level)
    finally:
        if created is not None and created.is_file() and created.stat().st_size == 0:
            created.unlink()  # stopped before it migrated: leave no empty database behind


def claim_sqlite_file(url: str) -> Path | None:
    """Create a SQLite database file that is not there yet, empty, before anything slow, so that a store command
    started with this serve (``plancache serve & plancache token create``) waits for the schema it applies instead
    of saying there is no database. The file when created here."""
    place = database_place(url)[1]
    if place is None or os.path.exists(place):
        return None
    try:
        with open(place, "xb"):
            pass
    except OSError:  # no such folder yet, or another process made it: open_database creates or reports
        return None
    return Path(place)


def _serve(settings: ServerSettings, host: str, port: int, log_level: LogLevel) -> None:
    # the server extra (FastAPI, uvicorn, SQLAlchemy): without it, MISSING_EXTRA, before anything is touched
    import uvicorn  # noqa: F401

    from ..server import create_app
    from ..server.serving import uvicorn_config

    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    sock = _listen(host, port)
    try:
        with open_database(settings.database_url, create=True, settings=settings) as store:
            try:
                app = create_app(settings, store=store)
            except ValueError as exc:  # a limit out of range: the message names its variable
                raise Failure(str(exc), "fix or unset that variable (docs/CONFIGURATION.md)", ExitCode.CONFIG) from None
            where = store.db.url.render_as_string(hide_password=True)
            revision = store.db.current_revision()

            def announce() -> None:
                typer.echo(f"{where}: schema at revision {revision}; listening on {url}", err=True)
                threading.Thread(target=_report_blob_store, args=(store,), name="blob-store-probe", daemon=True).start()

            logging.getLogger("plancache").setLevel(log_level.value.upper().replace("TRACE", "DEBUG"))
            log_config = logs.uvicorn_log_config(settings.log_format)
            options = {} if log_config is None else {"log_config": log_config}
            config = uvicorn_config(app, settings, host=host, port=port, log_level=log_level.value, **options)
            server = _announcing_server(config, announce)
            with contextlib.suppress(KeyboardInterrupt):  # Ctrl+C: uvicorn has shut down cleanly, then re-raised it
                server.run(sockets=[sock])
    finally:
        sock.close()


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
