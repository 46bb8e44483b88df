"""``plancache db check``: after a restore, the records whose blob is missing or whose bytes do not match, and the
blobs no record names, on every database and blob store (the database, a folder, a bucket of moto's S3)."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from plancache.blobs.base import shard
from plancache.cli import make_app
from plancache.cli.failures import ExitCode
from plancache.store.blobs import ContentBlobs
from plancache.store.check import Problem, check
from plancache.store.models import blobs
from tests.factories import H200, make_meta

pytestmark = pytest.mark.both_blob_stores


def overwrite(store: Any, sha256: str, data: bytes) -> None:
    """Replace the stored bytes of ``sha256`` with ``data``, past every check (a bucket or disk gone bad)."""
    blob_store = store.blob_store
    if isinstance(blob_store, ContentBlobs) and blob_store.folder is not None:
        path = blob_store.folder.path(sha256)
        path.chmod(0o644)
        path.write_bytes(data)
    elif isinstance(blob_store, ContentBlobs):
        content = blob_store.content
        content._obs.put(content._store, shard(sha256), data)
    else:
        with store.db.write() as conn:
            conn.execute(sa.update(blobs).where(blobs.c.sha256 == sha256).values(data=data))


def seed(store: Any, make_spec: Any, n: int) -> list[tuple[str, bytes]]:
    published = []
    for i in range(n):
        key, spec = make_spec(i)
        store.put_spec(key, spec)
        blob = f"plan {i} ".encode() * 40
        store.publish_plan(make_meta(key, H200, blob), blob)
        published.append((key, blob))
    return published


def test_db_check_lists_missing_and_mismatched_blobs_and_blobs_no_record_names(store, make_spec):
    (_, good), (bad_key, bad), (gone_key, gone) = seed(store, make_spec, 3)
    bad_sha, gone_sha = hashlib.sha256(bad).hexdigest(), hashlib.sha256(gone).hexdigest()
    overwrite(store, bad_sha, bytes([bad[0] ^ 1]) + bad[1:])  # same size, other bytes
    with store.db.write() as conn:
        store.blob_store.delete(conn, gone_sha)
    spare = store.put_blob(b"a blob whose record was never written" * 3)  # a catalog row, no record
    found: list[Problem] = []
    report = check(store, found.append)
    by_kind = {(p.kind, p.sha256) for p in found}
    assert ("mismatch", bad_sha) in by_kind and ("missing", gone_sha) in by_kind and ("unnamed", spare) in by_kind
    assert report.records == 3 and report.problems["missing"] == 1 and report.problems["mismatch"] == 1
    assert any(bad_key in p.where for p in found if p.kind == "mismatch")
    assert any(gone_key in p.where for p in found if p.kind == "missing")
    sizes_only = check(store, lambda _: None, read_bytes=False)
    assert sizes_only.problems["mismatch"] == 0 and sizes_only.problems["missing"] == 1  # same size: not seen
    if isinstance(store.blob_store, ContentBlobs):  # bytes in a folder or bucket that no catalog row names
        stray = b"bytes a restored-to-earlier database never heard of" * 2
        store.blob_store.content.put(hashlib.sha256(stray).hexdigest(), stray)
        found.clear()
        check(store, found.append)
        assert ("unnamed", hashlib.sha256(stray).hexdigest()) in {(p.kind, p.sha256) for p in found}
    assert good  # its record and blob raise nothing


def test_the_cli_says_ok_on_a_consistent_store_and_exits_1_listing_each_problem(store, make_spec, db_url,
                                                                                blob_store_url, monkeypatch):
    ((_, blob),) = seed(store, make_spec, 1)
    monkeypatch.setenv("PLANCACHE_DATABASE_URL", db_url)
    monkeypatch.setenv("PLANCACHE_BLOB_STORE", blob_store_url)
    ok = CliRunner().invoke(make_app(), ["db", "check"])
    assert ok.exit_code == 0, ok.output
    assert "checked 1 records, 1 blobs" in ok.output and "0 missing, 0 mismatch, 0 unnamed" in ok.output
    with store.db.write() as conn:
        store.blob_store.delete(conn, hashlib.sha256(blob).hexdigest())
    bad = CliRunner().invoke(make_app(), ["db", "check"])
    assert bad.exit_code == ExitCode.FAILED, bad.output
    assert f"missing  {hashlib.sha256(blob).hexdigest()} record" in bad.output
    assert "1 missing" in bad.output and "Traceback" not in bad.output
