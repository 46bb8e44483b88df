"""``plancache plans gc``: records of unused environments go, unreferenced blobs go after a grace period,
and a blob still referenced never goes — also while publishes run concurrently."""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from plancache.blobs import ObjectStoreBlobs
from plancache.cli import app
from plancache.environment import Environment
from plancache.errors import NotFound, StaleRevision
from plancache.store import open_store
from plancache.store.blobs import ContentBlobs
from plancache.store.models import blobs
from plancache.store.retention import GC_BATCH, gc

DAY = timedelta(hours=24)
pytestmark = pytest.mark.both_blob_stores


@pytest.fixture
def old_env(gpu_env: Environment) -> Environment:
    return gpu_env.model_copy(update={"cudnn_version": 91800})


def _publish(store: Any, make_spec: Any, make_plan: Any, i: int, env: Environment, blob: bytes) -> str:
    key, spec = make_spec(i)
    store.put_spec(key, spec)
    meta, data = make_plan(key, env, blob=blob)
    store.publish_plan(meta, data)
    return meta.blob_sha256


def _blob_digests(store: Any) -> set[str]:
    """The catalog's digests; on a file or S3 blob store, also exactly the files or objects there (none missing,
    none left over)."""
    with store.db.read() as conn:
        digests = set(conn.execute(sa.select(blobs.c.sha256)).scalars())
    if isinstance(store.blob_store, ContentBlobs) and store.blob_store.folder is not None:
        assert {p.name for p in store.blob_store.folder.root.rglob("*") if p.is_file()} == digests
    elif store.blob_store.url.startswith("s3://"):
        import obstore
        from obstore.store import from_url

        listed = obstore.list(from_url(store.blob_store.url)).collect()
        assert {meta["path"].rsplit("/", 1)[-1] for meta in listed} == digests
    return digests


def test_unreferenced_blobs_go_after_the_grace_period(store, clock, make_spec, make_plan, gpu_env):
    used = _publish(store, make_spec, make_plan, 0, gpu_env, b"in-use-plan")
    orphan = store.put_blob(b"uploaded, never referenced")
    clock.advance(DAY.total_seconds() + 1)
    fresh = store.put_blob(b"uploaded just now, record still on its way")

    report = gc(store, grace=DAY)
    assert (report.records_deleted, report.blobs_deleted) == (0, 1)
    assert report.blob_bytes_freed == len(b"uploaded, never referenced")
    assert _blob_digests(store) == {used, fresh} and store.get_blob(orphan) is None

    clock.advance(DAY.total_seconds() + 1)
    assert gc(store, grace=DAY).blobs_deleted == 1
    assert _blob_digests(store) == {used}
    assert store.get_blob(used) == b"in-use-plan"


def test_records_of_unused_environments_and_their_blobs(store, clock, make_spec, make_plan, gpu_env, old_env):
    keep = _publish(store, make_spec, make_plan, 0, gpu_env, b"new-env-plan")
    shared = _publish(store, make_spec, make_plan, 1, gpu_env, b"same bytes on both environments")
    assert _publish(store, make_spec, make_plan, 1, old_env, b"same bytes on both environments") == shared
    only_old = _publish(store, make_spec, make_plan, 2, old_env, b"old-env-only plan")
    clock.advance(DAY.total_seconds() + 1)

    dry = gc(store, grace=DAY, keep_env_ids={gpu_env.env_id}, dry_run=True)
    assert (dry.dry_run, dry.records_deleted, dry.records_by_env, dry.blobs_deleted) == (
        True, 2, {old_env.env_id: 2}, 1)
    assert len(store.list_plans()) == 4 and len(_blob_digests(store)) == 3, "a dry run deletes nothing"

    real = gc(store, grace=DAY, keep_env_ids={gpu_env.env_id})
    assert (real.records_deleted, real.records_by_env, real.blobs_deleted, real.blob_bytes_freed) == (
        dry.records_deleted, dry.records_by_env, dry.blobs_deleted, dry.blob_bytes_freed)
    assert {r.env_id for r in store.list_plans()} == {gpu_env.env_id}
    assert _blob_digests(store) == {keep, shared}, "the blob the kept environment shares must survive"
    assert only_old not in _blob_digests(store)


def test_refuses_keep_sets_that_would_delete_everything(store, make_spec, make_plan, gpu_env, old_env):
    _publish(store, make_spec, make_plan, 0, gpu_env, b"p")
    with pytest.raises(ValueError, match="empty"):
        gc(store, grace=DAY, keep_env_ids=set())
    with pytest.raises(ValueError, match=old_env.env_id):
        gc(store, grace=DAY, keep_env_ids={old_env.env_id})  # a typo'd / stale id matches no record
    with pytest.raises(ValueError, match="negative"):
        gc(store, grace=-DAY)
    assert len(store.list_plans()) == 1


def test_gc_interleaved_with_publishes_never_loses_a_referenced_blob(db_url, blob_store_url, make_spec, make_plan,
                                                                     gpu_env, old_env):
    """Publishers keep storing plans, some re-using bytes that gc is about to collect, while gc runs with no grace
    and drops the old environment's records. Every record keeps its blob. With no grace at all a publish to a
    folder or bucket may be refused (404: gc took its bytes between their write and the transaction; with a grace
    period the upload's fresh catalog row is spared), never half-published."""
    # the real clock: grace=0 makes every unreferenced blob collectable
    store = open_store(db_url, create=True, blob_store=blob_store_url)
    try:
        keys = []
        for i in range(8):
            key, spec = make_spec(i)
            store.put_spec(key, spec)
            keys.append(key)
        meta, blob = make_plan(keys[0], gpu_env, blob=b"seed")
        store.publish_plan(meta, blob)
        stop = threading.Event()
        errors: list[BaseException] = []
        gc_runs, published = [0], [0]

        def publisher(worker: int) -> None:
            try:
                for n in range(40):
                    key = keys[(worker * 40 + n) % len(keys)]
                    shared = f"shared-{n % 5}".encode()  # bytes an old-environment record held a moment ago
                    for env, data in ((old_env, shared), (gpu_env, shared), (gpu_env, f"w{worker}-{n}".encode())):
                        # another publisher stored a newer record first; no grace: gc took the bytes (even the
                        # writer's temporary file) before the record
                        with contextlib.suppress(StaleRevision, NotFound, FileNotFoundError):
                            store.publish_plan(*make_plan(key, env, blob=data), replace=True)
                            published[0] += 1
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)

        def collector() -> None:
            try:
                while not stop.is_set():
                    gc(store, grace=timedelta(0), keep_env_ids={gpu_env.env_id})
                    gc_runs[0] += 1
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=publisher, args=(w,)) for w in range(3)]
        gc_thread = threading.Thread(target=collector)
        gc_thread.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        stop.set()
        gc_thread.join(timeout=60)
        assert not errors, repr(errors[0])
        assert gc_runs[0] > 0 and published[0] > 0
        time.sleep(0.01)  # the real clock moves on, so the final pass may collect everything unreferenced
        gc(store, grace=timedelta(0), keep_env_ids={gpu_env.env_id})
        records = store.list_plans(limit=10_000)
        assert records and {r.env_id for r in records} == {gpu_env.env_id}
        for r in records:
            assert store.get_blob(r.blob_sha256) is not None, f"record {r.graph_key[:12]} lost its blob"
        # no grace: an upload whose row gc took before its bytes were written leaves a file or object no row names;
        # the final pass sweeps it
        assert _blob_digests(store) == {r.blob_sha256 for r in records}
    finally:
        store.close()


def test_cli_plans_gc(tmp_path, blob_store_url, monkeypatch, make_spec, make_plan, gpu_env, old_env):
    url = f"sqlite:///{tmp_path / 'gc.db'}"
    monkeypatch.setenv("PLANCACHE_BLOB_STORE", blob_store_url)  # the CLI's blob store
    with open_store(url, create=True) as s:
        _publish(s, make_spec, make_plan, 0, gpu_env, b"keep me")
        _publish(s, make_spec, make_plan, 1, old_env, b"old")
        s.put_blob(b"orphan")
    runner = CliRunner()
    env_file = tmp_path / "env.json"
    env_file.write_text(gpu_env.model_dump_json())

    r = runner.invoke(app, ["plans", "gc", "--grace-hours", "0", "--keep-environment", str(env_file), "--dry-run",
                            "--database-url", url])
    assert r.exit_code == 0, r.output
    assert "would delete 1 plan records" in r.output and old_env.env_id in r.output
    assert "would delete 2 unreferenced blobs" in r.output  # the orphan, and the blob only the old record holds

    # the short id `plans list` prints (12 characters) stands for the whole one
    listed = runner.invoke(app, ["plans", "list", "--database-url", url]).stdout
    assert gpu_env.env_id[:12] in listed and gpu_env.env_id not in listed
    r = runner.invoke(app, ["plans", "gc", "--grace-hours", "0", "--keep-environment", gpu_env.env_id[:12],
                            "--database-url", url])
    assert r.exit_code == 0, r.output
    assert "deleted 1 plan records" in r.output and "deleted 2 unreferenced blobs" in r.output
    with open_store(url) as s:
        assert [p.env_id for p in s.list_plans()] == [gpu_env.env_id]
        assert len(_blob_digests(s)) == 1 and s.get_blob(s.list_plans()[0].blob_sha256) == b"keep me"

    for typo in ("0" * 32, gpu_env.env_id[:11] + "x", "h200-typo.json"):  # an unknown id, a mistyped one, no file
        r = runner.invoke(app, ["plans", "gc", "--keep-environment", typo, "--database-url", url])
        assert r.exit_code == 1 and "no such environment" in r.output, r.output
        assert "cannot read environment file" not in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["plans", "gc", "--keep-environment", gpu_env.env_id[:4], "--database-url", url])
    assert r.exit_code == 2 and "at least 8 characters" in r.output
    r = runner.invoke(app, ["plans", "gc", "--grace-hours", "-1", "--database-url", url])
    assert r.exit_code == 2


def test_gc_deletes_blobs_a_bounded_batch_per_transaction(store, clock, make_spec, make_plan, gpu_env, monkeypatch):
    """Before: every collected blob went in one transaction, one DELETE request per object of a bucket: 14,000 blobs
    on a local S3 server held every write for 35 s, and a server's write failed with 'database is locked' after
    SQLite's 30 s busy timeout (1.1 s with batches). Now: GC_BATCH rows per transaction, one bucket request each."""
    key, spec = make_spec(0)
    store.put_spec(key, spec)
    meta, blob = make_plan(key, gpu_env, blob=b"in use")
    store.publish_plan(meta, blob)
    for i in range(2 * GC_BATCH + 7):
        store.put_blob(f"unreferenced {i}".encode())
    clock.advance(timedelta(days=2).total_seconds())
    young = store.put_blob(b"uploaded just now")
    writes, requests = [], []
    real_write = store.db.write
    monkeypatch.setattr(store.db, "write", lambda: (writes.append(1), real_write())[1])
    monkeypatch.setattr(ObjectStoreBlobs, "delete", lambda self, d: requests.append(1))  # would be one per blob
    real_many = ObjectStoreBlobs.delete_many
    monkeypatch.setattr(ObjectStoreBlobs, "delete_many", lambda self, ds: (requests.append(len(ds)), real_many(self, ds)))
    report = gc(store, grace=timedelta(hours=24))
    assert report.blobs_deleted == 2 * GC_BATCH + 7
    assert len(writes) >= 3  # a transaction per batch, none holding the catalog for every blob
    if store.blob_store.url.startswith("s3://"):
        assert requests == [GC_BATCH, GC_BATCH, 7]
    assert _blob_digests(store) == {meta.blob_sha256, young}
    with store.db.read() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(blobs)).scalar_one() == 2
