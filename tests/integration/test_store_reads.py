"""The store's two kinds of read: :meth:`Database.read` (a transaction) and :meth:`Database.query` (statements
each a snapshot of its own: on Postgres in autocommit, without the ``BEGIN`` and ``COMMIT`` round trips; on SQLite a
read transaction), and that a connection :meth:`query` had goes back to the pool as every other."""

from __future__ import annotations

import os
from typing import Any

import sqlalchemy as sa

from plancache.store import Store
from tests.factories import H200, make_meta


def _in_transaction(conn: Any) -> bool:
    """Whether the database connection under ``conn`` has a transaction open (its driver's own state)."""
    dbapi = conn.connection.dbapi_connection
    if conn.dialect.name == "postgresql":
        from psycopg.pq import TransactionStatus

        return bool(dbapi.info.transaction_status != TransactionStatus.IDLE)
    return bool(dbapi.in_transaction)


def test_a_query_runs_outside_a_transaction_on_postgres_and_in_one_on_sqlite(store: Store) -> None:
    with store.db.query() as conn:
        assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
        assert _in_transaction(conn) == store.db.is_sqlite
    with store.db.read() as conn:
        conn.execute(sa.text("SELECT 1"))
        assert _in_transaction(conn)


def test_a_connection_a_query_had_serves_reads_and_writes_in_transactions_after_it(store: Store, make_spec: Any) -> None:
    store.db.engine.dispose()  # one connection in the pool from here on: the query's is the one used next
    with store.db.query() as conn:
        first = conn.connection.dbapi_connection
        conn.execute(sa.text("SELECT 1"))
    with store.db.read() as conn:
        assert conn.connection.dbapi_connection is first
        conn.execute(sa.text("SELECT 1"))
        assert _in_transaction(conn)
    blob = os.urandom(256)
    key, spec = make_spec(0)
    store.put_spec(key, spec)
    with store.db.write() as conn:
        assert conn.connection.dbapi_connection is first
    store.publish_plan(make_meta(key, H200, blob), blob)  # a write on that connection, committed
    versions = store.plan_versions(H200, [key])
    assert store.get_blobs({versions[key].blob_sha256}) == {versions[key].blob_sha256: blob}
    assert store.plan_records(H200, [key])[key][1].graph_key == key
