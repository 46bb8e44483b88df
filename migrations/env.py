"""Alembic environment for plancache.

Run programmatically by :meth:`plancache.store.db.Database.upgrade` (``plancache db upgrade``), which
passes an open connection in ``config.attributes["connection"]``. Run from the command line
(``alembic -c alembic.ini …`` at the repository root) it connects to ``PLANCACHE_DATABASE_URL``.
"""

from __future__ import annotations

from typing import Any

from alembic import context

from plancache.settings import StoreSettings
from plancache.store.db import Database
from plancache.store.models import UTCDateTime, metadata

config = context.config


def _render_item(type_: str, obj: Any, autogen_context: Any) -> str | bool:
    """Render the store's own column types as plain SQLAlchemy types, so migrations never import models."""
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def _run(connection: Any) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        compare_type=True,
        compare_server_default=True,
        render_as_batch=connection.dialect.name == "sqlite",
        render_item=_render_item,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    db = Database(config.get_main_option("sqlalchemy.url") or StoreSettings().database_url)
    try:
        with db.migrating() as conn:
            _run(conn)
    finally:
        db.close()


if context.is_offline_mode():
    raise SystemExit("plancache migrations run online only (they need a connection)")
run_migrations_online()
