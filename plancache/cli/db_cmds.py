"""``plancache db upgrade|migrate-blobs``, ``plancache token create|revoke|list`` and ``plancache plans list``:
the store's CLI. The blob store is ``PLANCACHE_BLOB_STORE``'s."""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Optional

import typer

if TYPE_CHECKING:
    from ..store import Store

db_app = typer.Typer(no_args_is_help=True, help="Manage the plancache database.")
token_app = typer.Typer(no_args_is_help=True, help="Manage API tokens (stored hashed).")
plans_app = typer.Typer(no_args_is_help=True, help="Inspect stored plans.")


class RoleChoice(str, enum.Enum):
    reader = "reader"
    worker = "worker"
    admin = "admin"


def _url_option() -> Any:
    return typer.Option(None, "--database-url", envvar="PLANCACHE_DATABASE_URL",
                        help="database URL [default: PLANCACHE_DATABASE_URL, else sqlite:///./plancache.db]")


@contextlib.contextmanager
def _open(url: str | None, *, create: bool = False, check_blobs: bool = True) -> Iterator["Store"]:
    """The store at ``url`` (or the configured one); store and database errors end the command with exit code 1."""
    import sqlalchemy as sa

    from ..errors import PlanCacheError
    from ..settings import get_settings
    from ..store import open_store

    try:
        with open_store(url or get_settings().database_url, create=create, check_blobs=check_blobs) as store:
            yield store
    except (PlanCacheError, ValueError, sa.exc.SQLAlchemyError) as exc:
        detail = getattr(exc, "orig", None) or getattr(exc, "message", None) or exc  # the driver's words, not SQLAlchemy's wrapper
        typer.echo(f"error: {detail}", err=True)
        raise typer.Exit(1) from None


@db_app.command("upgrade")
def db_upgrade(database_url: Optional[str] = _url_option()) -> None:
    """Apply the schema migrations up to the newest revision (safe to run again)."""
    with _open(database_url, create=True) as store:
        where = store.db.url.render_as_string(hide_password=True)
        typer.echo(f"{where}: schema at revision {store.db.current_revision()} (head)")


@db_app.command("migrate-blobs")
def db_migrate_blobs(target: str = typer.Argument(..., help="the folder to move them to, as file:///absolute/path"),
                     database_url: Optional[str] = _url_option()) -> None:
    """Move the blob bytes held in the database to a file blob store (stop the servers first), all in one
    transaction; then set PLANCACHE_BLOB_STORE to TARGET everywhere. Safe to run again."""
    from ..store.blobs import migrate_blobs, open_blob_store

    try:
        blob_store = open_blob_store(target)
    except (ValueError, OSError) as exc:
        raise typer.BadParameter(str(exc), param_hint="TARGET") from None
    with _open(database_url, check_blobs=False) as store:
        try:
            moved, size = migrate_blobs(store.db, blob_store)
        except OSError as exc:
            typer.echo(f"error: {exc} (nothing was moved)", err=True)
            raise typer.Exit(1) from None
    typer.echo(f"moved {moved} blobs ({size} bytes) to {blob_store.url}; set PLANCACHE_BLOB_STORE={blob_store.url}")


@token_app.command("create")
def token_create(
    role: RoleChoice = typer.Option(..., "--role", help="reader: resolve/fetch; worker: claim and publish; admin: everything"),
    name: str = typer.Option(..., "--name", help="a unique name for this token, e.g. the host or team using it"),
    database_url: Optional[str] = _url_option(),
) -> None:
    """Create a token and print it (stdout, once: only its hash is stored)."""
    with _open(database_url) as store:
        plaintext, info = store.create_token(name, role.value)
    typer.echo(f"created {info.role} token {info.name!r} (id {info.id}); it is shown only now:", err=True)
    typer.echo(plaintext)


@token_app.command("revoke")
def token_revoke(name_or_id: str = typer.Argument(..., help="the live token's name, or its id"),
                 database_url: Optional[str] = _url_option()) -> None:
    """Revoke a token; requests bearing it are refused from now on."""
    with _open(database_url) as store:
        info = store.revoke_token(name_or_id)
    typer.echo(f"revoked {info.role} token {info.name!r} (id {info.id})")


@token_app.command("list")
def token_list(database_url: Optional[str] = _url_option()) -> None:
    """List tokens (never their secrets)."""
    from rich.console import Console
    from rich.table import Table

    with _open(database_url) as store:
        tokens = store.list_tokens()
    table = Table(title=f"{len(tokens)} tokens")
    for col in ("id", "name", "role", "created", "status"):
        table.add_column(col)
    for t in tokens:
        table.add_row(str(t.id), t.name, t.role, t.created_at.strftime("%Y-%m-%d %H:%M:%S"), "revoked" if t.revoked else "live")
    Console(width=200).print(table)


@plans_app.command("list")
def plans_list(
    env_id: Optional[str] = typer.Option(None, "--env-id", help="only plans for this environment id"),
    graph_key: Optional[str] = typer.Option(None, "--graph-key", help="only plans for this graph key"),
    limit: int = typer.Option(100, "--limit", min=1, max=10_000),
    offset: int = typer.Option(0, "--offset", min=0),
    as_json: bool = typer.Option(False, "--json", help="one JSON record per line instead of a table"),
    database_url: Optional[str] = _url_option(),
) -> None:
    """List stored plan records, newest first."""
    with _open(database_url) as store:
        records = store.list_plans(env_id=env_id, graph_key=graph_key, limit=limit, offset=offset)
    if as_json:
        for r in records:
            typer.echo(r.model_dump_json())
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{len(records)} plans")
    for col in ("graph key", "env id", "GPU", "cuDNN", "engine", "winner ms", "heuristic ms", "blob bytes", "signed", "worker", "created"):
        table.add_column(col, justify="right" if col in ("engine", "winner ms", "heuristic ms", "blob bytes") else "left")
    for r in records:
        env = r.environment
        table.add_row(
            r.graph_key[:16], r.env_id[:12], f"{env.device_name or 'GPU'} sm_{env.sm}x{env.sm_count}", str(env.cudnn_version),
            str(r.engine_id), f"{r.winner_median_ms:.4f}",
            "-" if r.heuristic_median_ms is None else f"{r.heuristic_median_ms:.4f}", str(r.blob_size),
            r.signer_key_id or "no", r.worker_id, r.created_at.strftime("%Y-%m-%d %H:%M:%S"),
        )
    Console(width=250).print(table)


def register(app: typer.Typer) -> None:
    app.add_typer(db_app, name="db")
    app.add_typer(token_app, name="token")
    app.add_typer(plans_app, name="plans")
