"""A Postgres that accepts TCP but never answers (a hung or partitioned host) must not hang requests for good."""

from __future__ import annotations

import socket
import threading

import sqlalchemy as sa

from plancache.store.db import make_engine


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
