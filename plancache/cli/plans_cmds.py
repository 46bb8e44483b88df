"""``plancache plans list|gc``: inspect stored plan records, and retention (delete what is no longer used)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from .common import (
    ExitCode,
    Failure,
    command,
    database_url_option,
    load_environment,
    open_database,
)

if TYPE_CHECKING:
    from ..store import Store

plans_app = typer.Typer(no_args_is_help=True, help="Inspect stored plans; delete those no longer used.")

_HEX = re.compile(r"^[0-9a-f]+$")
#: The shortest environment id prefix taken for a whole id (``plans list`` prints 12 characters).
MIN_ENV_ID_PREFIX = 8
ENV_ID_LENGTH = 32


def _env_ids_starting(store: Store, prefix: str) -> list[str]:
    """The environment ids of stored plan records that start with ``prefix``."""
    import sqlalchemy as sa

    from ..store.models import plans

    with store.db.read() as conn:
        query = sa.select(plans.c.env_id).where(plans.c.env_id.startswith(prefix, autoescape=True)).distinct()
        return sorted(conn.execute(query).scalars())


def _no_such_environment(value: str, option: str) -> Failure:
    return Failure(f"{option} {value[:80]!r}: no such environment: no stored plan record has an environment id "
                   "starting with it, and it is no environment JSON file",
                   "copy an id from the 'env id' column of `plancache plans list` (8 characters or more), or give "
                   "an environment JSON file", ExitCode.FAILED)


def resolve_env_id(store: Store, value: str, option: str) -> str:
    """The whole environment id ``value`` stands for: an id or a prefix of one (as ``plans list`` prints it) of a
    stored plan record, or an environment as inline JSON or a JSON file. Anything else is 'no such environment'."""
    v = value.strip()
    if v.startswith("{") or Path(v).is_file():
        return load_environment(v, option).env_id
    if not _HEX.match(v) or len(v) > ENV_ID_LENGTH:
        raise _no_such_environment(value, option)
    if len(v) < MIN_ENV_ID_PREFIX:
        raise Failure(f"{option} {v!r}: too short for an environment id",
                      f"give at least {MIN_ENV_ID_PREFIX} characters of the 'env id' column of `plancache plans list`",
                      ExitCode.USAGE)
    found = _env_ids_starting(store, v)
    if not found:
        raise _no_such_environment(value, option)
    if len(found) > 1:
        raise Failure(f"{option} {v!r} matches {len(found)} environments ({', '.join(found)})",
                      "give more characters of the id", ExitCode.USAGE)
    return found[0]


@plans_app.command("list")
@command
def plans_list(
    env_id: Optional[str] = typer.Option(None, "--env-id", help="only plans for this environment id (or its first "
                                                                "8+ characters, as this table prints it)"),
    graph_key: Optional[str] = typer.Option(None, "--graph-key", help="only plans for this graph key"),
    limit: int = typer.Option(100, "--limit", min=1, max=10_000, help="list at most this many records"),
    offset: int = typer.Option(0, "--offset", min=0, help="skip this many records first (paging)"),
    as_json: bool = typer.Option(False, "--json", help="one JSON record per line instead of a table"),
    database_url: Optional[str] = database_url_option(),
) -> None:
    """List stored plan records, newest first."""
    with open_database(database_url) as store:
        if env_id is not None and len(env_id) < ENV_ID_LENGTH:
            env_id = resolve_env_id(store, env_id, "--env-id")
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


@plans_app.command("gc")
@command
def plans_gc(
    grace_hours: float = typer.Option(24.0, "--grace-hours", min=0.0,
                                      help="keep unreferenced blobs stored less than this many hours ago"),
    keep_environment: Optional[list[str]] = typer.Option(
        None, "--keep-environment",
        help="an environment still in use: its env id (or the first 8+ characters `plans list` prints), or its "
             "environment JSON / file; repeat it. When given, plan records of every other environment are deleted"),
    dry_run: bool = typer.Option(False, "--dry-run", help="report what would be deleted, delete nothing"),
    database_url: Optional[str] = database_url_option(),
) -> None:
    """Delete plan records of environments no longer in use, then blobs no record references."""
    from datetime import timedelta

    from ..store.retention import gc

    with open_database(database_url) as store:
        keep = None
        if keep_environment:
            keep = {resolve_env_id(store, v, "--keep-environment") for v in keep_environment}
        try:
            report = gc(store, grace=timedelta(hours=grace_hours), keep_env_ids=keep, dry_run=dry_run)
        except ValueError as exc:
            raise Failure(str(exc), "check the ids with `plancache plans list`", ExitCode.FAILED) from None
    verb = "would delete" if dry_run else "deleted"
    typer.echo(f"{verb} {report.records_deleted} plan records")
    for env_id, n in sorted(report.records_by_env.items()):
        typer.echo(f"  environment {env_id}: {n}")
    typer.echo(f"{verb} {report.blobs_deleted} unreferenced blobs ({report.blob_bytes_freed} bytes)")


def register(app: typer.Typer) -> None:
    app.add_typer(plans_app, name="plans")
