"""``plancache plans list|gc|resign|withdraw``: inspect stored plan records, retention (delete what is no longer
used), signing stored records again with another key (key rotation), and withdrawing a plan."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from ..settings import SigningSettings, TrustSettings
from .database import open_database
from .failures import ExitCode, Failure, command, required
from .inputs import load_environment, load_signer, load_trusted_keys
from .options import database_url_option, signing_key_option
from .output import plain_console, printable

if TYPE_CHECKING:
    from ..protocol import PlanRecord
    from ..signing import Signer, TrustedKeys
    from ..store import Store

plans_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                         help="Inspect stored plans; delete those no longer used; sign them "
                                                   "again with another key; withdraw one.")
#: Records read per query by ``plans resign``.
_PAGE = 1000

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
    env_id: str | None = typer.Option(None, "--env-id", help="only plans for this environment id (or its first "
                                                                "8+ characters, as this table prints it)"),
    graph_key: str | None = typer.Option(None, "--graph-key", help="only plans for this graph key"),
    limit: int = typer.Option(100, "--limit", min=1, max=10_000, help="list at most this many records"),
    offset: int = typer.Option(0, "--offset", min=0, help="skip this many records first (paging)"),
    as_json: bool = typer.Option(False, "--json", help="one JSON record per line instead of a table"),
    database_url: str | None = database_url_option(),
) -> None:
    """List stored plan records, newest first: a table about 100 columns wide (`--json`: every field, the engine
    and the worker included)."""
    with open_database(database_url) as store:
        if env_id is not None and len(env_id) < ENV_ID_LENGTH:
            env_id = resolve_env_id(store, env_id, "--env-id")
        records = store.list_plans(env_id=env_id, graph_key=graph_key, limit=limit, offset=offset)
        total = len(records) if as_json else store.count_plans(env_id=env_id, graph_key=graph_key)
    if as_json:
        for r in records:
            typer.echo(r.model_dump_json())
        return
    typer.echo(plans_table(records, total, offset), nl=False)


#: The width `plans list` lays its table out for.
TABLE_WIDTH = 100


def plans_table(records: list[PlanRecord], total: int, offset: int = 0) -> str:
    """The table `plans list` prints: a title saying how many of how many, then one row per record."""
    from rich.table import Table

    shown = f"{len(records)} plans" if offset == 0 and len(records) == total else \
        f"{len(records)} of {total} plans" + (f" from #{offset + 1}" if offset else "")
    more = " (--limit / --offset for the others)" if len(records) < total else ""
    table = Table(box=None, collapse_padding=True, pad_edge=False, header_style="bold")
    for col in ("graph key", "env id", "GPU", "cuDNN", "tuned ms", "vs heur.", "KiB", "signer", "created"):
        table.add_column(col, justify="right" if col in ("tuned ms", "vs heur.", "KiB") else "left",
                         overflow="fold", max_width=22 if col == "GPU" else None)
    for r in records:
        env = r.environment
        gain = "-" if not r.heuristic_median_ms or r.winner_median_ms <= 0 else \
            f"{r.heuristic_median_ms / r.winner_median_ms:.2f}x"
        table.add_row(r.graph_key[:16], r.env_id[:12], printable(f"{env.device_name or 'GPU'} sm_{env.sm}x{env.sm_count}"),
                      str(env.cudnn_version), f"{r.winner_median_ms:.4f}", gain, f"{r.blob_size / 1024:.0f}",
                      (r.signer_key_id or "unsigned")[:8], r.created_at.strftime("%m-%d %H:%M"))
    console = plain_console(width=TABLE_WIDTH)
    with console.capture() as out:
        console.print(shown + more)
        console.print(table)
    return out.get()


@plans_app.command("gc")
@command
def plans_gc(
    grace_hours: float = typer.Option(24.0, "--grace-hours", min=0.0,
                                      help="keep unreferenced blobs stored less than this many hours ago (and what "
                                           "crashes left in a blob folder or bucket, modified less long ago)"),
    keep_environment: list[str] | None = typer.Option(
        None, "--keep-environment",
        help="an environment still in use: its env id (or the first 8+ characters `plans list` prints), or its "
             "environment JSON / file; repeat it. When given, plan records of every other environment are deleted"),
    jobs_days: float | None = typer.Option(
        None, "--jobs-days", min=0.001, help="delete the jobs that finished more than this many days ago (except "
                                             "those that tuned a stored plan); default: keep them"),
    misses_days: float | None = typer.Option(
        None, "--misses-days", min=0.001, help="delete the misses last seen more than this many days ago; default: "
                                               "keep them"),
    withdrawals_days: float | None = typer.Option(
        None, "--withdrawals-days", min=0.001,
        help="delete the withdrawals made more than this many days ago: clients still holding such a plan are no "
             "longer told, and an older revision may be published again; default: keep them"),
    dry_run: bool = typer.Option(False, "--dry-run", help="report what would be deleted, delete nothing"),
    database_url: str | None = database_url_option(),
) -> None:
    """Delete plan records of environments no longer in use, then blobs no record references; with --jobs-days,
    --misses-days or --withdrawals-days, also that history. With the bucket unreachable, the blob sweep is
    skipped (exit 5 after the rest; --dry-run says what it could not count and exits 0)."""
    from datetime import timedelta
    from urllib.parse import urlsplit

    from ..blobs.objects import OBJECT_STORE_SCHEMES
    from ..store.history import prune_history
    from ..store.retention import gc

    def days(n: float | None) -> timedelta | None:
        return None if n is None else timedelta(days=n)

    with open_database(database_url) as store:
        in_bucket = urlsplit(store.blob_store.url).scheme in OBJECT_STORE_SCHEMES
        keep = None
        if keep_environment:
            keep = {resolve_env_id(store, v, "--keep-environment") for v in keep_environment}
        try:
            report = gc(store, grace=timedelta(hours=grace_hours), keep_env_ids=keep, dry_run=dry_run)
        except ValueError as exc:
            raise Failure(str(exc), "check the ids with `plancache plans list`", ExitCode.FAILED) from None
        history = prune_history(store, jobs_older_than=days(jobs_days), misses_older_than=days(misses_days),
                                withdrawals_older_than=days(withdrawals_days), dry_run=dry_run)
    verb = "would delete" if dry_run else "deleted"
    for what, n, given in (("finished jobs", history.jobs_deleted, jobs_days),
                           ("misses", history.misses_deleted, misses_days),
                           ("withdrawals", history.withdrawals_deleted, withdrawals_days)):
        if given is not None:
            typer.echo(f"{verb} {n} {what} older than {given:g} days")
    typer.echo(f"{verb} {report.records_deleted} plan records")
    for env_id, n in sorted(report.records_by_env.items()):
        typer.echo(f"  environment {env_id}: {n}")
    typer.echo(f"{verb} {report.blobs_deleted} unreferenced blobs ({report.blob_bytes_freed} bytes)")
    if in_bucket and report.orphans_deleted:
        typer.echo(f"{verb} {report.orphans_deleted} objects no catalog row names ({report.leftover_bytes_freed} bytes)")
    elif report.temporaries_deleted or report.orphans_deleted:
        typer.echo(f"{verb} {report.temporaries_deleted} temporary files of crashed writers and "
                   f"{report.orphans_deleted} blob files no catalog row names ({report.leftover_bytes_freed} bytes)")
    if report.bucket_unavailable is None:
        return
    if dry_run:
        typer.echo(f"not counted: objects no catalog row names, as the bucket cannot be listed now "
                   f"({report.bucket_unavailable})")
        return
    raise Failure(f"blob sweep skipped, as the bucket cannot be listed now ({report.bucket_unavailable}): unreferenced "
                  "blobs and objects no catalog row names stay", "run `plancache plans gc` again once the bucket is "
                  "reachable", ExitCode.OS_ERROR)


def _all_records(store: Store, env_id: str | None) -> list[PlanRecord]:
    """Every stored record (of ``env_id``), read before any is replaced (a replacement reorders the listing)."""
    records: list[PlanRecord] = []
    while page := store.list_plans(env_id=env_id, limit=_PAGE, offset=len(records)):
        records.extend(page)
    return records


def _resign(store: Store, record: PlanRecord, signer: Signer, trusted: TrustedKeys, include_unsigned: bool) -> str:
    """Sign ``record`` again with ``signer`` (a higher revision replaces it); what happened: ``signed``,
    ``current`` (already signed by ``signer``), ``newer`` (replaced or withdrawn meanwhile), or why the
    record was refused."""
    from ..errors import InvalidValue, StaleRevision, VerificationError
    from ..protocol import PlanMeta
    from ..verify import verify_blob

    if record.signer_key_id == signer.key_id:
        return "current"
    if record.envelope is not None or not include_unsigned:
        try:
            verify_blob(record, None, what=f"plan {record.graph_key[:16]} on env {record.env_id[:12]}", trusted=trusted,
                        require_signature=True)
        except VerificationError as exc:
            return exc.message
    blob = store.get_blob(record.blob_sha256)
    if blob is None:
        return f"plan {record.graph_key[:16]} on env {record.env_id[:12]}: its blob is not stored"
    meta = PlanMeta.model_validate(record.model_dump(include=set(PlanMeta.model_fields)))
    try:
        signed = signer.sign(meta)
    except InvalidValue as exc:  # its revision is the highest there is
        return f"plan {record.graph_key[:16]} on env {record.env_id[:12]}: {exc.message}"
    try:
        store.publish_plan(signed, blob, replace=True, expect_revision=record.revision)
    except StaleRevision:  # replaced, withdrawn or deleted since it was read
        return "newer"
    return "signed"


@plans_app.command("resign")
@command
def plans_resign(
    signing_key: Path | None = signing_key_option("ed25519 private key that signs the records again"),
    trusted_keys: str | None = typer.Option(
        None, "--trusted-keys", help="public key files or folders of *.pub (, or : separated): only records whose "
                                     "signature verifies by one of them are signed again (default: "
                                     "PLANCACHE_TRUSTED_KEYS)"),
    include_unsigned: bool = typer.Option(False, "--include-unsigned",
                                          help="also sign records stored without a signature (those stored before "
                                               "schema revision 0004): you vouch for this database's contents"),
    env_id: str | None = typer.Option(None, "--env-id", help="only plans for this environment id (or its first "
                                                                "8+ characters, as `plans list` prints it)"),
    database_url: str | None = database_url_option(),
) -> None:
    """Sign stored plan records again with --signing-key (key rotation): every record signed by a trusted key,
    and not by this one yet, is replaced by the same record with a higher revision and this key's signature."""
    signer = load_signer(required(signing_key or SigningSettings().signing_key, "no signing key given",
                                  "give --signing-key or set PLANCACHE_SIGNING_KEY (the new key's NAME.key)"))
    trusted = load_trusted_keys(trusted_keys or TrustSettings().trusted_keys)
    if not trusted and not include_unsigned:
        raise Failure("no trusted keys given: no record's signature can be checked",
                      "give --trusted-keys (the public keys of the records' current signers) or set "
                      "PLANCACHE_TRUSTED_KEYS", ExitCode.CONFIG)
    with open_database(database_url) as store:
        if env_id is not None and len(env_id) < ENV_ID_LENGTH:
            env_id = resolve_env_id(store, env_id, "--env-id")
        outcomes = [_resign(store, r, signer, trusted, include_unsigned) for r in _all_records(store, env_id)]
    refused = [o for o in outcomes if o not in ("signed", "current", "newer")]
    typer.echo(f"signed {outcomes.count('signed')} plan records again with key {signer.key_id}; "
               f"{outcomes.count('current')} were signed by it already, {outcomes.count('newer')} replaced by a "
               f"newer record meanwhile, {len(refused)} refused")
    if refused:
        raise Failure(f"{len(refused)} plan records were not signed again: " + "; ".join(refused[:5])
                      + (" …" if len(refused) > 5 else ""),
                      "give --trusted-keys the public keys that signed them (or --include-unsigned for records "
                      "without a signature), or tune them again", ExitCode.FAILED)


@plans_app.command("withdraw")
@command
def plans_withdraw(
    graph_key: str = typer.Argument(..., help="the graph key of the plan (64 hex characters, `plancache spec key`)"),
    environment: str = typer.Option(..., "--environment", help="the plan's environment: its env id (or the first "
                                                                 "8+ characters `plans list` prints), or its "
                                                                 "environment JSON / file"),
    reason: str = typer.Option(..., "--reason", help="why it is withdrawn (shown to clients and by `explain`)"),
    signing_key: Path | None = signing_key_option("ed25519 private key that signs the withdrawal (a key clients "
                                                  "trust)"),
    database_url: str | None = database_url_option(),
) -> None:
    """Withdraw a stored plan: resolve stops serving it, and clients that revalidate (PLANCACHE_REVALIDATE_SECONDS)
    or ask for it drop their copies. The withdrawal is signed like a plan; only a plan signed after it (a re-tune)
    takes its place."""
    from ..protocol import GRAPH_KEY_PATTERN, MAX_WITHDRAWAL_REASON, Withdrawal

    if not re.match(GRAPH_KEY_PATTERN, graph_key):
        raise Failure(f"{graph_key[:80]!r} is not a graph key (64 lowercase hex characters)",
                      "copy it from `plancache plans list --json` or compute it with `plancache spec key FILE`",
                      ExitCode.USAGE)
    if not reason.strip() or len(reason) > MAX_WITHDRAWAL_REASON:
        raise Failure(f"--reason must be 1 to {MAX_WITHDRAWAL_REASON} characters, not {len(reason)}",
                      "say in a sentence why the plan is withdrawn", ExitCode.USAGE)
    signer = load_signer(required(signing_key or SigningSettings().signing_key, "no signing key given",
                                  "give --signing-key or set PLANCACHE_SIGNING_KEY (a key clients trust)"))
    with open_database(database_url) as store:
        env_id = resolve_env_id(store, environment, "--environment")
        found = store.list_plans(env_id=env_id, graph_key=graph_key, limit=1)
        if not found:
            raise Failure(f"no plan is stored for graph key {graph_key} on environment {env_id} (withdrawn already, "
                          "or never tuned there)", "check with `plancache plans list --graph-key KEY` or "
                          "`plancache explain KEY --environment FILE`", ExitCode.FAILED)
        record = found[0]
        withdrawal = signer.sign_withdrawal(Withdrawal(
            graph_key=graph_key, environment=record.environment, blob_sha256=record.blob_sha256,
            withdrawn_revision=record.revision, reason=reason.strip()))
        stored = store.withdraw_plan(withdrawal)
    typer.echo(f"withdrew the plan of {graph_key[:16]} on environment {env_id[:12]} (revision {record.revision}) "
               f"with withdrawal revision {stored.revision}, signed by key {signer.key_id}: resolve no longer serves "
               "it, and clients drop their copies when they next revalidate (PLANCACHE_REVALIDATE_SECONDS)")


def register(app: typer.Typer) -> None:
    app.add_typer(plans_app, name="plans")
