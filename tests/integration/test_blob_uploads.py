"""Raw blob uploads: ``PUT``/``HEAD /v1/blobs/{sha256}``, then a record published without its blob; on SQLite and
Postgres, with the blobs in the database, a folder and S3 (moto)."""

from __future__ import annotations

import base64
import hashlib
import threading
import time

import pytest

from plancache.store import retention
from tests.server_util import api, upload_json  # noqa: F401

pytestmark = pytest.mark.both_blob_stores


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _claim(api, env, make_spec, i=0):
    key, spec = make_spec(i)
    api.client.post("/v1/admin/tune", json={"specs": [spec], "targets": [{}]}, headers=api.admin)
    claim = api.client.post("/v1/jobs/claim", json={"environment": env.model_dump(), "worker_id": "w1"},
                            headers=api.worker).json()
    return key, spec, claim["job"]["id"], claim["lease_token"]


def _job_headers(api, job_id, lease, worker_id="w1"):
    return {**api.worker, "X-Plancache-Job": str(job_id), "X-Plancache-Worker": worker_id, "X-Plancache-Lease": lease}


def _put(api, data, headers, name=None):
    return api.client.put(f"/v1/blobs/{name or sha(data)}", content=data,
                          headers={**headers, "Content-Type": "application/octet-stream"})


def test_put_then_head_then_put_again(api):
    data = b"plan-bytes" * 1000
    assert api.client.head(f"/v1/blobs/{sha(data)}", headers=api.reader).status_code == 404
    r = _put(api, data, api.admin)
    assert r.status_code == 201 and r.headers["etag"] == f'"{sha(data)}"'
    h = api.client.head(f"/v1/blobs/{sha(data)}", headers=api.reader)
    assert h.status_code == 200 and h.headers["content-length"] == str(len(data)) and h.content == b""
    assert h.headers["etag"] == f'"{sha(data)}"'
    assert _put(api, data, api.admin).status_code == 200
    assert api.client.get(f"/v1/blobs/{sha(data)}", headers=api.reader).content == data


def test_bytes_that_do_not_hash_to_the_name_are_422_and_nothing_is_stored(api):
    data, other = b"A" * 5000, b"B" * 5000
    r = _put(api, data, api.admin, name=sha(other))
    assert r.status_code == 422 and r.json()["error"]["code"] == "integrity_error"
    assert api.client.head(f"/v1/blobs/{sha(other)}", headers=api.reader).status_code == 404
    assert api.store.blob_size(sha(other)) is None


def test_a_failed_upload_that_declared_another_size_does_not_keep_the_blob_from_being_published(api, gpu_env,
                                                                                               make_spec, make_plan):
    """A truncated upload (its declared length the truncated one) failed its digest check, but on the folder and
    object stores it had committed the catalog row with that size first, and the right upload after it only made the
    row new: every publish of the blob then answered 404 "upload it again", for ever. The row says the size of the
    bytes checked."""
    key, spec = make_spec(0)
    meta, blob = make_plan(key, gpu_env, blob=b"the real plan bytes " * 50)
    assert _put(api, blob[:5], api.admin, name=sha(blob)).status_code == 422
    assert _put(api, blob, api.admin).status_code in (200, 201)
    assert api.store.blob_size(sha(blob)) == len(blob)
    r = api.client.put("/v1/plans", json=upload_json(meta, spec), headers=api.admin)
    assert r.status_code == 201, r.text
    assert api.client.get(f"/v1/blobs/{sha(blob)}", headers=api.reader).content == blob


def test_an_empty_blob_is_refused_with_its_reason(api):
    """The sha256 of nothing: the database store answered 201 and stored nothing, the folder store 422 "hash to X,
    not X"."""
    r = _put(api, b"", api.admin)
    assert r.status_code == 422 and "empty" in r.json()["error"]["message"], r.text
    assert api.client.head(f"/v1/blobs/{sha(b'')}", headers=api.reader).status_code == 404


@pytest.mark.parametrize("job", ["\u00b2", "1\u00b9", "-1", " 1", "1" * 12])
def test_a_job_header_that_is_not_a_job_id_is_403(api, job):
    """``"²".isdigit()`` is true and ``int("²")`` raises: that header was a 500."""
    value = job.encode().decode("unicode_escape").encode("latin-1")
    r = api.client.put(f"/v1/blobs/{sha(b'x')}", content=b"x",
                       headers={**api.worker, "Content-Type": "application/octet-stream", "X-Plancache-Job": value,
                                "X-Plancache-Lease": "lease"})
    assert r.status_code == 403 and "X-Plancache-Job" in r.json()["error"]["message"]


def test_size_limit_and_length_rules(store):
    from tests.server_util import open_api
    with open_api(store, max_blob_bytes=1000) as a:
        r = _put(a, b"x" * 1001, a.admin)
        assert r.status_code == 413 and "PLANCACHE_MAX_BLOB_BYTES" in r.json()["error"]["message"]

        def chunked():
            yield b"x" * 10

        r = a.client.put(f"/v1/blobs/{sha(b'x' * 10)}", content=chunked(), headers=a.admin)
        assert r.status_code == 411 and r.json()["error"]["code"] == "length_required"
        assert "Content-Length" in r.json()["error"]["message"] and a.store.blob_size(sha(b"x" * 10)) is None
        assert _put(a, b"x" * 1000, a.admin).status_code == 201
        assert a.app.state.inflight.used == 0


def test_an_upload_waits_for_room_in_the_in_flight_budget_then_gets_503(store):
    """The blob's declared length is taken from the in-flight budget before its body is read (before: never
    counted, so any number of uploads ran at once): with the budget full, 503 ``server_busy`` with Retry-After
    after ``inflight_wait_seconds``, and nothing stored; with room, 201, and the bytes given back."""
    from plancache.server.bodies import DATABASE_UPLOAD_FACTOR
    from plancache.store.blobs import DatabaseBlobs
    from tests.server_util import open_api
    data = b"y" * 4096
    # into the database store, the blob and the driver's copy of it: counted DATABASE_UPLOAD_FACTOR times
    cost = len(data) * (DATABASE_UPLOAD_FACTOR if isinstance(store.blob_store, DatabaseBlobs) else 1)
    with open_api(store, max_inflight_bytes=20_000, inflight_wait_seconds=0.2) as a:
        budget = a.app.state.inflight
        assert budget.try_take(20_000 - cost + 1)  # one byte too few left
        started = time.monotonic()
        r = _put(a, data, a.admin)
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "server_busy"
        assert time.monotonic() - started >= 0.2  # it waited for room first
        assert a.store.blob_size(sha(data)) is None
        budget.release(1)
        assert _put(a, data, a.admin).status_code == 201
        assert budget.used == 20_000 - cost  # the upload gave its bytes back


def test_role_rules(api, gpu_env, make_spec):
    data = b"job-blob" * 100
    r = _put(api, data, api.reader)
    assert r.status_code == 403
    r = _put(api, data, api.worker)  # no job headers
    assert r.status_code == 403 and "X-Plancache-Job" in r.json()["error"]["message"]
    _, _, job_id, lease = _claim(api, gpu_env, make_spec)
    assert _put(api, data, _job_headers(api, job_id, "not-the-lease-token-at-all")).status_code == 409
    other, _ = api.store.create_token("test-worker-2", "worker")
    stolen = {**_job_headers(api, job_id, lease), "Authorization": f"Bearer {other}"}
    assert _put(api, data, stolen).status_code == 403
    assert api.store.blob_size(sha(data)) is None
    assert _put(api, data, _job_headers(api, job_id, lease)).status_code == 201


def test_a_worker_publishes_the_record_alone_after_putting_the_blob(api, gpu_env, make_spec, make_plan):
    key, spec, job_id, lease = _claim(api, gpu_env, make_spec)
    meta, blob = make_plan(key, gpu_env, blob=b"tuned" * 2000)
    body = {"worker_id": "w1", "lease_token": lease, "plan": upload_json(meta, spec)}
    r = api.client.post(f"/v1/jobs/{job_id}/complete", json=body, headers=api.worker)  # blob not uploaded yet
    assert r.status_code == 404 and "PUT /v1/blobs" in r.json()["error"]["message"]
    assert api.store.get_job(job_id).status == "running"  # nothing half-published
    assert _put(api, blob, _job_headers(api, job_id, lease)).status_code == 201
    r = api.client.post(f"/v1/jobs/{job_id}/complete", json=body, headers=api.worker)
    assert r.status_code == 200 and r.json()["blob_sha256"] == sha(blob)
    assert api.store.get_job(job_id).status == "succeeded"
    assert api.client.get(f"/v1/blobs/{sha(blob)}", headers=api.reader).content == blob


def test_a_record_whose_size_differs_from_the_stored_blob_is_refused(api, gpu_env, make_spec, make_plan):
    key, spec = make_spec(0)
    meta, blob = make_plan(key, gpu_env, blob=b"q" * 300)
    _put(api, blob, api.admin)
    body = upload_json(meta.model_copy(update={"blob_size": 299}), spec)
    assert api.client.put("/v1/plans", json=body, headers=api.admin).status_code == 404
    assert api.store.get_plan(key, gpu_env) is None


def test_an_unreferenced_upload_survives_gc_within_its_grace_then_goes(api, clock, gpu_env, make_spec, make_plan):
    from datetime import timedelta
    key, spec = make_spec(0)
    meta, blob = make_plan(key, gpu_env, blob=b"late" * 500)
    orphan = b"never-published" * 10
    _put(api, blob, api.admin)
    _put(api, orphan, api.admin)
    clock.advance(60)
    report = retention.gc(api.store, grace=timedelta(hours=1))
    assert report.blobs_deleted == 0
    body = upload_json(meta, spec)
    assert api.client.put("/v1/plans", json=body, headers=api.admin).status_code == 201  # a minute later
    clock.advance(2 * 3600)
    report = retention.gc(api.store, grace=timedelta(hours=1))
    assert report.blobs_deleted == 1 and api.store.blob_size(sha(orphan)) is None
    assert api.store.blob_size(sha(blob)) == len(blob)


def test_a_blob_collected_between_check_and_publish_is_refused_not_half_published(api, clock, gpu_env, make_spec,
                                                                                 make_plan, monkeypatch):
    """gc deletes the blob after publish's presence check: the transaction finds no catalog row, 404, no record."""
    from datetime import timedelta

    from plancache.store import plans as store_plans
    key, spec = make_spec(0)
    meta, blob = make_plan(key, gpu_env, blob=b"gone" * 500)
    _put(api, blob, api.admin)
    api.store.put_spec(key, spec)
    clock.advance(7200)
    real = store_plans.Plans._stored_size

    def check_then_gc(self, sha256):
        size = real(self, sha256)
        retention.gc(api.store, grace=timedelta(hours=1))
        return size

    monkeypatch.setattr(store_plans.Plans, "_stored_size", check_then_gc)
    body = upload_json(meta, spec)
    r = api.client.put("/v1/plans", json=body, headers=api.admin)
    assert r.status_code == 404 and "collected" in r.json()["error"]["message"]
    assert api.store.get_plan(key, gpu_env) is None


def test_an_inline_blob_is_refused_and_nothing_is_stored(api, gpu_env, make_spec, make_plan):
    """A plan upload that carries its blob (``blob_b64``, an outdated worker) is 422 saying to PUT the blob raw
    first; neither blob nor record is stored."""
    key, spec = make_spec(0)
    meta, blob = make_plan(key, gpu_env, blob=b"inline" * 100)
    r = api.client.put("/v1/plans", json=upload_json(meta, spec, blob_b64=base64.b64encode(blob).decode()),
                       headers=api.admin)
    assert r.status_code == 422 and "PUT /v1/blobs/{sha256} first" in r.json()["error"]["message"], r.text
    assert api.client.head(f"/v1/blobs/{sha(blob)}", headers=api.reader).status_code == 404
    assert api.store.get_plan(key, gpu_env) is None


def test_no_database_write_lock_is_held_while_blob_bytes_are_written(store, blob_store_url, make_spec, make_plan,
                                                                     gpu_env, monkeypatch):
    """A slow blob store (1.5 s per put): a concurrent write (a spec registered, as a claim or resolve miss would
    write) is not held up. Before, publish wrote the bytes inside its write transaction: on SQLite the other writer
    waited the whole 1.5 s."""
    if blob_store_url == "database":
        pytest.skip("the database's bytes are its rows: written in the transaction")
    content = store.blob_store.content
    real_put = content.put

    def slow_put(sha256, data):
        time.sleep(1.5)
        real_put(sha256, data)

    monkeypatch.setattr(content, "put", slow_put)
    key, spec = make_spec(0)
    store.put_spec(key, spec)
    meta, blob = make_plan(key, gpu_env, blob=b"slow" * 1000)
    publishing = threading.Thread(target=store.publish_plan, args=(meta, blob))
    publishing.start()
    time.sleep(0.5)  # the put is under way
    started = time.monotonic()
    other_key, other_spec = make_spec(1)
    store.put_spec(other_key, other_spec)
    waited = time.monotonic() - started
    publishing.join()
    assert waited < 0.5, f"a concurrent write waited {waited:.2f} s for the blob write"
    assert store.get_plan(key, gpu_env).blob_sha256 == sha(blob)
