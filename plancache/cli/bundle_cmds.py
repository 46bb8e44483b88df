"""``plancache bundle export|import`` (signed offline plan bundles) and ``plancache plans gc`` (retention)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from .db_cmds import _open, _url_option, plans_app

if TYPE_CHECKING:
    from ..environment import Environment

bundle_app = typer.Typer(no_args_is_help=True, help="Signed single-file plan bundles for hosts without a server.")

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(1)


def load_environment(value: str, option: str) -> "Environment":
    """An :class:`Environment` from inline JSON (``{...}``) or a JSON file."""
    from pydantic import ValidationError

    from ..environment import Environment

    text = value
    if not value.lstrip().startswith("{"):
        try:
            text = Path(value).read_text(encoding="utf-8")
        except OSError as exc:
            raise typer.BadParameter(f"cannot read environment file: {exc}", param_hint=option) from None
    try:
        return Environment.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "document"
        raise typer.BadParameter(f"{value[:80]}: not an environment ({where}: {first.get('msg')})", param_hint=option) from None


def _read_keys(path: Path) -> list[str]:
    """Graph keys from a file: a JSON list, or one key per line (blank lines and ``#`` comments ignored)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc}", param_hint="--keys") from None
    if text.lstrip().startswith("["):
        try:
            keys = json.loads(text)
        except json.JSONDecodeError as exc:
            raise typer.BadParameter(f"{path}: invalid JSON: {exc}", param_hint="--keys") from None
        lines = [(i + 1, k) for i, k in enumerate(keys)]
    else:
        lines = [(i + 1, ln.split("#", 1)[0].strip()) for i, ln in enumerate(text.splitlines())]
        lines = [(n, k) for n, k in lines if k]
    for n, key in lines:
        if not isinstance(key, str) or not _HEX64.match(key):
            raise typer.BadParameter(f"{path}: item {n} ({str(key)[:80]!r}) is not a graph key (64 lowercase hex)",
                                     param_hint="--keys")
    if not lines:
        raise typer.BadParameter(f"{path} holds no graph keys", param_hint="--keys")
    return [k for _, k in lines]


@bundle_app.command("export")
def bundle_export(
    environment: str = typer.Option(..., "--environment", help="the target environment: a JSON file or inline JSON"),
    keys: Optional[Path] = typer.Option(None, "--keys", help="file of graph keys (one per line, or a JSON list)"),
    all_plans: bool = typer.Option(False, "--all", help="every plan stored for the environment"),
    out: Path = typer.Option(..., "--out", help="bundle file to write"),
    signing_key: Optional[Path] = typer.Option(None, "--signing-key", envvar="PLANCACHE_SIGNING_KEY",
                                               help="ed25519 private key that signs the bundle"),
    database_url: Optional[str] = _url_option(),
) -> None:
    """Write the plans (records, blobs, specs) of a set of graph keys on one environment to a signed file."""
    from ..bundle import export_bundle
    from ..errors import PlanCacheError
    from ..signing import Signer

    if (keys is None) == (not all_plans):
        raise typer.BadParameter("give exactly one of --keys FILE and --all", param_hint="--keys")
    env = load_environment(environment, "--environment")
    graph_keys = _read_keys(keys) if keys is not None else None
    try:
        signer = Signer.from_file(signing_key) if signing_key else None
    except (OSError, PlanCacheError) as exc:
        raise _fail(str(getattr(exc, "message", exc))) from None
    with _open(database_url) as store:
        try:
            n = export_bundle(store, env, graph_keys, out, signer)
        except (OSError, PlanCacheError) as exc:
            raise _fail(str(getattr(exc, "message", exc))) from None
    signed = f"signed by key {signer.key_id}" if signer else "UNSIGNED (hosts with trusted keys will refuse it)"
    typer.echo(f"wrote {out}: {n} plans for {env.describe()}, {signed}")


@bundle_app.command("import")
def bundle_import(
    file: Path = typer.Argument(..., help="bundle file"),
    trusted_keys: Optional[str] = typer.Option(None, "--trusted-keys", envvar="PLANCACHE_TRUSTED_KEYS",
                                               help="public key files or folders of *.pub (, or : separated); "
                                                    "when given, the bundle and every plan in it must be signed "
                                                    "by one of them"),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir",
                                             help="seed this client plan cache folder (the PLANCACHE_CACHE_DIR of "
                                                  "the processes that will use it) instead of the database"),
    database_url: Optional[str] = _url_option(),
) -> None:
    """Verify every entry of a bundle, then store its specs and plans in the database, or its plans in a
    client cache folder (--cache-dir, no server or database needed). Nothing is stored if any entry fails."""
    from ..bundle import import_bundle, read_bundle, verify_bundle
    from ..errors import PlanCacheError
    from ..signing import TrustedKeys

    try:
        trusted = TrustedKeys.from_setting(trusted_keys)
    except (OSError, PlanCacheError) as exc:
        raise _fail(str(getattr(exc, "message", exc))) from None
    if trusted_keys and not trusted:
        raise _fail(f"--trusted-keys {trusted_keys!r} names no public key")
    unchecked = "warning: the bundle signature was not checked (no --trusted-keys / PLANCACHE_TRUSTED_KEYS)"
    if cache_dir is not None:
        from ..client.cache import DiskCache

        try:
            raw, doc = read_bundle(file)
            plans = verify_bundle(raw, doc, trusted)
        except (OSError, PlanCacheError) as exc:
            raise _fail(f"{file}: refused: {getattr(exc, 'message', exc)}") from None
        disk = DiskCache(cache_dir, doc.header.environment)
        if not all(disk.save(p.record, p.blob) for p in plans):
            raise _fail(f"cannot write the plan cache at {disk.dir}")
        if not trusted:
            typer.echo(unchecked, err=True)
        typer.echo(f"seeded {disk.dir}: {len(plans)} plans for {doc.header.environment.describe()}")
        return
    with _open(database_url) as store:
        try:
            report = import_bundle(store, file, trusted)
        except (OSError, PlanCacheError) as exc:
            raise _fail(f"{file}: refused: {getattr(exc, 'message', exc)}") from None
    if not report.signature_checked:
        typer.echo(unchecked, err=True)
    typer.echo(f"imported {file}: {report.imported} new plans, {report.unchanged} already stored, "
               f"for {report.environment.describe()}")


def plans_gc(
    grace_hours: float = typer.Option(24.0, "--grace-hours", min=0.0,
                                      help="keep unreferenced blobs stored less than this many hours ago"),
    keep_environment: Optional[list[str]] = typer.Option(
        None, "--keep-environment",
        help="an environment still in use (env id, or environment JSON / file); repeat it. When given, plan "
             "records of every other environment are deleted"),
    dry_run: bool = typer.Option(False, "--dry-run", help="report what would be deleted, delete nothing"),
    database_url: Optional[str] = _url_option(),
) -> None:
    """Delete plan records of environments no longer in use, then blobs no record references."""
    from datetime import timedelta

    from ..store.retention import gc

    keep = None
    if keep_environment:
        keep = {v if _HEX32.match(v) else load_environment(v, "--keep-environment").env_id for v in keep_environment}
    with _open(database_url) as store:
        try:
            report = gc(store, grace=timedelta(hours=grace_hours), keep_env_ids=keep, dry_run=dry_run)
        except ValueError as exc:
            raise _fail(str(exc)) from None
    verb = "would delete" if dry_run else "deleted"
    typer.echo(f"{verb} {report.records_deleted} plan records")
    for env_id, n in sorted(report.records_by_env.items()):
        typer.echo(f"  environment {env_id}: {n}")
    typer.echo(f"{verb} {report.blobs_deleted} unreferenced blobs ({report.blob_bytes_freed} bytes)")


def register(app: typer.Typer) -> None:
    app.add_typer(bundle_app, name="bundle")
    plans_app.command("gc")(plans_gc)
