"""A server whose ``PLANCACHE_BLOB_STORE`` is ``s3://bucket/prefix`` (moto's S3 server), over real HTTP: publish
puts the object, resolve and ``GET /v1/blobs`` serve it (a large one streamed from the bucket, cut off when the
object turns out damaged), gc deletes the object of a blob no record references."""

from __future__ import annotations

import errno
import hashlib
import os
from datetime import timedelta
from pathlib import Path

import httpx
import pytest

from plancache.blobs import ObjectStoreBlobs, open_blobs
from plancache.blobs.objects import CIRCUIT_SECONDS
from plancache.errors import BlobStoreUnavailable
from plancache.store.retention import gc

from ..live_server import LiveServer
from ..server_util import bearer, put_blob, upload, upload_json

SMALL = b"\x03plan bytes" * 500
LARGE = os.urandom(300_000)  # over the item limit of a 16 KiB blob memory: streamed from the bucket


def test_a_server_on_s3_publishes_serves_and_collects_blobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            s3_blob_url: str, make_spec, make_plan, gpu_env):
    monkeypatch.setenv("PLANCACHE_BLOB_STORE", s3_blob_url)
    bucket = open_blobs(s3_blob_url)
    assert isinstance(bucket, ObjectStoreBlobs)
    with LiveServer(tmp_path, blob_memory_bytes=16 * 1024) as srv:
        assert srv.store.blob_store.url == s3_blob_url
        admin, reader = bearer(srv.admin_token), bearer(srv.token("reader"))
        keys = []
        for i, blob in enumerate((SMALL, LARGE)):
            key, spec = make_spec(i)
            meta, _ = make_plan(key, gpu_env, blob=blob)
            r = upload(httpx, meta, blob, spec, headers=admin, url=srv.url)
            assert r.status_code == 201, r.text
            assert bucket.get(meta.blob_sha256) == blob, "the object is in the bucket"
            keys.append((key, meta))

        body = {"environment": gpu_env.model_dump(), "graph_keys": [k for k, _ in keys], "include_blobs": True}
        plans = httpx.post(f"{srv.url}/v1/plans/resolve", json=body, headers=reader, timeout=30).json()["plans"]
        assert all(plans[k]["blob_b64"] is None for k, _ in keys)  # presigned URLs instead: no token, from the bucket
        assert [httpx.get(plans[k]["blob_url"], timeout=30).content for k, _ in keys] == [SMALL, LARGE]
        for (_, meta), blob in zip(keys, (SMALL, LARGE)):
            r = httpx.get(f"{srv.url}/v1/blobs/{meta.blob_sha256}", headers=reader, timeout=30)
            assert r.status_code == 200 and r.content == blob and r.headers["etag"] == f'"{meta.blob_sha256}"'

        large = keys[1][1].blob_sha256
        _damage(s3_blob_url, large)
        with pytest.raises(httpx.RemoteProtocolError):  # the answer ends before its Content-Length: never whole
            httpx.get(f"{srv.url}/v1/blobs/{large}", headers=reader, timeout=30)
        small = keys[0][1].blob_sha256
        (key, _), replacement = keys[0], b"\x04a better plan" * 400
        meta, _ = make_plan(key, gpu_env, blob=replacement)
        r = upload(httpx, meta, replacement, headers=admin, url=srv.url, replace=True)
        assert r.status_code == 200, r.text
        report = gc(srv.store, grace=timedelta(0))
        assert report.blobs_deleted == 1 and not bucket.has(small), "gc deleted the object"
        assert bucket.get(hashlib.sha256(replacement).hexdigest()) == replacement


def _damage(s3_blob_url: str, digest: str) -> None:
    """Overwrite the object behind the server's back with other bytes of the same size."""
    import obstore
    from obstore.store import from_url

    obstore.put(from_url(s3_blob_url), f"{digest[:2]}/{digest[2:4]}/{digest}", bytes(len(LARGE)))


def test_an_unreachable_object_store_is_a_503_to_retry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       s3_blob_url: str, make_spec, make_plan, gpu_env):
    """The bucket's endpoint goes away under a running server: an upload and a blob read are 503
    ``blob_store_unavailable`` with ``Retry-After`` (not a 500 with a traceback), and nothing is half-published."""
    from ..live_server import free_port

    monkeypatch.setenv("PLANCACHE_BLOB_STORE", s3_blob_url)
    with LiveServer(tmp_path, blob_memory_bytes=16 * 1024) as srv:
        admin = bearer(srv.admin_token)
        key, spec = make_spec(0)
        meta, _ = make_plan(key, gpu_env, blob=LARGE)
        assert upload(httpx, meta, LARGE, spec, headers=admin, url=srv.url).status_code == 201
        store = srv.store.blob_store
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nobody listens there
        store.content = open_blobs(s3_blob_url)  # the server's client now points at the dead endpoint
        r = httpx.get(f"{srv.url}/v1/blobs/{meta.blob_sha256}", headers=admin, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == str(CIRCUIT_SECONDS), r.text
        assert r.json()["error"]["code"] == "blob_store_unavailable"
        key2, spec2 = make_spec(1)
        meta2, _ = make_plan(key2, gpu_env, blob=SMALL)
        r = put_blob(httpx, SMALL, admin, url=srv.url, check=False)
        assert r.status_code == 503 and r.json()["error"]["code"] == "blob_store_unavailable", r.text
        r = httpx.put(f"{srv.url}/v1/plans", json=upload_json(meta2, spec2), headers=admin, timeout=30)
        assert r.status_code in (404, 503), r.text
        assert srv.store.get_plan(key2, gpu_env) is None, "no record names bytes that were not stored"


def test_a_missing_bucket_is_a_503_not_a_500(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3_blob_url: str):
    """The bucket is gone (deleted, or a typo in PLANCACHE_BLOB_STORE on a new database): an upload is 503
    ``blob_store_unavailable``, as for an unreachable endpoint or wrong credentials, not a 500 (obstore raises a bare
    FileNotFoundError for S3's NoSuchBucket)."""
    from plancache.errors import BlobStoreUnavailable

    gone = s3_blob_url.replace("s3://", "s3://no-such-", 1)
    monkeypatch.setenv("PLANCACHE_BLOB_STORE", gone)
    with LiveServer(tmp_path) as srv:
        r = put_blob(httpx, SMALL, bearer(srv.admin_token), url=srv.url, check=False)
        assert r.status_code == 503 and r.json()["error"]["code"] == "blob_store_unavailable", r.text
    with pytest.raises(BlobStoreUnavailable, match="no-such-"):
        open_blobs(gone).put(hashlib.sha256(SMALL).hexdigest(), SMALL)


def test_a_not_found_write_to_a_bucket_that_exists_stays_a_not_found(s3_blob_url: str,
                                                                     monkeypatch: pytest.MonkeyPatch):
    """A 404 during a write to a bucket that exists (a multipart upload gone meanwhile: S3's NoSuchUpload on its
    abort) is the FileNotFoundError it is, for the caller to handle as a lost race, not 'the bucket does not
    exist'. It carries errno ENOENT, which the server answers 503, retry (as a folder's file removed while written)."""
    blobs = open_blobs(s3_blob_url)
    assert isinstance(blobs, ObjectStoreBlobs)

    def gone(*_args: object, **_kw: object) -> None:
        raise FileNotFoundError("Object at location blobs/ab/cd/x not found: NoSuchUpload")

    monkeypatch.setattr(blobs._obs, "put", gone)
    with pytest.raises(FileNotFoundError, match="NoSuchUpload") as raised:
        blobs.put(hashlib.sha256(SMALL).hexdigest(), SMALL)
    assert not isinstance(raised.value, BlobStoreUnavailable) and raised.value.errno == errno.ENOENT
