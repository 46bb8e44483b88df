"""``plancache db|token|plans`` commands against a real database (SQLite and Postgres)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from plancache.blobs import open_blobs
from plancache.cli import make_app
from plancache.cli.failures import ExitCode
from plancache.store import open_store
from tests.factories import stored_plans


@pytest.fixture
def cli():
    app = make_app()
    runner = CliRunner()

    def run(*args: str, code: int = 0):
        result = runner.invoke(app, list(args))
        assert result.exit_code == code, (result.stdout, result.stderr)
        return result

    return run


def test_commands_need_an_upgraded_database(cli, tmp_path, monkeypatch):
    """A SQLite file that is there but not migrated is waited for (a `plancache serve` starting now migrates it);
    one that does not exist is said so at once, and not created."""
    import sqlite3

    url = f"sqlite:///{tmp_path / 'x.db'}"
    t0 = time.monotonic()
    result = cli("token", "list", "--database-url", url, code=ExitCode.DATABASE)
    assert "no SQLite database at" in result.stderr and "plancache db upgrade" in result.stderr
    assert "waiting up to" not in result.stderr and time.monotonic() - t0 < 3 and not (tmp_path / "x.db").exists()
    assert "Traceback" not in result.output

    monkeypatch.setattr("plancache.cli.database.SCHEMA_WAIT_SECONDS", 0.5)
    sqlite3.connect(tmp_path / "x.db").close()  # an empty file
    t0 = time.monotonic()
    result = cli("token", "list", "--database-url", url, code=ExitCode.DATABASE)
    assert "plancache db upgrade" in result.stderr and "Traceback" not in result.output
    assert "waiting up to" in result.stderr and 0.5 <= time.monotonic() - t0 < 5
    assert "(head)" in cli("db", "upgrade", "--database-url", url).stdout


def test_token_lifecycle(cli, db_url):
    cli("db", "upgrade", "--database-url", db_url)
    created = cli("token", "create", "--role", "worker", "--name", "gpu-pool", "--database-url", db_url)
    plaintext = created.stdout.strip()
    assert "shown only now" in created.stderr and plaintext.startswith("pct_")
    with open_store(db_url) as store:
        assert store.authenticate(plaintext).role == "worker"
    assert "exists" in cli("token", "create", "--role", "admin", "--name", "gpu-pool", "--database-url", db_url, code=1).stderr
    cli("token", "create", "--role", "root", "--name", "x", "--database-url", db_url, code=2)
    listing = cli("token", "list", "--database-url", db_url).stdout
    assert "gpu-pool" in listing and "live" in listing and plaintext not in listing
    assert "revoked worker token 'gpu-pool'" in cli("token", "revoke", "gpu-pool", "--database-url", db_url).stdout
    assert "no live token" in cli("token", "revoke", "gpu-pool", "--database-url", db_url, code=1).stderr
    assert "revoked" in cli("token", "list", "--database-url", db_url).stdout
    with open_store(db_url) as store:
        assert store.authenticate(plaintext) is None


def test_plans_list(cli, store, db_url, make_spec, make_plan, gpu_env):
    key, spec = make_spec(0)
    store.put_spec(key, spec)
    record = store.publish_plan(*make_plan(key, gpu_env, native_median_ms={"flash": 0.354, "cudnn_aten": 0.261}))
    table = cli("plans", "list", "--database-url", db_url).stdout
    assert key[:16] in table and "NVIDIA H200" in table
    lines = cli("plans", "list", "--json", "--env-id", gpu_env.env_id, "--database-url", db_url).stdout.splitlines()
    assert [json.loads(line)["graph_key"] for line in lines] == [record.graph_key]
    assert json.loads(lines[0])["native_median_ms"] == {"flash": 0.354, "cudnn_aten": 0.261}
    assert cli("plans", "list", "--json", "--graph-key", "0" * 64, "--database-url", db_url).stdout == ""


def test_migrate_blobs_to_a_folder_keeps_records_resolving(cli, store, db_url, make_spec, make_plan, gpu_env, tmp_path,
                                                            monkeypatch):
    import sqlalchemy as sa

    from plancache.errors import BlobStoreMismatch
    from plancache.store.models import blobs

    expected = _publish_three(store, make_spec, make_plan, gpu_env)
    orphan = store.put_blob(b"stored, not referenced yet")
    folder = (tmp_path / "blob volume").as_uri()

    out = cli("db", "migrate-blobs", folder, "--database-url", db_url).stdout
    assert "moved 4 blobs" in out and f"from database to {folder}" in out and f"PLANCACHE_BLOB_STORE={folder}" in out
    with store.db.read() as conn:
        assert conn.execute(sa.select(sa.func.count()).where(sa.func.length(blobs.c.data) > 0)).scalar_one() == 0
    with pytest.raises(BlobStoreMismatch, match="not in the database"):
        open_store(db_url)
    with open_store(db_url, blob_store=folder) as moved:
        found, missing = stored_plans(moved, gpu_env, list(expected))
        assert {k: blob for k, (_, blob) in found.items()} == expected and missing == []
        assert moved.get_blob(orphan) == b"stored, not referenced yet"
    # again with the setting left at the database, which no longer holds them: refused, not "moved 0 blobs; set
    # PLANCACHE_BLOB_STORE=…" (following that lost every blob when TARGET was not where they went)
    again = cli("db", "migrate-blobs", (tmp_path / "elsewhere").as_uri(), "--database-url", db_url, code=6).stderr
    assert "not in the database: set PLANCACHE_BLOB_STORE" in again
    monkeypatch.setenv("PLANCACHE_BLOB_STORE", folder)
    assert "moved 4 blobs" in cli("db", "migrate-blobs", (tmp_path / "copy").as_uri(), "--database-url", db_url).stdout
    assert "already" in cli("db", "migrate-blobs", folder, "--database-url", db_url, code=2).stderr
    assert "s3://bucket/prefix" in cli("db", "migrate-blobs", "ftp://x", "--database-url", db_url, code=2).stderr


def test_migrate_blobs_to_and_from_s3(cli, store, db_url, make_spec, make_plan, gpu_env, tmp_path, monkeypatch,
                                      s3_blob_url):
    """database -> s3 -> a folder -> database, each step checked by resolving every record with its blob; a blob
    damaged in the bucket is not copied on (it counts as missing)."""
    expected = _publish_three(store, make_spec, make_plan, gpu_env)
    folder = (tmp_path / "blobs").as_uri()

    def resolves(blob_store: str) -> None:
        with open_store(db_url, blob_store=blob_store) as moved:
            found, missing = stored_plans(moved, gpu_env, list(expected))
            assert {k: blob for k, (_, blob) in found.items()} == expected and missing == []

    assert "moved 3 blobs" in cli("db", "migrate-blobs", s3_blob_url, "--database-url", db_url).stdout
    resolves(s3_blob_url)
    monkeypatch.setenv("PLANCACHE_BLOB_STORE", s3_blob_url)
    assert f"from {s3_blob_url} to {folder}" in cli("db", "migrate-blobs", folder, "--database-url", db_url).stdout
    resolves(folder)
    resolves(s3_blob_url)  # copies are left where they were
    monkeypatch.setenv("PLANCACHE_BLOB_STORE", folder)
    assert "moved 3 blobs" in cli("db", "migrate-blobs", "database", "--database-url", db_url).stdout
    resolves("database")

    monkeypatch.setenv("PLANCACHE_BLOB_STORE", "database")
    assert "moved 3 blobs" in cli("db", "migrate-blobs", s3_blob_url, "--database-url", db_url).stdout
    monkeypatch.setenv("PLANCACHE_BLOB_STORE", s3_blob_url)
    damaged = open_blobs(s3_blob_url)
    digest = hashlib.sha256(expected[next(iter(expected))]).hexdigest()
    import obstore
    from obstore.store import from_url

    obstore.put(from_url(s3_blob_url), f"{digest[:2]}/{digest[2:4]}/{digest}", b"not the plan")
    assert damaged.get(digest) is None
    result = cli("db", "migrate-blobs", (tmp_path / "again").as_uri(), "--database-url", db_url)
    assert "moved 2 blobs" in result.stdout and "1 blobs of the catalog were not in" in result.stderr


def test_plans_resign_refusals_and_unsigned_records(cli, store, db_url, make_spec, make_plan, gpu_env, tmp_path,
                                                    monkeypatch):
    """``plans resign`` signs only what a trusted key signed, or, with --include-unsigned, records stored without a
    signature (those from before schema revision 0004)."""
    from plancache.signing import Signer, TrustedKeys, keygen

    for variable in ("PLANCACHE_SIGNING_KEY", "PLANCACHE_TRUSTED_KEYS"):
        monkeypatch.delenv(variable, raising=False)
    priv, pub, key_id = keygen(tmp_path / "keys", "fleet")
    key, spec = make_spec(0)
    store.put_spec(key, spec)
    unsigned = store.publish_plan(*make_plan(key, gpu_env))
    args = ("plans", "resign", "--database-url", db_url)
    assert "no signing key given" in cli(*args, code=ExitCode.CONFIG).stderr
    assert "no trusted keys given" in cli(*args, "--signing-key", str(priv), code=ExitCode.CONFIG).stderr
    refused = cli(*args, "--signing-key", str(priv), "--trusted-keys", str(pub), code=ExitCode.FAILED)
    assert "0 plan records again" in refused.stdout and f"plan {key[:16]} on env {gpu_env.env_id[:12]} is unsigned" \
        in refused.stderr
    assert store.get_plan(key, gpu_env) == unsigned
    done = cli(*args, "--signing-key", str(priv), "--include-unsigned").stdout
    assert f"signed 1 plan records again with key {key_id}" in done
    signed = store.get_plan(key, gpu_env)
    assert signed.signer_key_id == key_id and signed.revision > unsigned.revision
    TrustedKeys.from_files([pub]).verify(signed)
    assert "1 were signed by it already" in cli(*args, "--signing-key", str(priv), "--trusted-keys", str(pub)).stdout
    assert Signer.from_file(priv).key_id[:8] in cli("plans", "list", "--database-url", db_url).stdout


def test_a_command_right_after_serve_waits_for_its_migrations(tmp_path):
    """``plancache serve &`` then ``plancache token create`` at once: the command waits for the schema that the
    starting server applies, instead of failing with "run db upgrade first"."""
    from tests.live_server import free_port

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PLANCACHE_")},
           "PLANCACHE_DATABASE_URL": f"sqlite:///{tmp_path / 'fresh.db'}"}
    server = subprocess.Popen([sys.executable, "-m", "plancache", "serve", "--port", str(free_port())], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        token = subprocess.run([sys.executable, "-m", "plancache", "token", "create", "--role", "reader", "--name",
                                "app"], env=env, capture_output=True, text=True, timeout=60)
    finally:
        server.terminate()
        server.wait(15)
    assert token.returncode == 0, token.stderr
    assert token.stdout.strip().startswith("pct_")


def _publish_three(store, make_spec, make_plan, gpu_env) -> dict[str, bytes]:
    """Three published plans (their specs stored), by graph key: the blob of each."""
    expected = {}
    for i in range(3):
        key, spec = make_spec(i)
        store.put_spec(key, spec)
        meta, blob = make_plan(key, gpu_env, blob=f"plan {i}".encode() * 300)
        store.publish_plan(meta, blob)
        expected[key] = blob
    return expected


def test_token_list_shows_names_verbatim(cli, db_url):
    """A token name is any text: `token list` prints it as it is, never as rich markup or emoji codes."""
    cli("db", "upgrade", "--database-url", db_url)
    names = ["ci [/bold] team", "[red]ops[/red]", "gpu:thumbs_up:"]
    for name in names:
        cli("token", "create", "--role", "reader", "--name", name, "--database-url", db_url)
    listing = cli("token", "list", "--database-url", db_url).stdout
    for name in names:
        assert name in listing


def test_plans_list_shows_device_names_verbatim(cli, store, db_url, make_spec, make_plan, gpu_env):
    """A device name is any text a worker sent: `plans list` prints it as it is (a worker id with a rich closing tag
    made the listing fail with an internal error)."""
    key, spec = make_spec(0)
    store.put_spec(key, spec)
    store.publish_plan(*make_plan(key, gpu_env.model_copy(update={"device_name": "gpu[/bold]7"})))
    assert "gpu[/bold]7" in cli("plans", "list", "--database-url", db_url).stdout


def test_plans_list_shows_control_characters_escaped(cli, store, db_url, make_spec, make_plan, gpu_env):
    """A device name (and a worker id) is text a worker sent: `plans list` shows its control characters as escapes,
    never as terminal escape sequences (a title set, a screen cleared, colours) in the admin's terminal."""
    key, spec = make_spec(0)
    store.put_spec(key, spec)
    env = gpu_env.model_copy(update={"device_name": "GPU\x1b]0;owned\x07\x1b[2J"})
    store.publish_plan(*make_plan(key, env))
    out = cli("plans", "list", "--database-url", db_url).stdout
    assert "\x1b" not in out and "\x07" not in out, repr(out)
    assert "GPU\\x1b]0;owned" in out


def test_serve_creates_its_sqlite_file_first_and_leaves_none_when_it_stops_before_migrating(cli, tmp_path):
    """`plancache serve` makes a missing SQLite file at once (so a command started beside it waits for its schema
    rather than saying there is no database); on a taken port it stops before migrating and removes the empty file."""
    import socket

    from plancache.cli.serve_cmds import claim_sqlite_file

    path = tmp_path / "fresh.db"
    assert claim_sqlite_file(f"sqlite:///{path}") == path and path.stat().st_size == 0
    assert claim_sqlite_file(f"sqlite:///{path}") is None  # there already: not this serve's
    path.unlink()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        result = cli("serve", "--port", str(taken.getsockname()[1]), "--database-url", f"sqlite:///{path}",
                     code=ExitCode.OS_ERROR)
    assert "already in use" in result.stderr and not path.exists()
