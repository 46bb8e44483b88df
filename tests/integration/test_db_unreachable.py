"""A Postgres that accepts TCP but never answers (a hung or partitioned host) must not hang requests for good."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from plancache.store import db
from plancache.store.db import make_engine

ROOT = Path(__file__).resolve().parents[2]


def test_connecting_to_a_silent_postgres_fails_within_the_connect_timeout():
    with socket.socket() as listener:  # the kernel completes handshakes; nothing ever answers the startup packet
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        engine = make_engine(f"postgresql://postgres@127.0.0.1:{listener.getsockname()[1]}/x")
        errors: list[BaseException] = []

        def connect() -> None:
            try:
                engine.connect().close()
            except BaseException as exc:  # noqa: BLE001 - handed to the test thread
                errors.append(exc)

        t = threading.Thread(target=connect, daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), "connecting to a silent Postgres still hangs after 30 s"
        assert len(errors) == 1 and isinstance(errors[0], sa.exc.OperationalError)
        engine.dispose()


def test_the_postgres_engine_sets_timeouts_and_keepalives_unless_the_url_does(monkeypatch: pytest.MonkeyPatch):
    seen: list[dict[str, object]] = []
    monkeypatch.setattr(sa, "create_engine", lambda url, **kwargs: seen.append(kwargs["connect_args"]))
    make_engine("postgresql://h/x")
    make_engine("postgresql://h/x?tcp_user_timeout=5000&keepalives=0")
    assert seen[0] == db.PG_CONNECT_ARGS and {"connect_timeout", "keepalives", "tcp_user_timeout"} <= seen[0].keys()
    assert seen[1] == {k: v for k, v in db.PG_CONNECT_ARGS.items() if k not in ("tcp_user_timeout", "keepalives")}


def _pump(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    for sock in (src, dst):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _forward(listener: socket.socket, connect: Callable[[], socket.socket]) -> None:
    """Join each connection ``listener`` accepts to a new ``connect()``, both ways, until ``listener`` closes."""
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        upstream = connect()
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()


def _unix_connection(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(path)
    return sock


def _partitioned_query(unix_path: str, url: str, when: str) -> None:
    """In a network namespace of its own: a pooled connection to Postgres over this namespace's loopback (joined
    to the outside through the Unix socket ``unix_path``), then a partition (the loopback down: every packet is
    lost) while the connection is idle in the pool or while its query runs. Prints the seconds the query took to
    fail and the error."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_forward, args=(listener, lambda: _unix_connection(unix_path)), daemon=True).start()
    db.PG_CONNECT_ARGS.update(keepalives_idle=1, keepalives_interval=1, tcp_user_timeout=2000)  # seconds, not minutes
    engine = make_engine(make_url(url).set(host="127.0.0.1", port=listener.getsockname()[1]))
    with engine.connect() as conn:
        conn.exec_driver_sql("SELECT 1")

    def partition() -> None:
        subprocess.run(["ip", "link", "set", "lo", "down"], check=True)

    start = time.monotonic()
    try:
        if when == "idle":  # the next request's first statement (the pool's pre-ping) goes into the void
            partition()
            start = time.monotonic()
            with engine.connect() as conn:
                conn.exec_driver_sql("SELECT 1")
        else:  # the query went out; its answer never comes, and the client has nothing more to send
            threading.Timer(0.5, partition).start()
            with engine.connect() as conn:
                conn.exec_driver_sql("SELECT pg_sleep(60)")
    except sa.exc.DBAPIError as exc:
        print(f"{time.monotonic() - start:.1f} {type(exc).__name__}")


def _can_make_network_namespaces() -> bool:
    try:
        return shutil.which("ip") is not None and subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0
    except OSError:
        return False


@pytest.mark.postgres
@pytest.mark.skipif(not _can_make_network_namespaces(), reason="needs `unshare -n` (root) and `ip`")
@pytest.mark.parametrize("when", ["idle", "waiting"])
def test_a_query_on_a_pooled_connection_to_a_partitioned_postgres_fails_within_the_bound(
        postgres_admin_url: str, tmp_path: Path, when: str):
    admin = make_url(postgres_admin_url)
    unix_path = str(tmp_path / "pg.sock")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(unix_path)
        listener.listen(8)
        threading.Thread(target=_forward, daemon=True, args=(
            listener, lambda: socket.create_connection((admin.host or "127.0.0.1", admin.port or 5432)))).start()
        try:
            done = subprocess.run(["unshare", "-n", sys.executable, "-m", __name__, unix_path, postgres_admin_url, when],
                                  cwd=ROOT, capture_output=True, text=True, timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"a query on a connection partitioned ({when}) still hangs after 20 s")
    said = done.stdout.split()
    assert done.returncode == 0 and len(said) == 2, done.stdout + done.stderr  # the child said how its query ended
    seconds, error = said
    assert error == "OperationalError" and float(seconds) < 8, done.stdout + done.stderr


if __name__ == "__main__":
    _partitioned_query(*sys.argv[1:])
