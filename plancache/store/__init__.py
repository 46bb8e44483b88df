"""The persistence layer: specs, content-addressed blobs, plan records, misses, the job queue and API tokens,
on SQLite (embedded default) or Postgres (psycopg 3), blob bytes in the database or a folder (:mod:`.blobs`).
:class:`Store` is the one facade the server uses::

    store = open_store("sqlite:///./plancache.db", create=True)
    store.put_spec(key, spec); job, created = store.enqueue(key, TargetEnvironment(sm=90))
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from sqlalchemy.engine import Engine

from ..protocol import TokenInfo
from ..settings import StoreSettings
from .blobs import check_blob_store, open_blob_store
from .content import SpecsAndBlobs
from .db import Database, analyze
from .explain import Explanations
from .fleet import Fleet
from .jobs import Jobs
from .plans import Plans
from .tokens import Tokens

__all__ = ["Store", "TokenInfo", "open_store"]


class Store(SpecsAndBlobs, Plans, Jobs, Tokens, Explanations, Fleet):
    """All store operations over one database. Thread-safe: each call runs in its own transaction.

    ``clock`` returns the current time (timezone-aware) for every timestamp and lease; tests inject one. Without it,
    leases and the other times written in a job or publish transaction are the database's clock
    (:meth:`~.db.Database.now`), so replicas with skewed clocks agree on them.
    ``job_max_attempts`` and ``blob_store`` (a ``PLANCACHE_BLOB_STORE`` value) default to their settings.
    """

    def __init__(self, url: str, *, clock: Callable[[], datetime] | None = None, job_max_attempts: int | None = None,
                 blob_store: str | None = None) -> None:
        if blob_store is None or job_max_attempts is None:
            settings = StoreSettings()
            blob_store = settings.blob_store if blob_store is None else blob_store
            job_max_attempts = settings.job_max_attempts if job_max_attempts is None else job_max_attempts
        self.blob_store = open_blob_store(blob_store)
        self.db = Database(url, clock=clock)
        self.job_max_attempts = job_max_attempts

    @property
    def engine(self) -> Engine:
        return self.db.engine

    def upgrade(self) -> None:
        """Apply the Alembic migrations up to head."""
        self.db.upgrade()

    def analyze(self) -> None:
        """Refresh the planner's table statistics (after a bulk change: :func:`~.db.analyze`)."""
        with self.db.write() as conn:
            analyze(conn)

    def ping(self) -> None:
        """Raise if the database is unreachable (for ``/readyz``)."""
        self.db.ping()

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_store(url: str, *, create: bool = False, clock: Callable[[], datetime] | None = None,
               job_max_attempts: int | None = None, blob_store: str | None = None, check_blobs: bool = True) -> Store:
    """Open the store at ``url``. ``create`` migrates the schema to head; otherwise the schema must
    already be at head (:class:`~plancache.errors.SchemaNotReady` says to run ``plancache db upgrade``).
    ``check_blobs`` refuses a blob store that does not hold the database's blobs
    (:class:`~plancache.errors.BlobStoreMismatch`)."""
    store = Store(url, clock=clock, job_max_attempts=job_max_attempts, blob_store=blob_store)
    try:
        if create:
            store.upgrade()
        else:
            store.db.require_schema()
        if check_blobs:
            check_blob_store(store.db, store.blob_store)
    except BaseException:
        store.close()
        raise
    return store
