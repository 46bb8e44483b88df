"""Engine construction (SQLite pragmas, Postgres via psycopg 3), transactions, and Alembic migrations."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.selectable import Alias
from sqlalchemy.sql.visitors import InternalTraversal

from ..errors import InvalidValue, SchemaNotReady, SchemaTooNew
from ..validation import INT32_MAX, INT64_MAX
from .models import schema_compatibility

log = logging.getLogger("plancache.store")

Clock = Callable[[], datetime]

SQLITE_BUSY_TIMEOUT_MS = 30_000
#: The longest SQLite's busy handler sleeps between two tries for a lock is 100 ms: a writer that leaves the write
#: lock free this long between two transactions lets every writer waiting for it in.
SQLITE_WRITER_GAP_S = 0.12
# Any constant: serialises concurrent ``upgrade()`` calls against one Postgres database.
_PG_MIGRATION_LOCK = 0x706C616E



def check_int(name: str, value: int, maximum: int = INT32_MAX, minimum: int | None = None) -> int:
    """``value`` if it fits the column (``minimum`` defaults to ``-maximum - 1``), else :class:`InvalidValue`."""
    low = -maximum - 1 if minimum is None else minimum
    if not low <= value <= maximum:
        raise InvalidValue(f"{name} = {value} is out of range [{low}, {maximum}]")
    return value


def migrations_dir() -> Path:
    """The Alembic environment: ``migrations/`` of a checkout (editable install), else the copy a wheel
    installs under ``<prefix>/share/plancache/migrations``."""
    candidates = (Path(__file__).resolve().parents[2] / "migrations", Path(sys.prefix) / "share" / "plancache" / "migrations")
    for candidate in candidates:
        if (candidate / "env.py").is_file():
            return candidate
    raise SchemaNotReady(f"the plancache migrations are not installed (looked in {', '.join(map(str, candidates))})")


def utcnow() -> datetime:
    return datetime.now(UTC)


def database_now(conn: Connection) -> datetime:
    """The database server's current time (UTC, timezone-aware), read on ``conn``."""
    if conn.dialect.name == "postgresql":
        value: datetime = conn.execute(sa.text("SELECT clock_timestamp()")).scalar_one()
        return value.astimezone(UTC)
    # SQLite computes 'now' itself (millisecond resolution), from the clock of the host that has the file open.
    text = conn.exec_driver_sql("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')").scalar_one()
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=UTC)


#: libpq settings of every Postgres connection, each unless the URL sets it (``?connect_timeout=5``). Without them a
#: silent peer (a hung host, a partition) hangs a request for good, or for the kernel's ~15 min of retransmissions,
#: instead of its 503 database_unavailable: ``connect_timeout`` (s) bounds a new connection; on an established one,
#: ``tcp_user_timeout`` (ms; libpq 12+) aborts when sent data (a query, a keepalive probe) stays unacknowledged
#: that long, and the keepalives (s) probe a connection that waits for an answer, so a peer gone while the query
#: runs is noticed after ``keepalives_idle`` + ``tcp_user_timeout``. A live peer acknowledges both, however long
#: its query runs. No bound on a peer that acknowledges but never answers (a stuck backend or proxy): the server's
#: ``statement_timeout`` is for that (see docs/DEPLOYMENT.md).
PG_CONNECT_ARGS: dict[str, int] = {"connect_timeout": 10, "keepalives": 1, "keepalives_idle": 30,
                                   "keepalives_interval": 10, "keepalives_count": 3, "tcp_user_timeout": 30_000}


def normalize_url(url: str | URL) -> URL:
    """Parse a database URL; ``postgres://`` and ``postgresql://`` mean psycopg 3. Only SQLite files and Postgres."""
    u = make_url(url)
    backend = u.get_backend_name()
    if backend in ("postgres", "postgresql"):
        return u.set(drivername="postgresql+psycopg")
    if backend == "sqlite":
        if u.database in (None, "", ":memory:") or (u.database or "").startswith("file::memory:"):
            raise ValueError("an in-memory SQLite database cannot be shared between connections; use a file, e.g. sqlite:///./plancache.db")
        return u.set(drivername="sqlite+pysqlite")
    raise ValueError(f"unsupported database URL {u.render_as_string(hide_password=True)!r}: use sqlite:///PATH or postgresql+psycopg://…")


def _sqlite_on_connect(dbapi_conn: Any, _record: Any) -> None:
    # Let SQLAlchemy's "begin" hook (below) emit BEGIN itself, so write transactions can be IMMEDIATE.
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
    _enable_wal(cur)
    cur.execute("PRAGMA synchronous = NORMAL")
    cur.execute("PRAGMA foreign_keys = ON")
    cur.close()


def _enable_wal(cur: Any) -> None:
    """Switch to WAL (persistent, so usually already on). Changing the journal mode needs an exclusive lock
    and SQLite does not wait for it through the busy timeout, so a fresh database opened by several
    connections at once retries here instead of failing with "database is locked"."""
    if str(cur.execute("PRAGMA journal_mode").fetchone()[0]).lower() == "wal":
        return
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            cur.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _sqlite_on_begin(conn: Connection) -> None:
    # A write transaction takes the write lock up front: a deferred one that upgrades later can fail
    # with SQLITE_BUSY without waiting. Reads stay deferred so they never block behind writers (WAL).
    conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("plancache_write") else "BEGIN")


def make_engine(url: str | URL) -> Engine:
    """An engine with a thread-friendly pool; SQLite gets WAL, a busy timeout and foreign keys."""
    u = normalize_url(url)
    if u.get_backend_name() == "sqlite":
        engine = sa.create_engine(
            u, pool_size=16, max_overflow=16, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000, "check_same_thread": False}
        )
        sa.event.listen(engine, "connect", _sqlite_on_connect)
        sa.event.listen(engine, "begin", _sqlite_on_begin)
        return engine
    connect_args = {key: value for key, value in PG_CONNECT_ARGS.items() if key not in u.query}
    return sa.create_engine(u, pool_size=16, max_overflow=16, pool_pre_ping=True, pool_recycle=1800,
                            connect_args=connect_args)


def lock_against_writers(conn: Connection, table: sa.Table) -> None:
    """Postgres: wait for transactions writing ``table`` and hold off new ones until commit (reads go on).
    SQLite needs nothing: a write transaction already excludes every other writer."""
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text(f"LOCK TABLE {table.name} IN SHARE ROW EXCLUSIVE MODE"))


def _check_foreign_keys(conn: Connection) -> None:
    """SQLite: raise :class:`sqlalchemy.exc.IntegrityError` if a row references a row that does not exist."""
    bad = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
    if bad:
        table, rowid, parent, _ = bad[0]
        raise sa.exc.IntegrityError("PRAGMA foreign_key_check", None, sqlite3.IntegrityError(
            f"FOREIGN KEY constraint failed: {len(bad)} rows reference missing rows "
            f"(the first: {table} row {rowid}, in {parent})"))


#: SQLite's ANALYZE samples about this many rows of each index (``PRAGMA analysis_limit``): statistics of a large
#: store in milliseconds instead of a read of every index.
SQLITE_ANALYSIS_LIMIT = 1000


def analyze(conn: Connection) -> None:
    """Refresh the planner's statistics of every table, in the caller's transaction: after migrations and bulk
    changes. The statements whose cost must stay flat in a store's size do not depend on them (:func:`indexed_alias`,
    :func:`~.environments.by_keys`); the others do, and Postgres' autovacuum, which may be off, keeps them between."""
    if conn.dialect.name == "sqlite":
        conn.exec_driver_sql(f"PRAGMA analysis_limit = {SQLITE_ANALYSIS_LIMIT}")
    conn.exec_driver_sql("ANALYZE")


class IndexedAlias(Alias):
    """An alias of a table that SQLite reads through one index (``INDEXED BY``), whatever its statistics say; other
    dialects render a plain alias. Made by :func:`indexed_alias`."""

    inherit_cache = True
    index: str
    # the index is part of a statement's cache key: two statements that differ only there compile apart
    _traverse_internals = [*Alias._traverse_internals, ("index", InternalTraversal.dp_string)]


def indexed_alias(table: sa.Table, name: str, index: str) -> IndexedAlias:
    alias = IndexedAlias._construct(table, name=name)
    alias.index = index
    return alias


@compiles(IndexedAlias, "sqlite")
def _indexed_by(element: IndexedAlias, compiler: Any, **kw: Any) -> str:
    text: str = compiler.visit_alias(element, **kw)
    return f"{text} INDEXED BY {element.index}" if kw.get("asfrom") else text


def equal_in_index_order(conn: Connection, column: Any, value: Any) -> tuple[Any, ...]:
    """WHERE clauses for the rows whose ``column`` equals ``value``, for a statement ordered by ``column`` first and
    then by the rest of an index that ``column`` leads, so that its ``LIMIT`` walks that index and stops, whatever the
    planner's statistics say. On Postgres ``column`` is a range, so that only that index gives the order (with
    ``column`` equal to a constant, an index on the other order columns alone gives it too, and the planner takes
    that when it counts the value common, passing every newer row of other values), and bitmap scans are off for the
    rest of the transaction (without table statistics, as autovacuum off or a store just filled leave it, the planner
    takes thousands of matching rows for a handful, and would read every one of them to sort it). SQLite: the
    equality (its planner takes the index, or the statement names it: :func:`indexed_alias`)."""
    if conn.dialect.name != "postgresql":
        return (column == value,)
    conn.exec_driver_sql("SET LOCAL enable_bitmapscan = off")
    return (column >= value, column <= value)


def upsert_insert(conn: Connection, table: sa.Table) -> Any:
    """The dialect's INSERT with ``on_conflict_do_nothing`` / ``on_conflict_do_update`` (SQLite or Postgres)."""
    return (postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert)(table)


class Database:
    """An engine plus the clock timestamps come from; hands out read and write transactions.

    Without an injected ``clock`` (tests inject a fake one, used for every timestamp), time inside a
    transaction is the database's own (:meth:`now` with its connection): leases granted by one replica
    and judged by another then agree however far apart the replicas' clocks are.
    """

    def __init__(self, url: str | URL, *, clock: Clock | None = None) -> None:
        self.url = normalize_url(url)
        self.engine = make_engine(self.url)
        self.clock: Clock | None = clock
        # the same pool; a connection handed out by :meth:`query` is in autocommit until it goes back
        self._autocommit = self.engine.execution_options(isolation_level="AUTOCOMMIT")

    @property
    def is_sqlite(self) -> bool:
        return self.engine.dialect.name == "sqlite"

    def now(self, conn: Connection | None = None) -> datetime:
        """The injected clock's time; else, on ``conn``, the database server's clock (Postgres
        ``clock_timestamp()``; SQLite ``'now'``, the clock of the host holding the file), else this process's.

        Pass the transaction's connection for every time that is compared with rows other replicas
        write (leases); the process clock is only for informative timestamps outside a transaction.
        """
        now = self.clock() if self.clock is not None else utcnow() if conn is None else database_now(conn)
        if now.tzinfo is None:
            raise ValueError("the store's clock must return timezone-aware datetimes")
        return now

    @contextlib.contextmanager
    def read(self) -> Iterator[Connection]:
        """A read-only transaction."""
        with self.engine.connect() as conn, conn.begin():
            yield conn

    @contextlib.contextmanager
    def query(self) -> Iterator[Connection]:
        """A connection for reads whose statements need no common snapshot (each a snapshot of its own): Postgres
        runs them in autocommit, without the ``BEGIN`` and ``COMMIT`` round trips a :meth:`read` adds to each (under
        its default READ COMMITTED every statement sees a snapshot of its own either way); on SQLite it is
        :meth:`read` (a transaction there is a local call, and what keeps a reader's statements consistent)."""
        if self.is_sqlite:
            with self.read() as conn:
                yield conn
            return
        with self._autocommit.connect() as conn:
            yield conn

    @contextlib.contextmanager
    def write(self) -> Iterator[Connection]:
        """A write transaction (SQLite: ``BEGIN IMMEDIATE``); commits on success, rolls back on any exception."""
        with self.engine.connect() as conn:
            conn.execution_options(plancache_write=True)
            with conn.begin():
                yield conn

    def let_writers_in(self) -> None:
        """Between two write transactions of a long loop: SQLite pauses :data:`SQLITE_WRITER_GAP_S`, else writers
        waiting for its write lock could miss the moment it is free until the loop ends. Postgres: nothing (rows
        are locked, not the database)."""
        if self.is_sqlite:
            time.sleep(SQLITE_WRITER_GAP_S)

    # ------------------------------------------------------------------ migrations

    def alembic_config(self, conn: Connection | None = None) -> Any:
        """An Alembic config for this database, independent of the working directory."""
        from alembic.config import Config

        cfg = Config(stdout=sys.stdout)  # explicitly: Alembic's default is the sys.stdout of its import time
        cfg.set_main_option("script_location", str(migrations_dir()))
        cfg.set_main_option("sqlalchemy.url", self.url.render_as_string(hide_password=False).replace("%", "%%"))
        cfg.attributes["connection"] = conn
        return cfg

    def upgrade(self, revision: str = "head") -> None:
        """Apply migrations up to ``revision`` in one transaction (concurrent callers are serialised), then refresh
        the table statistics (:func:`analyze`). A database a newer plancache migrated is left as it is when its schema
        admits this plancache's code (:meth:`_refuse_unknown`)."""
        from alembic import command
        from alembic.runtime.migration import MigrationContext

        if self.is_sqlite:
            Path(self.url.database or "").parent.mkdir(parents=True, exist_ok=True)
        with self.migrating() as conn:
            if self._refuse_unknown(MigrationContext.configure(conn).get_current_revision(), conn):
                return
            command.upgrade(self.alembic_config(conn), revision)
            self._record_compatibility(conn)
            analyze(conn)

    def downgrade(self, revision: str) -> None:
        """Undo migrations down to ``revision`` in one transaction (:class:`SchemaTooNew` from a revision this
        plancache does not have: only the release that made it can undo it)."""
        from alembic import command
        from alembic.runtime.migration import MigrationContext

        with self.migrating() as conn:
            current = MigrationContext.configure(conn).get_current_revision()
            if self._refuse_unknown(current, conn):
                raise SchemaTooNew(f"database {self.url.render_as_string(hide_password=True)} is at schema revision "
                                   f"{current}, which this plancache does not have: downgrade it with the release "
                                   "that migrated it")
            command.downgrade(self.alembic_config(conn), revision)
            self._record_compatibility(conn)

    def _record_compatibility(self, conn: Connection) -> None:
        """Write ``schema_compatibility``'s row for the revision ``conn``'s database is now at (when that schema has
        the table): the oldest revision whose code runs on it (:func:`compatible_from`)."""
        from alembic.runtime.migration import MigrationContext
        from alembic.script import ScriptDirectory

        current = MigrationContext.configure(conn).get_current_revision()
        if current is None or not sa.inspect(conn).has_table(schema_compatibility.name):
            return
        oldest = compatible_from(ScriptDirectory.from_config(self.alembic_config()), current)
        conn.execute(sa.delete(schema_compatibility))
        conn.execute(sa.insert(schema_compatibility).values(revision=current, compatible_from=oldest))

    @contextlib.contextmanager
    def migrating(self) -> Iterator[Connection]:
        """The write transaction of a migration; concurrent ones are serialised. SQLite enforces no foreign key
        while it runs (a batch migration recreates a table: it drops the old one, which the rows referencing it
        would refuse) and every one is checked before it commits."""
        with self.engine.connect() as conn:
            raw = conn.connection.driver_connection if self.is_sqlite else None
            if raw is not None:
                raw.execute("PRAGMA foreign_keys = OFF")  # outside any transaction: SQLite ignores it inside one
            try:
                conn.execution_options(plancache_write=True)
                with conn.begin():
                    if conn.dialect.name == "postgresql":
                        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_MIGRATION_LOCK})
                    yield conn
                    if raw is not None:
                        _check_foreign_keys(conn)
            finally:
                if raw is not None:
                    raw.execute("PRAGMA foreign_keys = ON")

    def _refuse_unknown(self, current: str | None, conn: Connection) -> bool:
        """False when ``current`` is a revision of this plancache's migrations (or none). True when it is not but
        the database's ``schema_compatibility`` row for it names, as the oldest revision whose code runs on it, one
        this plancache has: a newer release migrated it with expand-only migrations, and this one runs on it
        (rolled back). Else :class:`SchemaTooNew`."""
        from alembic.script import ScriptDirectory
        from alembic.util import CommandError

        if current is None:
            return False
        script = ScriptDirectory.from_config(self.alembic_config())
        try:
            script.get_revision(current)
            return False
        except CommandError:
            pass
        oldest = None
        if sa.inspect(conn).has_table(schema_compatibility.name):
            oldest = conn.execute(sa.select(schema_compatibility.c.compatible_from)
                                  .where(schema_compatibility.c.revision == current)).scalar()
        known = oldest is not None and _has_revision(script, oldest)
        if not known:
            raise SchemaTooNew(
                f"database {self.url.render_as_string(hide_password=True)} is at schema revision {current}, which "
                f"this plancache (schema {script.get_current_head()}) does not know: a newer plancache migrated it"
            )
        log.warning("database schema revision %s is newer than this plancache's (%s); its migrations since %s "
                    "are expand-only, so this release runs on it", current, script.get_current_head(), oldest)
        return True

    def head_revision(self) -> str | None:
        from alembic.script import ScriptDirectory

        return ScriptDirectory.from_config(self.alembic_config()).get_current_head()

    def current_revision(self) -> str | None:
        from alembic.runtime.migration import MigrationContext

        with self.read() as conn:
            return MigrationContext.configure(conn).get_current_revision()

    def require_schema(self) -> None:
        """Raise :class:`SchemaNotReady` unless the database is migrated to this version's head, or to a newer
        schema whose migrations since a revision of this version are expand-only (:meth:`_refuse_unknown`)."""
        where = self.url.render_as_string(hide_password=True)
        if self.is_sqlite and not Path(self.url.database or "").exists():
            raise SchemaNotReady(f"no SQLite database at {self.url.database}; run `plancache db upgrade` first")
        current, head = self.current_revision(), self.head_revision()
        with self.read() as conn:
            if self._refuse_unknown(current, conn):
                return
        if current != head:
            raise SchemaNotReady(
                f"database {where} is at schema revision {current or '(none)'}, this plancache needs {head}; "
                "run `plancache db upgrade`"
            )

    def ping(self) -> None:
        """Raise if the database cannot be reached."""
        with self.engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")

    def close(self) -> None:
        self.engine.dispose()


#: The attribute of a migration module that marks it additive (docs/DEPLOYMENT.md "Rolling back"): code of its down
#: revision runs on its schema.
EXPAND_ONLY = "expand_only"


def compatible_from(script: Any, revision: str) -> str:
    """The oldest revision whose code runs on schema ``revision`` of ``script`` (an Alembic ``ScriptDirectory``):
    the down revision of the oldest migration in the run of :data:`EXPAND_ONLY` ones that ends at ``revision``."""
    oldest, rev = revision, script.get_revision(revision)
    while rev is not None and getattr(rev.module, EXPAND_ONLY, False) and isinstance(rev.down_revision, str):
        oldest = rev.down_revision
        rev = script.get_revision(oldest)
    return oldest


def _has_revision(script: Any, revision: str) -> bool:
    from alembic.util import CommandError

    try:
        return script.get_revision(revision) is not None
    except CommandError:
        return False


def check_page(limit: int, offset: int = 0) -> None:
    """Refuse a negative page; an explicit message beats a database error."""
    check_int("limit", limit, INT64_MAX, 0)
    check_int("offset", offset, INT64_MAX, 0)
