"""The store a command works on: the blob-store setting checked first, a schema being migrated waited for, and
failures that name the database and say what to do. SQLAlchemy is imported when a store is opened."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..errors import PlanCacheError, SchemaNotReady, SchemaTooNew
from ..settings import StoreSettings, env_name
from .failures import ExitCode, Failure, database_failure, database_place, describe_os_error, one_line

if TYPE_CHECKING:
    from ..store import Store


#: How long a command waits for a schema that is missing or behind (a ``plancache serve`` starting beside it
#: migrates it) before it says to run ``plancache db upgrade``.
SCHEMA_WAIT_SECONDS = 5.0
#: How long a store command waits for a SQLite file that is not there to appear (a serve starting with it).
SQLITE_FILE_WAIT_SECONDS = 1.0


def _open_when_migrated(url: str, create: bool, check_blobs: bool, settings: StoreSettings) -> Store:
    from ..store import open_store

    sqlite_file = database_place(url)[1]
    if not create and sqlite_file is not None and not os.path.exists(sqlite_file):
        # a `plancache serve` started with this command creates the file first thing (serve_cmds.claim_sqlite_file);
        # with no file after a moment, nothing is starting: say so now rather than wait for a schema
        appears = time.monotonic() + SQLITE_FILE_WAIT_SECONDS
        while not os.path.exists(sqlite_file) and time.monotonic() < appears:
            time.sleep(0.05)
    missing = sqlite_file is not None and not os.path.exists(sqlite_file)
    deadline = time.monotonic() + (0.0 if create or missing else SCHEMA_WAIT_SECONDS)
    told = False
    while True:
        try:
            return open_store(url, create=create, check_blobs=check_blobs, blob_store=settings.blob_store,
                              job_max_attempts=settings.job_max_attempts)
        except SchemaNotReady as exc:
            if isinstance(exc, SchemaTooNew) or time.monotonic() >= deadline:
                raise
            if not told:
                print(f"waiting up to {SCHEMA_WAIT_SECONDS:.0f} s for the database schema (a `plancache serve` "
                      "starting now migrates it)", file=sys.stderr)
                told = True
            time.sleep(0.2)


@contextlib.contextmanager
def open_database(url: str | None = None, *, create: bool = False, check_blobs: bool = True,
                  settings: StoreSettings | None = None) -> Iterator[Store]:
    """The store at ``url`` (default: the settings' database URL), on the settings' blob store; ``create``
    migrates the schema to head first. Failures name the database and say what to do."""
    settings = settings or StoreSettings()
    url = url or settings.database_url
    import sqlalchemy as sa  # the server extra: without it, MISSING_EXTRA

    from ..store.blobs import open_blob_store

    try:
        open_blob_store(settings.blob_store)  # the setting is named when wrong, before the database is (nothing sent)
    except ValueError as exc:
        raise Failure(f"{env_name('blob_store')}: {one_line(exc)}",
                      f"set {env_name('blob_store')} to 'database', file:///absolute/path or s3://bucket/prefix "
                      "(docs/DEPLOYMENT.md)",
                      ExitCode.CONFIG) from None
    except OSError as exc:  # a folder that cannot be created
        raise Failure(f"{env_name('blob_store')}={settings.blob_store}: {describe_os_error(exc)}",
                      f"create that folder, or point {env_name('blob_store')} at one you can write",
                      ExitCode.OS_ERROR) from None
    try:
        store = _open_when_migrated(url, create, check_blobs, settings)
    except PlanCacheError:
        raise
    except (ValueError, sa.exc.ArgumentError) as exc:  # an unsupported or unparseable URL
        raise Failure(f"database URL: {one_line(exc)}",
                      f"set --database-url / {env_name('database_url')} to sqlite:///PATH or postgresql+psycopg://…",
                      ExitCode.CONFIG) from None
    except OSError as exc:  # the SQLite file's folder cannot be created
        where, _ = database_place(url)
        raise Failure(f"cannot create the folder of {where}: {describe_os_error(exc)}",
                      f"create that folder, or point --database-url / {env_name('database_url')} at a place you "
                      "can write", ExitCode.DATABASE) from None
    except sa.exc.SQLAlchemyError as exc:
        raise database_failure(url, exc) from None
    try:
        yield store
    except sa.exc.SQLAlchemyError as exc:
        raise database_failure(url, exc) from None
    finally:
        store.close()
