"""``plancache token create|revoke|list``: API tokens, stored hashed in the database."""

from __future__ import annotations

import enum

import typer

from .database import open_database
from .failures import command
from .options import database_url_option
from .output import plain_console

token_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Manage API tokens (stored hashed).")


class RoleChoice(enum.StrEnum):
    reader = "reader"
    worker = "worker"
    admin = "admin"


@token_app.command("create")
@command
def token_create(
    role: RoleChoice = typer.Option(..., "--role", help="reader: resolve/fetch; worker: claim and publish; admin: everything"),
    name: str = typer.Option(..., "--name", help="a unique name for this token, e.g. the host or team using it"),
    expires_in_days: float | None = typer.Option(None, "--expires-in-days", min=0.0001, max=3650,
                                                 help="refused after this many days (default: valid until revoked)"),
    database_url: str | None = database_url_option(),
) -> None:
    """Create a token and print it (stdout, once: only its hash is stored)."""
    from datetime import timedelta

    expires_in = None if expires_in_days is None else timedelta(days=expires_in_days)
    with open_database(database_url) as store:
        plaintext, info = store.create_token(name, role.value, expires_in=expires_in)
    until = "" if info.expires_at is None else f", valid until {info.expires_at:%Y-%m-%d %H:%M:%S} UTC"
    typer.echo(f"created {info.role} token {info.name!r} (id {info.id}{until}); it is shown only now:", err=True)
    typer.echo(plaintext)


@token_app.command("revoke")
@command
def token_revoke(name_or_id: str = typer.Argument(..., help="the live token's name, or its id"),
                 database_url: str | None = database_url_option()) -> None:
    """Revoke a token; requests bearing it are refused from now on."""
    with open_database(database_url) as store:
        info = store.revoke_token(name_or_id)
    typer.echo(f"revoked {info.role} token {info.name!r} (id {info.id})")


@token_app.command("list")
@command
def token_list(database_url: str | None = database_url_option()) -> None:
    """List tokens (never their secrets)."""
    from rich.table import Table

    with open_database(database_url) as store:
        tokens = store.list_tokens()
    table = Table(title=f"{len(tokens)} tokens")
    from datetime import UTC, datetime

    now = datetime.now(UTC)
    for col in ("id", "name", "role", "created", "expires", "status"):
        table.add_column(col)
    for t in tokens:
        expired = t.expires_at is not None and t.expires_at <= now
        table.add_row(str(t.id), t.name, t.role, t.created_at.strftime("%Y-%m-%d %H:%M:%S"),
                      "never" if t.expires_at is None else t.expires_at.strftime("%Y-%m-%d %H:%M:%S"),
                      "revoked" if t.revoked else "expired" if expired else "live")
    plain_console(width=200).print(table)


def register(app: typer.Typer) -> None:
    app.add_typer(token_app, name="token")
