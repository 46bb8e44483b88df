"""``plancache index publish``: the signed static index of an environment, beside its blobs in a folder or bucket."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import typer

from ..settings import SigningSettings, env_name
from .database import open_database
from .failures import ExitCode, Failure, command
from .inputs import load_environment, load_signer
from .options import database_url_option, signing_key_option

index_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                        help="Signed static indexes that clients read with no API call (PLANCACHE_INDEX_URL).")


@index_app.command("publish")
@command
def index_publish(
    environment: str = typer.Option(..., "--environment", help="the environment: a JSON file or inline JSON"),
    to: str = typer.Option(..., "--to", help="where: a folder (file:///path) or a bucket (s3://bucket/prefix) that "
                                             "an HTTP server, the bucket's public URL or a CDN serves"),
    signing_key: Path | None = signing_key_option("ed25519 private key that signs the index (one the clients trust)"),
    expires_days: float = typer.Option(7.0, "--expires-days", min=0.001, max=366,
                                       help="days the index stays valid: publish again before (e.g. daily, by cron)"),
    shard_plans: int = typer.Option(64, "--shard-plans", min=1, max=100_000,
                                    help="records per shard aimed at (smaller: less read per start-up, larger root)"),
    sets: list[str] = typer.Option([], "--set", help="NAME=FILE: a named set of the graph keys in FILE (one per line, "
                                                     "or a JSON list), one shard that clients naming it in "
                                                     "PLANCACHE_INDEX_SETS read first; repeat it for more"),
    database_url: str | None = database_url_option(),
) -> None:
    """Publish every plan stored for one environment as a signed index (root, shards) plus the blobs it names,
    under --to. Run it again after new plans are published, and before the index expires."""
    import re

    from ..index import SET_NAME_PATTERN, open_target, publish_index
    from .bundle_cmds import read_keys

    env = load_environment(environment, "--environment")
    named: dict[str, list[str]] = {}
    for item in sets:
        name, _, file = item.partition("=")
        if not re.match(SET_NAME_PATTERN, name) or not file or name in named:
            raise Failure(f"--set {item[:80]!r}: not NAME=FILE with a new name of letters, digits, '.', '_', '-'",
                          "give --set NAME=FILE, e.g. --set llm-serving=llm-keys.txt", ExitCode.USAGE)
        named[name] = read_keys(Path(file), "--set")
    key_file = signing_key or SigningSettings().signing_key
    if key_file is None:
        raise Failure("no signing key: an index is always signed",
                      f"give --signing-key FILE (or {env_name('signing_key')}): a key your clients trust",
                      ExitCode.CONFIG)
    signer = load_signer(key_file)
    try:
        target = open_target(to)
    except ValueError as exc:
        raise Failure(f"--to {to}: {exc}", "give file:///absolute/path or s3://bucket/prefix", ExitCode.USAGE) from None
    with open_database(database_url) as store:
        done = publish_index(store, env, target, signer, expires_in=timedelta(days=expires_days),
                             shard_plans=shard_plans, sets=named)
    typer.echo(f"published {to}: index version {done.version} of {done.plans} plans for {env.describe()} in "
               f"{done.shards} shards ({done.shards_written} new, {done.blobs_copied} blobs copied), signed by key "
               f"{signer.key_id}, valid until {done.expires.isoformat()}")
    for name, n in done.sets_missing.items():
        typer.echo(f"warning: set {name}: {n} graph keys have no plan on this environment (left out; they are "
                   "fetched from the server)", err=True)


def register(app: typer.Typer) -> None:
    app.add_typer(index_app, name="index")
