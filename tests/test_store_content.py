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
