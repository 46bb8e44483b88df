"""Rolling back without a restore (docs/DEPLOYMENT.md "Rolling back"): each migration says whether it is
expand-only; the database records the oldest revision whose code runs on its schema; a release whose head is older
than the database's runs on it when every migration since is expand-only, and refuses it otherwise;
``plancache db downgrade`` undoes migrations on SQLite and Postgres."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from plancache.cli import make_app
from plancache.cli.failures import ExitCode
from plancache.errors import SchemaTooNew
from plancache.store import open_store
from plancache.store.db import EXPAND_ONLY, Database, migrations_dir
from plancache.store.models import schema_compatibility
from tests.live_server import LiveServer

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = sorted((ROOT / "migrations" / "versions").glob("0*.py"))


def _module(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_migration_says_whether_it_is_expand_only_and_the_docs_list_each():
    docs = (ROOT / "docs" / "DEPLOYMENT.md").read_text()
    section = docs[docs.index("## Rolling back"):]
    for path in VERSIONS:
        module = _module(path)
        assert isinstance(getattr(module, EXPAND_ONLY, None), bool), f"{path.name} lacks `{EXPAND_ONLY} = True|False`"
        kind = "expand" if getattr(module, EXPAND_ONLY) else "contract"
        assert f"| {module.revision} | {kind} |" in section, f"docs/DEPLOYMENT.md lists no {module.revision} ({kind})"


def pretend_newer(db_url: str, revision: str, compatible_from: str | None) -> None:
    """The (migrated) database as a later release would leave it: at ``revision``, its compatibility row naming
    ``compatible_from`` (None: no row for it)."""
    engine = sa.create_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(f"UPDATE alembic_version SET version_num = '{revision}'"))
            conn.execute(sa.delete(schema_compatibility))
            if compatible_from is not None:
                conn.execute(sa.insert(schema_compatibility).values(revision=revision, compatible_from=compatible_from))
    finally:
        engine.dispose()


def test_migrating_records_the_oldest_revision_whose_code_runs_on_the_schema(db_url):
    with open_store(db_url, create=True) as store, store.db.read() as conn:
        rows = conn.execute(sa.select(schema_compatibility)).all()
        head = store.db.head_revision()
    assert [tuple(r) for r in rows] == [(head, "0008")]  # 0009 to 0013 only add; 0008 adds a tally code of 0007 skips


def test_a_release_runs_on_a_newer_schema_whose_migrations_since_its_own_are_expand_only(db_url, tmp_path):
    """Before: an older release refused any newer schema (exit 6), so `kubectl rollout undo` after a migration meant
    downtime until a restore."""
    with open_store(db_url, create=True) as store:
        head = store.db.head_revision()
    assert head is not None
    pretend_newer(db_url, "0042", compatible_from=head)  # a later release's expand-only migrations since our head
    with open_store(db_url) as store:  # the schema check of `serve`, workers' servers, the CLI
        assert store.db.current_revision() == "0042"
    with LiveServer(tmp_path, store=open_store(db_url, create=True)) as srv:  # `serve` migrates first: left as is
        assert httpx.get(f"{srv.url}/readyz").status_code == 200
        assert httpx.post(f"{srv.url}/v1/specs", json={}, headers={"Authorization": f"Bearer {srv.admin_token}"}
                          ).status_code == 422  # it answers requests
        srv.store.close()
    for compatible in ("0042", "0041", None):  # a contract migration since our head, or no word on it
        pretend_newer(db_url, "0042", compatible_from=compatible)
        for create in (False, True):
            with pytest.raises(SchemaTooNew, match="revision 0042, which this plancache .* does not know"):
                open_store(db_url, create=create)


def older_release(tmp_path: Path) -> type[Database]:
    """Release N-1: this code with the migrations up to 0008 only (its head); 0009 to 0013 are all expand."""
    older_dir = tmp_path / "migrations-n-1"
    shutil.copytree(migrations_dir(), older_dir)
    for newer in [p for p in (older_dir / "versions").glob("0*.py") if p.name[:4] > "0008"]:
        newer.unlink()

    class OlderRelease(Database):
        def alembic_config(self, conn: Any = None) -> Any:
            cfg = super().alembic_config(conn)
            cfg.set_main_option("script_location", str(older_dir))
            return cfg

    return OlderRelease


def test_an_older_release_runs_on_this_release_s_schema(db_url, tmp_path):
    """After this release migrated to 0013 (0009 to 0013 expand only), N-1 checks the schema and starts; it cannot
    undo them."""
    with open_store(db_url, create=True):
        pass
    older = older_release(tmp_path)(db_url)
    try:
        assert older.head_revision() == "0008"
        older.require_schema()  # the rollback: N-1 starts on schema 0013
        older.upgrade()  # and its `serve` (which migrates first) leaves the schema as it is
        assert older.current_revision() == "0013"
        with pytest.raises(SchemaTooNew):  # only the release that made a revision can undo it
            older.downgrade("0006")
    finally:
        older.close()


def test_a_rolling_upgrade_and_its_rollback_with_two_releases_serving_one_database(db_url, tmp_path, make_spec):
    """Release N-1 serves on 0008; release N migrates to 0013 and serves beside it; a spec registered through
    either is read through the other; N is rolled back and N-1 goes on alone, no restore."""
    from plancache.store import Store

    older_db = older_release(tmp_path)
    older_db(db_url).upgrade()  # N-1's schema: 0008
    old_store = Store(db_url)
    old_store.db.close()
    old_store.db = older_db(db_url)
    newer_store = open_store(db_url, create=True)  # N's migration job: 0013
    assert newer_store.db.current_revision() == "0013"
    old_store.db.require_schema()  # a N-1 replica restarted mid-rollout starts
    headers: dict[str, str] = {}
    with LiveServer(tmp_path / "old", store=old_store) as old, LiveServer(tmp_path / "new", store=newer_store) as new:
        headers = {"Authorization": f"Bearer {old.admin_token}"}
        for i, (srv, other) in enumerate(((old, new), (new, old))):
            key, spec = make_spec(i)
            assert httpx.post(f"{srv.url}/v1/specs", json=spec, headers=headers).status_code in (200, 201)
            assert httpx.get(f"{other.url}/v1/specs/{key}", headers=headers).status_code == 200
    newer_store.close()  # rolled back: N's pods are gone, the schema stays at 0013
    with LiveServer(tmp_path / "old-again", store=old_store) as old:
        key, _ = make_spec(1)
        assert httpx.get(f"{old.url}/v1/specs/{key}", headers=headers).status_code == 200
    old_store.close()


def test_db_downgrade_and_upgrade_again_keep_the_data(db_url, make_spec, monkeypatch):
    with open_store(db_url, create=True) as store:
        key, spec = make_spec(0)
        store.put_spec(key, spec)
    monkeypatch.setenv("PLANCACHE_DATABASE_URL", db_url)
    down = CliRunner().invoke(make_app(), ["db", "downgrade", "0008"])
    assert down.exit_code == 0, down.output
    assert "schema at revision 0008" in down.output
    engine = sa.create_engine(db_url)
    try:
        assert "expires_at" not in {c["name"] for c in sa.inspect(engine).get_columns("api_tokens")}
        assert not sa.inspect(engine).has_table("schema_compatibility")
    finally:
        engine.dispose()
    up = CliRunner().invoke(make_app(), ["db", "upgrade"])
    assert up.exit_code == 0, up.output
    with open_store(db_url) as store:
        assert store.get_spec(key) is not None
    unknown = CliRunner().invoke(make_app(), ["db", "downgrade", "0x7"])
    assert unknown.exit_code == ExitCode.USAGE, unknown.output
    assert "0x7" in unknown.output and "Traceback" not in unknown.output
