"""``plancache plans gc`` on a file blob store also deletes what crashes left in the folder once older than the
grace period: writers' temporary files, and blob files no catalog row names; a blob a row names is never touched
(also when a publish of an old orphan's bytes comes in while gc runs), nor anything that is not a blob's file.
On an S3 blob store (moto's server) the same for the bucket's objects, listed and swept a page at a time."""

from __future__ import annotations

import hashlib
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from plancache.blobs import FolderBlobs, ObjectStoreBlobs, objects
from plancache.cli import app
from plancache.store import open_store
from plancache.store.retention import gc

HOUR = timedelta(hours=1)


@pytest.fixture
def folder_store(db_url: str, clock: Any, tmp_path: Path) -> Any:
    s = open_store(db_url, create=True, clock=clock, blob_store=(tmp_path / "blobs").as_uri())
    try:
        yield s
    finally:
        s.close()


def _age(path: Path, hours: float) -> Path:
    """``path``, last modified ``hours`` ago."""
    then = time.time() - hours * 3600
    os.utime(path, (then, then))
    return path


def _file(store: Any, sha256: str) -> Path:
    return store.blob_store.folder.root / sha256[:2] / sha256[2:4] / sha256


def _orphan(store: Any, data: bytes) -> Path:
    """A blob file without a catalog row: what a publish that crashed before its commit leaves."""
    sha256 = hashlib.sha256(data).hexdigest()
    store.blob_store.folder.put(sha256, data)
    return _file(store, sha256)


def _temporary(store: Any, data: bytes) -> Path:
    """A writer's temporary file, as a writer that died before its rename leaves it."""
    sha256 = hashlib.sha256(data).hexdigest()
    folder = store.blob_store.folder.root / sha256[:2] / sha256[2:4]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f".{sha256}.k3j9x_q1.tmp"
    path.write_bytes(data[:3])
    return path


def _publish(store: Any, make_spec: Any, make_plan: Any, i: int, env: Any, blob: bytes) -> Path:
    key, spec = make_spec(i)
    store.put_spec(key, spec)
    meta, data = make_plan(key, env, blob=blob)
    store.publish_plan(meta, data)
    return _file(store, meta.blob_sha256)


def test_temporaries_older_than_the_grace_period_go_and_younger_ones_stay(folder_store):
    old, young = _age(_temporary(folder_store, b"crashed long ago"), 2), _temporary(folder_store, b"being written")
    report = gc(folder_store, grace=HOUR)
    assert not old.exists() and young.exists()
    assert (report.temporaries_deleted, report.orphans_deleted, report.leftover_bytes_freed) == (1, 0, 3)


def test_an_orphan_file_goes_only_after_the_grace_period(folder_store):
    orphan = _orphan(folder_store, b"its publish crashed before the commit")
    assert gc(folder_store, grace=HOUR).orphans_deleted == 0 and orphan.exists()
    _age(orphan, 0.9)
    assert gc(folder_store, grace=HOUR).orphans_deleted == 0 and orphan.exists()
    _age(orphan, 1.1)
    report = gc(folder_store, grace=HOUR)
    assert not orphan.exists() and (report.orphans_deleted, report.leftover_bytes_freed) == (1, 37)


def test_blobs_a_row_names_are_never_touched(folder_store, make_spec, make_plan, gpu_env):
    referenced = _age(_publish(folder_store, make_spec, make_plan, 0, gpu_env, b"in use"), 24 * 400)
    cataloged = folder_store.put_blob(b"uploaded; its record still on its way")
    unreferenced = _age(_file(folder_store, cataloged), 24 * 400)  # its row is younger than the grace period
    report = gc(folder_store, grace=HOUR)
    assert (report.blobs_deleted, report.temporaries_deleted, report.orphans_deleted) == (0, 0, 0)
    assert referenced.read_bytes() == b"in use" and unreferenced.exists()


def test_nothing_but_blob_files_and_temporaries_is_touched(folder_store, tmp_path):
    root = folder_store.blob_store.folder.root
    outside = tmp_path / "outside"
    outside.write_bytes(b"not the store's")
    sha256 = hashlib.sha256(b"x").hexdigest()
    (root / sha256[:2] / sha256[2:4]).mkdir(parents=True)
    strays = [root / "README", root / sha256[:2] / "notes.txt", root / "00" / "00" / sha256,  # wrong shard
              root / sha256[:2] / sha256[2:4] / f"{sha256}.bak"]
    for path in strays:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"keep")
        _age(path, 48)
    link = root / sha256[:2] / sha256[2:4] / sha256
    link.symlink_to(outside)
    report = gc(folder_store, grace=HOUR)
    assert (report.temporaries_deleted, report.orphans_deleted) == (0, 0)
    assert all(p.read_bytes() == b"keep" for p in strays) and link.is_symlink() and outside.exists()


def test_a_publish_of_an_old_orphans_bytes_while_gc_runs_keeps_them(folder_store, make_spec, make_plan, gpu_env,
                                                                     monkeypatch):
    orphan = _age(_orphan(folder_store, b"published again"), 48)
    listed = FolderBlobs.files_older_than

    def listing_then_a_publish(self: FolderBlobs, cutoff: float) -> Any:
        found = list(listed(self, cutoff))  # gc has listed the old orphan; now a publish finds the bytes present
        _publish(folder_store, make_spec, make_plan, 0, gpu_env, b"published again")
        return iter(found)

    monkeypatch.setattr(FolderBlobs, "files_older_than", listing_then_a_publish)
    assert gc(folder_store, grace=HOUR).orphans_deleted == 0
    assert orphan.read_bytes() == b"published again"
    assert folder_store.get_blob(hashlib.sha256(b"published again").hexdigest()) == b"published again"


def test_a_file_renamed_away_while_the_folder_is_listed_is_skipped(folder_store, monkeypatch):
    """A writer's temporary file renamed into place (or deleted) between the folder's listing and its ``stat``
    is not gc's error: the sweep goes on with the other files."""
    gone = _age(_temporary(folder_store, b"renamed meanwhile"), 48)
    stays = _age(_temporary(folder_store, b"crashed"), 48)
    scandir = os.scandir

    class Listing:
        def __init__(self, path: Any) -> None:
            self.entries = scandir(path)

        def __enter__(self) -> Any:
            for entry in self.entries.__enter__():
                if entry.path == str(gone):
                    gone.unlink()  # listed, then gone before its stat
                yield entry

        def __exit__(self, *exc: Any) -> None:
            self.entries.__exit__(*exc)

    monkeypatch.setattr("plancache.blobs.folder.os.scandir", Listing)
    report = gc(folder_store, grace=HOUR)
    assert report.temporaries_deleted == 1 and not stays.exists() and not gone.exists()


def test_cli_plans_gc_reports_and_dry_runs_the_sweep(tmp_path, monkeypatch):
    url, folder = f"sqlite:///{tmp_path / 'gc.db'}", tmp_path / "blobs"
    monkeypatch.setenv("PLANCACHE_BLOB_STORE", folder.as_uri())
    with open_store(url, create=True) as s:
        temporary, orphan = _age(_temporary(s, b"crashed"), 30), _age(_orphan(s, b"orphan"), 30)
    runner = CliRunner()
    r = runner.invoke(app, ["plans", "gc", "--dry-run", "--database-url", url])
    assert r.exit_code == 0, r.output
    assert "would delete 1 temporary files of crashed writers and 1 blob files no catalog row names (9 bytes)" \
        in r.output and temporary.exists() and orphan.exists()
    r = runner.invoke(app, ["plans", "gc", "--database-url", url])
    assert r.exit_code == 0 and "deleted 1 temporary files" in r.output, r.output
    assert not temporary.exists() and not orphan.exists()


# ------------------------------------------------------------------ a bucket (moto's S3 server)


@pytest.fixture
def bucket_store(db_url: str, clock: Any, s3_blob_url: str) -> Any:
    s = open_store(db_url, create=True, clock=clock, blob_store=s3_blob_url)
    try:
        yield s
    finally:
        s.close()


def _bucket(store: Any) -> ObjectStoreBlobs:
    content = store.blob_store.content
    assert isinstance(content, ObjectStoreBlobs)
    return content


def _orphan_object(store: Any, data: bytes) -> str:
    """An object without a catalog row, written now (moto's clock; S3 cannot date one back): what an upload whose
    row gc took before its bytes were written leaves, or a publish that crashed before its commit."""
    sha256 = hashlib.sha256(data).hexdigest()
    _bucket(store).put(sha256, data)
    return sha256


def _keys(store: Any) -> set[str]:
    import obstore
    from obstore.store import from_url

    return {meta["path"] for page in obstore.list(from_url(store.blob_store.url)) for meta in page}


def test_an_orphan_object_goes_only_after_the_grace_period(bucket_store, clock):
    orphan = _orphan_object(bucket_store, b"its publish crashed before the commit")
    assert gc(bucket_store, grace=HOUR).orphans_deleted == 0 and _bucket(bucket_store).has(orphan)
    clock.advance(0.9 * 3600)
    assert gc(bucket_store, grace=HOUR).orphans_deleted == 0 and _bucket(bucket_store).has(orphan)
    clock.advance(0.2 * 3600)
    dry = gc(bucket_store, grace=HOUR, dry_run=True)
    assert (dry.orphans_deleted, dry.leftover_bytes_freed) == (1, 37) and _bucket(bucket_store).has(orphan)
    report = gc(bucket_store, grace=HOUR)
    assert (report.orphans_deleted, report.leftover_bytes_freed, report.temporaries_deleted) == (1, 37, 0)
    assert not _bucket(bucket_store).has(orphan) and _keys(bucket_store) == set()


def test_objects_a_row_names_are_never_touched(bucket_store, clock, make_spec, make_plan, gpu_env):
    clock.advance(2 * 3600)  # the objects, written at the real time, are two hours older than their rows
    key, spec = make_spec(0)
    bucket_store.put_spec(key, spec)
    meta, data = make_plan(key, gpu_env, blob=b"in use")
    bucket_store.publish_plan(meta, data)
    cataloged = bucket_store.put_blob(b"uploaded; its record still on its way")
    report = gc(bucket_store, grace=HOUR)
    assert (report.blobs_deleted, report.orphans_deleted) == (0, 0)
    assert bucket_store.get_blob(meta.blob_sha256) == b"in use" and _bucket(bucket_store).has(cataloged)


def test_nothing_but_blob_objects_is_touched(bucket_store, clock):
    import obstore
    from obstore.store import from_url

    sha256 = hashlib.sha256(b"x").hexdigest()
    under_prefix = from_url(bucket_store.blob_store.url)
    strays = ["README", f"{sha256[:2]}/notes.txt", f"00/00/{sha256}", f"{sha256[:2]}/{sha256[2:4]}/{sha256}.bak",
              f"{sha256[:2]}/{sha256[2:4]}/{sha256.upper()}", sha256]
    for stray in strays:
        obstore.put(under_prefix, stray, b"keep")
    bucket_root = bucket_store.blob_store.url.rsplit("/", 1)[0]
    obstore.put(from_url(bucket_root), f"elsewhere/{sha256[:2]}/{sha256[2:4]}/{sha256}", b"not the store's")
    clock.advance(2 * 3600)
    assert gc(bucket_store, grace=HOUR).orphans_deleted == 0
    assert _keys(bucket_store) == set(strays)
    assert bytes(obstore.get(from_url(bucket_root), f"elsewhere/{sha256[:2]}/{sha256[2:4]}/{sha256}").bytes()) \
        == b"not the store's"


def test_a_bucket_is_swept_a_page_at_a_time(bucket_store, clock, make_spec, make_plan, gpu_env, monkeypatch):
    """Each page of the listing is looked up and swept in a transaction of its own: memory and the time the
    catalog is held stay bounded however many objects the bucket holds."""
    monkeypatch.setattr(objects, "LIST_BATCH", 3)
    orphans = {_orphan_object(bucket_store, f"orphan {i}".encode()) for i in range(7)}
    key, spec = make_spec(0)
    bucket_store.put_spec(key, spec)
    meta, data = make_plan(key, gpu_env, blob=b"in use")
    bucket_store.publish_plan(meta, data)
    pages: list[int] = []
    listed = ObjectStoreBlobs.objects_older_than

    def counted(self: ObjectStoreBlobs, cutoff: Any) -> Any:
        for page in listed(self, cutoff):
            pages.append(len(page))
            yield page

    monkeypatch.setattr(ObjectStoreBlobs, "objects_older_than", counted)
    clock.advance(2 * 3600)
    report = gc(bucket_store, grace=HOUR)
    assert report.orphans_deleted == 7 and not any(_bucket(bucket_store).has(o) for o in orphans)
    assert sum(pages) == 8 and max(pages) <= 3  # the referenced blob's object is listed too, and kept
    assert bucket_store.get_blob(meta.blob_sha256) == b"in use"


def test_a_publish_of_an_old_orphan_objects_bytes_while_gc_runs_keeps_them(bucket_store, clock, make_spec, make_plan,
                                                                            gpu_env, monkeypatch):
    orphan = _orphan_object(bucket_store, b"published again")
    listed = ObjectStoreBlobs.objects_older_than

    def listing_then_a_publish(self: ObjectStoreBlobs, cutoff: Any) -> Any:
        for page in listed(self, cutoff):  # gc has listed the old orphan; now a publish finds the bytes present
            key, spec = make_spec(0)
            bucket_store.put_spec(key, spec)
            bucket_store.publish_plan(*make_plan(key, gpu_env, blob=b"published again"))
            yield page

    monkeypatch.setattr(ObjectStoreBlobs, "objects_older_than", listing_then_a_publish)
    clock.advance(2 * 3600)
    assert gc(bucket_store, grace=HOUR).orphans_deleted == 0
    assert bucket_store.get_blob(orphan) == b"published again"


def test_cli_plans_gc_reports_and_dry_runs_the_bucket_sweep(tmp_path, monkeypatch, s3_blob_url):
    url = f"sqlite:///{tmp_path / 'gc.db'}"
    monkeypatch.setenv("PLANCACHE_BLOB_STORE", s3_blob_url)
    with open_store(url, create=True) as s:
        orphans = [_orphan_object(s, b"orphan"), _orphan_object(s, b"another")]
    time.sleep(0.01)  # the real clock: with no grace, what was written before gc started is old enough
    runner = CliRunner()
    r = runner.invoke(app, ["plans", "gc", "--dry-run", "--grace-hours", "0", "--database-url", url])
    assert r.exit_code == 0, r.output
    assert "would delete 2 objects no catalog row names (13 bytes)" in r.output
    with open_store(url) as s:
        assert all(_bucket(s).has(o) for o in orphans)
        r = runner.invoke(app, ["plans", "gc", "--grace-hours", "0", "--database-url", url])
        assert r.exit_code == 0 and "deleted 2 objects no catalog row names (13 bytes)" in r.output, r.output
        assert not any(_bucket(s).has(o) for o in orphans)
