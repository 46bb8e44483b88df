"""Specs and content-addressed blobs, on SQLite and Postgres."""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import sqlalchemy as sa

from plancache import errors
from plancache.spec import graph_key, parse_spec
from plancache.store.models import blobs

pytestmark = pytest.mark.both_blob_stores

def test_put_spec_stores_the_canonical_form_once(store, make_spec):
    key, spec = make_spec(0)
    assert store.put_spec(key, spec) is True
    assert store.put_spec(key, spec) is False
    renamed = {**spec, "name": "cosmetic names are not part of the key"}
    assert store.put_spec(key, renamed) is False
    stored = store.get_spec(key)
    assert stored == parse_spec(spec).canonical_document().to_json() and graph_key(stored) == key
    assert store.get_spec("0" * 64) is None


def test_put_spec_refuses_a_wrong_key_and_an_invalid_spec(store, make_spec):
    key, spec = make_spec(0)
    other_key, _ = make_spec(1)
    with pytest.raises(errors.IntegrityError, match="does not match"):
        store.put_spec(other_key, spec)
    with pytest.raises(errors.SpecError):
        store.put_spec(key, {**spec, "nodes": []})
    assert store.get_spec(key) is None and store.get_spec(other_key) is None
    changed = parse_spec(spec)
    assert changed.graph_key == key
    changed.tensors[0].dim[0] += 1  # in place, after its key was worked out: the key is checked against the content
    with pytest.raises(errors.IntegrityError, match="does not match"):
        store.put_spec(key, changed)
    assert store.put_spec(graph_key(changed.to_json()), changed) is True


def test_put_spec_conflicts_when_the_stored_canonical_form_differs(store, make_spec):
    key, spec = make_spec(0)
    store.put_spec(key, spec)
    with store.engine.begin() as conn:  # as if stored by a version that canonicalised differently
        conn.execute(sa.text("UPDATE specs SET canonical_json = '{}' WHERE graph_key = :k"), {"k": key})
    with pytest.raises(errors.Conflict, match=key):
        store.put_spec(key, spec)


def test_blobs_are_content_addressed(store):
    data = b"\x00plan bytes\xff" * 100
    digest = store.put_blob(data)
    assert digest == hashlib.sha256(data).hexdigest()
    assert store.put_blob(data) == digest
    assert store.get_blob(digest) == data and store.blob_size(digest) == len(data)
    assert store.get_blob("0" * 64) is None and store.blob_size("0" * 64) is None
    with pytest.raises(errors.IntegrityError):
        store.put_blob(b"")


def test_concurrent_identical_uploads_store_one_blob_row(store):
    data = b"the same serialized plan" * 1000
    start = threading.Barrier(50)

    def upload() -> str:
        start.wait()
        return store.put_blob(data)

    with ThreadPoolExecutor(50) as pool:
        digests = {f.result(timeout=60) for f in [pool.submit(upload) for _ in range(50)]}
    assert digests == {hashlib.sha256(data).hexdigest()}
    with store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(blobs)).scalar_one() == 1


# ------------------------------------------------------------------ the blob store seam (plancache.store.blobs)


def test_blob_store_contract(store):
    """put/get/has/size/delete/get_many of the configured backend, under a catalog row as the store writes it."""
    from plancache.store.content import insert_blob_row

    data, bs = b"\x01blob bytes" * 500, store.blob_store
    digest = hashlib.sha256(data).hexdigest()
    with store.db.write() as conn:
        insert_blob_row(conn, digest, len(data), store.db.now())
        assert not bs.has(conn, digest) and bs.size(conn, digest) is None and bs.get(conn, digest) is None
        with pytest.raises(errors.IntegrityError, match="hash"):
            bs.put(conn, digest, data + b"!")
        assert not bs.has(conn, digest)
        bs.put(conn, digest, data)
        bs.put(conn, digest, data)  # idempotent
        assert bs.has(conn, digest) and bs.size(conn, digest) == len(data) and bs.get(conn, digest) == data
        assert bs.get_many(conn, [digest, "0" * 64]) == {digest: data} and bs.get_many(conn, []) == {}
        bs.delete(conn, digest)
        bs.delete(conn, digest)
        assert not bs.has(conn, digest) and bs.get(conn, digest) is None


def test_file_blob_store_layout_and_atomic_writes(tmp_path):
    from plancache.store.blobs import ContentBlobs, open_blob_store

    root = tmp_path / "shared volume"
    bs = open_blob_store(root.as_uri())
    assert isinstance(bs, ContentBlobs) and bs.folder is not None and bs.folder.root == root
    assert bs.url == root.as_uri()
    data = b"plan" * 1000
    digest = hashlib.sha256(data).hexdigest()
    bs.put(None, digest, data)  # the file backend needs no connection
    path = root / digest[:2] / digest[2:4] / digest
    assert path.read_bytes() == data and bs.open(digest).read() == data
    assert [p for p in root.rglob("*") if p.is_file()] == [path], "no temporary file is left behind"
    assert path.stat().st_mode & 0o777 == 0o644
    path.write_bytes(data[:10])  # a damaged copy is rewritten whole
    bs.put(None, digest, data)
    assert bs.get(None, digest) == data
    with pytest.raises(ValueError, match="sha256"):
        bs.get(None, "../" + digest[3:])
    for bad in ("file://relative/path", "file:///x?y=1", "databases", "memory://", "https://server"):
        with pytest.raises(ValueError, match="'database', file:///absolute/path or s3://bucket/prefix"):
            open_blob_store(bad)


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    from plancache import files
    from plancache.blobs import FolderBlobs
    from plancache.store.blobs import ContentBlobs

    bs = ContentBlobs(FolderBlobs(tmp_path))
    data = b"never lands"
    digest = hashlib.sha256(data).hexdigest()

    def crash(*args: object) -> None:
        raise OSError("rename failed")

    monkeypatch.setattr(files.os, "replace", crash)  # after the temporary file is written and synced
    with pytest.raises(OSError, match="rename failed"):
        bs.put(None, digest, data)
    assert not bs.has(None, digest) and [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_a_store_refuses_the_wrong_blob_store(db_url, tmp_path, make_spec, make_plan, gpu_env):
    from plancache.store import open_store
    from plancache.store.blobs import probe_blob_store

    folder, elsewhere = (tmp_path / "blobs").as_uri(), (tmp_path / "unmounted").as_uri()
    with open_store(db_url, create=True) as s:
        s.put_blob(b"held in the database")
    with pytest.raises(errors.BlobStoreMismatch, match="migrate-blobs"):
        open_store(db_url, blob_store=folder)
    with open_store(db_url, blob_store=folder, check_blobs=False) as s:
        with s.db.write() as conn:
            conn.execute(sa.update(blobs).values(data=b""))  # as if moved to a folder
        key, spec = make_spec(0)
        s.put_spec(key, spec)
        s.publish_plan(*make_plan(key, gpu_env))
    with pytest.raises(errors.BlobStoreMismatch, match="PLANCACHE_BLOB_STORE"):
        open_store(db_url)
    with open_store(db_url, blob_store=elsewhere) as s:  # the wrong folder is reported, not refused
        assert "the volume mounted" in (probe_blob_store(s.db, s.blob_store) or "")
    with open_store(db_url, blob_store=folder) as s:
        assert probe_blob_store(s.db, s.blob_store) is None
