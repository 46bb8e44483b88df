"""``plancache db upgrade|downgrade|migrate-blobs|check``: the database's schema, where its blob bytes live (the database, a
folder, object storage) and whether the two agree. The blob store is ``PLANCACHE_BLOB_STORE``'s."""

from __future__ import annotations

import typer

from .database import open_database
from .failures import ExitCode, Failure, command, describe_os_error
from .options import database_url_option

db_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Manage the plancache database.")


@db_app.command("upgrade")
@command
def db_upgrade(database_url: str | None = database_url_option()) -> None:
    """Apply the schema migrations up to the newest revision (safe to run again)."""
    with open_database(database_url, create=True) as store:
        where = store.db.url.render_as_string(hide_password=True)
        typer.echo(f"{where}: schema at revision {store.db.current_revision()} (head)")


@db_app.command("downgrade")
@command
def db_downgrade(revision: str = typer.Argument(..., help="the schema revision to go back to, e.g. 0007 "
                                                          "(docs/DEPLOYMENT.md \"Rolling back\")"),
                 database_url: str | None = database_url_option()) -> None:
    """Undo the schema migrations after REVISION (stop every server and worker of the newer release first). Needed
    only to roll back over a contract migration: a release runs on a newer schema whose migrations since its own are
    expand-only."""
    from alembic.util import CommandError

    with open_database(database_url, check_blobs=False) as store:
        try:
            store.db.downgrade(revision)
        except CommandError as exc:
            raise Failure(f"REVISION {revision}: {str(exc).splitlines()[0]}",
                          "give a revision of this release's migrations below the database's (`plancache db upgrade` "
                          "prints the current one)", ExitCode.USAGE) from None
        where = store.db.url.render_as_string(hide_password=True)
        typer.echo(f"{where}: schema at revision {store.db.current_revision()}")


@db_app.command("migrate-blobs")
@command
def db_migrate_blobs(target: str = typer.Argument(..., help="where to copy them: 'database', file:///absolute/path "
                                                             "or s3://bucket/prefix"),
                     database_url: str | None = database_url_option()) -> None:
    """Copy every blob from PLANCACHE_BLOB_STORE (where they are now) to TARGET (stop the servers first), each checked
    against its digest, in one transaction; then set PLANCACHE_BLOB_STORE to TARGET everywhere. Safe to run again.
    Copies left in a folder or bucket are not deleted."""
    from ..store.blobs import migrate_blobs, open_blob_store, probe_blob_store

    hint = "give 'database', a folder as file:///absolute/path or a bucket as s3://bucket/prefix"
    try:
        blob_store = open_blob_store(target)
    except (ValueError, OSError) as exc:
        raise Failure(f"TARGET {target}: {exc}", hint, ExitCode.USAGE) from None
    # the blob store of the settings must be where the blobs are (open_database refuses it otherwise): from the
    # database while they have left it, nothing would be copied, and the store pointed at TARGET would lack them all
    with open_database(database_url) as store:
        try:
            done = migrate_blobs(store.db, store.blob_store, blob_store)
        except ValueError as exc:  # TARGET is where the blobs are
            raise Failure(f"TARGET {target}: {exc}", hint, ExitCode.USAGE) from None
        except OSError as exc:
            raise Failure(f"{describe_os_error(exc)} (nothing was moved)",
                          f"check that {blob_store.url} is a folder or bucket you can write (for a bucket: the AWS_* "
                          "variables, docs/DEPLOYMENT.md)", ExitCode.OS_ERROR) from None
        # one blob copied read back from TARGET before saying to use it
        problem = probe_blob_store(store.db, blob_store, done.last_copied) if done.last_copied else None
    if problem:
        raise Failure(f"moved {done.moved} blobs to {blob_store.url}, but {problem}",
                      f"keep PLANCACHE_BLOB_STORE={store.blob_store.url} until {blob_store.url} reads back, then run "
                      "this again", ExitCode.OS_ERROR)
    typer.echo(f"moved {done.moved} blobs ({done.size} bytes) from {store.blob_store.url} to {blob_store.url}; "
               f"set PLANCACHE_BLOB_STORE={blob_store.url}")
    if done.missing:
        typer.echo(f"warning: {done.missing} blobs of the catalog were not in {store.blob_store.url} (not moved)",
                   err=True)


@db_app.command("check")
@command
def db_check(sizes_only: bool = typer.Option(False, "--sizes-only",
                                             help="compare sizes only; do not read and hash every blob"),
             database_url: str | None = database_url_option()) -> None:
    """List records whose blob is missing from PLANCACHE_BLOB_STORE or whose bytes do not match, and blobs no record
    names, one line each (after a restore: docs/DEPLOYMENT.md "Backups"). Changes nothing; exit 1 when any is found."""
    from ..store.check import check

    with open_database(database_url, check_blobs=False) as store:
        try:
            report = check(store, lambda problem: typer.echo(str(problem)), read_bytes=not sizes_only)
        except OSError as exc:
            raise Failure(f"{describe_os_error(exc)} (while checking)",
                          f"check that {store.blob_store.url} can be read (for a bucket: the AWS_* variables, "
                          "docs/DEPLOYMENT.md)", ExitCode.OS_ERROR) from None
    counts = ", ".join(f"{n} {kind}" for kind, n in report.problems.items())
    summary = f"checked {report.records} records, {report.blobs} blobs in {store.blob_store.url}: {counts}"
    if not report.ok:
        raise Failure(summary, "restore the bucket and the database from backups of the same point "
                      "(docs/DEPLOYMENT.md \"Backups\"); `plans gc` deletes unnamed blobs", ExitCode.FAILED)
    typer.echo(summary)


def register(app: typer.Typer) -> None:
    app.add_typer(db_app, name="db")
