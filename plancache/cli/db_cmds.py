"""``plancache db upgrade|migrate-blobs``: the database's schema and where its blob bytes live. The blob store is
``PLANCACHE_BLOB_STORE``'s."""

from __future__ import annotations

import typer

from .common import (
    ExitCode,
    Failure,
    command,
    database_url_option,
    describe_os_error,
    open_database,
)

db_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Manage the plancache database.")


@db_app.command("upgrade")
@command
def db_upgrade(database_url: str | None = database_url_option()) -> None:
    """Apply the schema migrations up to the newest revision (safe to run again)."""
    with open_database(database_url, create=True) as store:
        where = store.db.url.render_as_string(hide_password=True)
        typer.echo(f"{where}: schema at revision {store.db.current_revision()} (head)")


@db_app.command("migrate-blobs")
@command
def db_migrate_blobs(target: str = typer.Argument(..., help="the folder to move them to, as file:///absolute/path"),
                     database_url: str | None = database_url_option()) -> None:
    """Move the blob bytes held in the database to a file blob store (stop the servers first), all in one
    transaction; then set PLANCACHE_BLOB_STORE to TARGET everywhere. Safe to run again."""
    from ..store.blobs import migrate_blobs, open_blob_store

    try:
        blob_store = open_blob_store(target)
    except (ValueError, OSError) as exc:
        raise Failure(f"TARGET {target}: {exc}", "give a folder as file:///absolute/path", ExitCode.USAGE) from None
    with open_database(database_url, check_blobs=False) as store:
        try:
            moved, size = migrate_blobs(store.db, blob_store)
        except ValueError as exc:  # TARGET is not a file:// store
            raise Failure(f"TARGET {target}: {exc}", "give a folder as file:///absolute/path", ExitCode.USAGE) from None
        except OSError as exc:
            raise Failure(f"{describe_os_error(exc)} (nothing was moved)",
                          f"check that {blob_store.url} is a folder you can write", ExitCode.OS_ERROR) from None
    typer.echo(f"moved {moved} blobs ({size} bytes) to {blob_store.url}; set PLANCACHE_BLOB_STORE={blob_store.url}")


def register(app: typer.Typer) -> None:
    app.add_typer(db_app, name="db")
