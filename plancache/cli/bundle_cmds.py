"""``plancache bundle export|import``: signed single-file plan bundles for hosts without a server."""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path

import typer

from ..files import read_limited
from ..settings import SigningSettings, TrustSettings, env_name
from .database import open_database
from .failures import ExitCode, Failure, command
from .inputs import load_environment, load_signer, load_trusted_keys, writable_folder
from .options import database_url_option, signing_key_option

bundle_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                          help="Signed single-file plan bundles for hosts without a server.")

#: The most a ``--keys`` file is read for: 250,000 keys of a line each (64 hex and a newline), a capture file's
#: 100,000 graphs (``capture.MAX_CAPTURED``) with room for comments.
MAX_KEYS_FILE_BYTES = 16 * 1024 * 1024


def read_keys(path: Path, option: str = "--keys") -> list[str]:
    """Graph keys from a file: a JSON list, or one key per line (blank lines and ``#`` comments ignored)."""
    from ..protocol import GRAPH_KEY_PATTERN

    def bad(problem: str) -> Failure:
        return Failure(f"{option} {problem}", "give a file of graph keys: one per line (`plancache spec key` prints "
                                            "them), or a JSON list", ExitCode.USAGE)

    try:
        text = read_limited(path, MAX_KEYS_FILE_BYTES).decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise bad(f"{path}: cannot read it: {getattr(exc, 'strerror', None) or exc}") from None
    if text.lstrip().startswith("["):
        try:
            keys = json.loads(text)
        except json.JSONDecodeError as exc:
            raise bad(f"{path}: invalid JSON: {exc}") from None
        lines = [(i + 1, k) for i, k in enumerate(keys)]
    else:
        lines = [(i + 1, ln.split("#", 1)[0].strip()) for i, ln in enumerate(text.splitlines())]
        lines = [(n, k) for n, k in lines if k]
    for n, key in lines:
        if not isinstance(key, str) or not re.match(GRAPH_KEY_PATTERN, key):
            raise bad(f"{path}: item {n} ({str(key)[:80]!r}) is not a graph key (64 lowercase hex)")
    if not lines:
        raise bad(f"{path} holds no graph keys")
    return [k for _, k in lines]


def _refused(file: Path, exc: Exception) -> Failure:
    if isinstance(exc, OSError):
        fix = ("check the path; a bundle is read whole, so export fewer plans per file (--keys FILE)"
               if exc.errno == errno.EFBIG else "check the path")
        return Failure(f"cannot read the bundle {file}: {exc.strerror or exc}", fix, ExitCode.OS_ERROR)
    return Failure(f"{file}: refused: {getattr(exc, 'message', exc)}", "nothing was stored; check that the bundle "
                   "is intact and signed by one of the trusted keys", ExitCode.FAILED)


@bundle_app.command("export")
@command
def bundle_export(
    environment: str = typer.Option(..., "--environment", help="the target environment: a JSON file or inline JSON"),
    keys: Path | None = typer.Option(None, "--keys", help="file of graph keys (one per line, or a JSON list)"),
    all_plans: bool = typer.Option(False, "--all", help="every plan stored for the environment"),
    out: Path = typer.Option(..., "--out", help="bundle file to write"),
    signing_key: Path | None = signing_key_option("ed25519 private key that signs the bundle"),
    unsigned: bool = typer.Option(False, "--unsigned", help="write the bundle unsigned (hosts with trusted keys "
                                                            "refuse it); without it a signing key is required"),
    database_url: str | None = database_url_option(),
) -> None:
    """Write the plans (records, blobs, specs) of a set of graph keys on one environment to a signed file."""
    from ..bundle import export_bundle

    if (keys is None) == (not all_plans):
        raise Failure("give exactly one of --keys FILE and --all", "--keys FILE exports those graph keys, --all "
                      "every plan of the environment", ExitCode.USAGE)
    env = load_environment(environment, "--environment")
    graph_keys = read_keys(keys) if keys is not None else None
    key_file = signing_key or SigningSettings().signing_key
    if key_file is None and not unsigned:
        raise Failure("no signing key: a bundle is signed unless you ask for an unsigned one",
                      f"give --signing-key FILE (or {env_name('signing_key')}), or --unsigned", ExitCode.CONFIG)
    if key_file is not None and unsigned:
        raise Failure("--unsigned and a signing key contradict each other",
                      f"drop --unsigned, or --signing-key / {env_name('signing_key')}", ExitCode.USAGE)
    signer = load_signer(key_file) if key_file else None
    with open_database(database_url) as store:
        try:
            n = export_bundle(store, env, graph_keys, out, signer)
        except OSError as exc:
            raise Failure(f"cannot write the bundle {out}: {exc.strerror or exc}",
                          "give --out a path in a folder you can write", ExitCode.OS_ERROR) from None
    signed = f"signed by key {signer.key_id}" if signer else "UNSIGNED (hosts with trusted keys will refuse it)"
    typer.echo(f"wrote {out}: {n} plans for {env.describe()}, {signed}")


@bundle_app.command("import")
@command
def bundle_import(
    file: Path = typer.Argument(..., help="bundle file"),
    trusted_keys: str | None = typer.Option(None, "--trusted-keys",
                                               help="public key files or folders of *.pub (, or : separated); "
                                                    "when given, the bundle and every plan in it must be signed "
                                                    "by one of them (default: PLANCACHE_TRUSTED_KEYS)"),
    cache_dir: Path | None = typer.Option(None, "--cache-dir",
                                             help="seed this client plan cache folder (the PLANCACHE_CACHE_DIR of "
                                                  "the processes that will use it) instead of the database"),
    insecure_no_verify: bool = typer.Option(False, "--insecure-no-verify",
                                            help="store the bundle without checking its signatures when no trusted "
                                                 "keys are configured (anyone who could alter it chooses the code "
                                                 "your GPUs load); without it trusted keys are required"),
    database_url: str | None = database_url_option(),
) -> None:
    """Verify every entry of a bundle, then store its specs and plans in the database, or its plans in a
    client cache folder (--cache-dir, no server or database needed). Nothing is stored if any entry fails."""
    from ..bundle import import_bundle, read_verified
    from ..errors import PlanCacheError

    trusted = load_trusted_keys(trusted_keys or TrustSettings().trusted_keys)
    if not trusted and not insecure_no_verify:
        raise Failure("no trusted keys: a bundle's signatures are checked before anything is stored",
                      f"give --trusted-keys (or {env_name('trusted_keys')}), or --insecure-no-verify to store an "
                      "unchecked bundle knowingly", ExitCode.CONFIG)
    unchecked = "warning: the bundle signature was not checked (no --trusted-keys / PLANCACHE_TRUSTED_KEYS)"
    if cache_dir is not None:
        from ..client.cache import DiskCache

        try:
            header, plans = read_verified(file, trusted)
        except (OSError, PlanCacheError) as exc:
            raise _refused(file, exc) from None
        writable_folder(cache_dir, "the plan cache folder", "give --cache-dir a folder you can write")
        disk = DiskCache(cache_dir, header.environment)
        seeded = older = 0
        try:
            for p in plans:  # verified whole above: each is stored as it is read again
                if p.record.revision < disk.newest_revision(p.record.graph_key):
                    older += 1
                elif disk.save(p.record, p.blob):
                    seeded += 1
                else:
                    raise Failure(f"cannot write the plan cache at {disk.dir}", "give --cache-dir a folder you can "
                                  "write", ExitCode.OS_ERROR)
        except (OSError, PlanCacheError) as exc:
            raise _refused(file, exc) from None
        if not trusted:
            typer.echo(unchecked, err=True)
        typer.echo(f"seeded {disk.dir}: {seeded} plans for {header.environment.describe()}" + _older(older))
        return
    with open_database(database_url) as store:
        try:
            report = import_bundle(store, file, trusted)
        except (OSError, PlanCacheError) as exc:
            raise _refused(file, exc) from None
    if not report.signature_checked:
        typer.echo(unchecked, err=True)
    typer.echo(f"imported {file}: {report.imported} new plans, {report.unchanged} already stored, "
               f"for {report.environment.describe()}" + _older(report.older))


def _older(n: int) -> str:
    return f"; {n} older than the plans already there, skipped (an older revision never replaces a newer)" if n else ""


def register(app: typer.Typer) -> None:
    app.add_typer(bundle_app, name="bundle")
