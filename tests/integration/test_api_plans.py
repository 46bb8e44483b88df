"""HTTP API: specs, plan uploads, resolve, record lookup and blobs, on SQLite and Postgres."""

from __future__ import annotations

import base64
import json

import pytest

from plancache.protocol import PlanMeta, PlanRecord, ResolvedPlan, ResolveResponse, b64encode
from plancache.server.routes import plans as plans_routes
from plancache.spec import parse_spec
from plancache.validation import from_answer
from tests.factories import make_meta, new_signer, stored_plans, trusted
from tests.server_util import api, env_query, open_api, put_blob, sha, upload, upload_json  # noqa: F401

pytestmark = pytest.mark.both_blob_stores

# ------------------------------------------------------------------ specs


def test_spec_register_is_idempotent_and_reads_back_canonical(api, make_spec):
    key, spec = make_spec(0)
    r = api.client.post("/v1/specs", json=spec, headers=api.worker)
    assert r.status_code == 201 and r.json() == {"graph_key": key, "created": True}
    r = api.client.post("/v1/specs", json=spec, headers=api.admin)
    assert r.status_code == 200 and r.json() == {"graph_key": key, "created": False}
    r = api.client.get(f"/v1/specs/{key}", headers=api.reader)
    assert r.status_code == 200 and r.json() == parse_spec(spec).canonical_document().to_json()


def test_malformed_spec_is_422_naming_the_problem(api, make_spec):
    _, spec = make_spec(0)
    spec["nodes"][0]["type"] = "FROBNICATE"
    r = api.client.post("/v1/specs", json=spec, headers=api.worker)
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "invalid_spec" and "FROBNICATE" in r.json()["error"]["message"]
    r = api.client.post("/v1/specs", json=[1, 2], headers=api.worker)
    assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error"


def test_a_spec_of_a_128_tib_tensor_is_refused_naming_it(api):
    """A reader once stored a 2^20 x 2^20 x 64 bf16 tensor (128 TiB) and was answered 201."""
    def tensor(uid, name, dim):
        return {"uid": uid, "name": name, "data_type": "BFLOAT16", "dim": dim}

    spec = {"schema": 2, "tensors": [tensor(1, "A", [2**20, 2**20, 64]), tensor(2, "B", [2**20, 64, 1]),
                                     tensor(3, "Y", [])],
            "nodes": [{"type": "MATMUL", "inputs": {"A": 1, "B": 2}, "outputs": {"C": 3}}]}
    r = api.client.post("/v1/specs", json=spec, headers=api.reader)
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_spec"
    assert "tensor 'A'" in r.json()["error"]["message"] and "2^40 elements" in r.json()["error"]["message"]


def test_a_schema_1_spec_is_422_saying_it_is_no_longer_read(api):
    """Before: the server converted schema 1 (the op-list format) and stored it. After: 422 naming how to rewrite it."""
    legacy = {"schema": 1, "io_data_type": "float32",
              "tensors": {"X": {"dims": [1], "strides": [1], "dtype": "float32"}},
              "nodes": [{"op": "relu", "inputs": {"input": "X"}, "outputs": {"output": "Y"}}],
              "outputs": {"Y": {"dims": [1], "strides": [1], "dtype": "float32"}}}
    r = api.client.post("/v1/specs", json=legacy, headers=api.worker)
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_spec"
    message = r.json()["error"]["message"]
    assert "schema 1" in message and "no longer read" in message and "SpecBuilder" in message


def test_unknown_and_malformed_spec_keys(api):
    r = api.client.get("/v1/specs/" + "0" * 64, headers=api.reader)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found" and "0" * 64 in r.json()["error"]["message"]
    r = api.client.get("/v1/specs/NOT-A-KEY", headers=api.reader)
    assert r.status_code == 422 and "graph_key" in r.json()["error"]["message"]


# ------------------------------------------------------------------ uploads


@pytest.fixture
def published(api, make_spec, make_plan, gpu_env):
    """Two plans on ``gpu_env`` uploaded over HTTP: ``[(key, meta, blob), ...]``."""
    out = []
    for i in range(2):
        key, spec = make_spec(i)
        meta, blob = make_plan(key, gpu_env, blob=f"plan-blob-{i}".encode() * 100)
        r = upload(api.client, meta, blob, spec, headers=api.admin)  # uploads with no job
        assert r.status_code == 201, r.text
        out.append((key, meta, blob))
    return out


def test_put_plan_new_then_idempotent_then_conflict(api, published, make_plan, gpu_env):
    key, meta, blob = published[0]
    record = api.store.get_plan(key, gpu_env)
    assert record is not None and record.blob_sha256 == sha(blob)
    r = upload(api.client, meta, blob, headers=api.admin)
    assert r.status_code == 200 and r.json()["blob_sha256"] == sha(blob)
    other_meta, other_blob = make_plan(key, gpu_env, blob=b"a different plan")
    r = upload(api.client, other_meta, other_blob, headers=api.admin)
    assert r.status_code == 409 and r.json()["error"]["code"] == "conflict"
    assert api.store.get_plan(key, gpu_env).blob_sha256 == sha(blob)


def test_replace_needs_admin(api, published, make_plan, gpu_env):
    key, _, _ = published[0]
    meta, blob = make_plan(key, gpu_env, blob=b"a better plan")
    put_blob(api.client, blob, api.admin)
    body = upload_json(meta, replace=True)
    r = api.client.put("/v1/plans", json=body, headers=api.worker)
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    r = api.client.put("/v1/plans", json=body, headers=api.admin)
    assert r.status_code == 200 and r.json()["blob_sha256"] == sha(blob)
    assert api.store.get_plan(key, gpu_env).blob_sha256 == sha(blob)


def test_an_older_record_cannot_replace_a_newer_one(api, published, make_plan, gpu_env):
    key, meta, blob = published[0]
    older, older_blob = make_plan(key, gpu_env, blob=b"an older plan", revision=meta.revision - 1)
    r = upload(api.client, older, older_blob, headers=api.admin, replace=True)
    assert r.status_code == 409 and r.json()["error"]["code"] == "stale_revision"
    assert f"has revision {meta.revision}; a replacement needs a higher revision" in r.json()["error"]["message"]
    assert api.store.get_plan(key, gpu_env).blob_sha256 == sha(blob)
    newer, newer_blob = make_plan(key, gpu_env, blob=b"a newer plan")
    r = upload(api.client, newer, newer_blob, headers=api.admin, replace=True)
    assert r.status_code == 200 and r.json()["revision"] == newer.revision > meta.revision


def test_put_plan_refusals(api, make_spec, make_plan, gpu_env):
    key, spec = make_spec(0)
    meta, blob = make_plan(key, gpu_env)

    def put(body):
        r = api.client.put("/v1/plans", json=body, headers=api.admin)
        return r.status_code, r.json()["error"]["code"], r.json()["error"]["message"]

    put_blob(api.client, blob, api.admin)
    status, code, message = put(upload_json(meta))  # no spec stored, none sent
    assert (status, code) == (404, "not_found") and "spec" in message
    _, other_spec = make_spec(1)
    status, code, message = put(upload_json(meta, other_spec))
    assert (status, code) == (422, "integrity_error") and key in message
    status, code, message = put(upload_json(meta.model_copy(update={"blob_size": len(blob) + 1}), spec))
    assert (status, code) == (404, "not_found") and "PUT /v1/blobs/{sha256}" in message  # not stored with that size
    corrupt = blob[:-1] + bytes([blob[-1] ^ 1])
    other, _ = make_plan(key, gpu_env, blob=corrupt)
    r = api.client.put(f"/v1/blobs/{sha(corrupt)}", content=blob, headers={**api.admin,
                                                                          "Content-Type": "application/octet-stream"})
    assert (r.status_code, r.json()["error"]["code"]) == (422, "integrity_error")  # bytes that do not hash to the name
    status, code, message = put(upload_json(other, spec))  # so its blob is not stored
    assert (status, code) == (404, "not_found") and "PUT /v1/blobs/{sha256}" in message
    body = upload_json(meta, spec)
    del body["environment"]["cudnn_version"]
    status, code, message = put(body)
    assert (status, code) == (422, "validation_error") and "environment.cudnn_version" in message
    assert api.store.get_plan(key, gpu_env) is None


def test_an_upload_that_carries_its_blob_is_refused_saying_how_to_upload_it(api, make_spec, make_plan, gpu_env):
    """A plan upload is the record alone: a body with the blob inline (``blob_b64``, base64) is 422 naming the raw
    upload, whatever the base64 holds, and nothing is published even when the blob is stored."""
    key, spec = make_spec(0)
    meta, blob = make_plan(key, gpu_env)
    put_blob(api.client, blob, api.admin)
    for b64 in (base64.b64encode(blob).decode(), "not base64!"):
        r = api.client.put("/v1/plans", json=upload_json(meta, spec, blob_b64=b64), headers=api.admin)
        assert (r.status_code, r.json()["error"]["code"]) == (422, "validation_error"), r.text
        message = r.json()["error"]["message"]
        assert "blob_b64 is not accepted" in message and "PUT /v1/blobs/{sha256} first" in message, message
        assert "must be upgraded" in message
    assert api.store.get_plan(key, gpu_env) is None
    assert upload(api.client, meta, blob, spec, headers=api.admin).status_code == 201


def test_blob_over_the_limit_is_413(store, make_spec, make_plan, gpu_env):
    key, spec = make_spec(0)
    with open_api(store, max_blob_bytes=1000) as api:
        meta, blob = make_plan(key, gpu_env, blob=b"x" * 1001)
        r = api.client.put("/v1/plans", json=upload_json(meta, spec), headers=api.admin)  # its record says 1001 bytes
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
        assert put_blob(api.client, blob, api.admin, check=False).status_code == 413  # the bytes: from their length
        # a lying blob_size does not get a large blob past the limit: its bytes are not stored
        r = api.client.put("/v1/plans", json=upload_json(meta.model_copy(update={"blob_size": 10}), spec),
                           headers=api.admin)
        assert r.status_code == 404
        meta, blob = make_plan(key, gpu_env, blob=b"x" * 1000)
        assert upload(api.client, meta, blob, spec, headers=api.admin).status_code == 201


def test_request_body_over_the_limit_is_413_declared_or_streamed(store, gpu_env):
    body = json.dumps({"environment": gpu_env.model_dump(), "graph_keys": ["0" * 64] * 100}).encode()
    with open_api(store, max_request_bytes=1000) as api:
        r = api.client.post("/v1/plans/resolve", content=body, headers={**api.reader, "Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"

        def chunks():  # no Content-Length: sent chunked
            for i in range(0, len(body), 100):
                yield body[i:i + 100]

        r = api.client.post("/v1/plans/resolve", content=chunks(), headers={**api.reader, "Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
        small = {"environment": gpu_env.model_dump(), "graph_keys": ["0" * 64]}
        assert api.client.post("/v1/plans/resolve", json=small, headers=api.reader).status_code == 200


# ------------------------------------------------------------------ resolve and lookup


def test_resolve_returns_records_blobs_and_records_misses(api, published, make_spec, gpu_env):
    (k0, _, b0), (k1, _, b1) = published
    missing_key, _ = make_spec(5)
    api.app.state.settings.presign_blobs = False  # blobs from this server, inline when asked (an S3 store's too)
    body = {"environment": gpu_env.model_dump(), "graph_keys": [k0, missing_key, k1, k0]}
    r = api.client.post("/v1/plans/resolve", json=body, headers=api.reader)
    assert r.status_code == 200
    out = r.json()
    assert set(out["plans"]) == {k0, k1} and out["missing"] == [missing_key]
    assert all(p["blob_b64"] is None and p["blob_url"] == f"/v1/blobs/{p['record']['blob_sha256']}"
               for p in out["plans"].values())
    assert out["plans"][k0]["record"]["blob_sha256"] == sha(b0)

    r = api.client.post("/v1/plans/resolve", json={**body, "include_blobs": True}, headers=api.reader)
    assert r.headers["content-type"] == "application/json"
    plans = r.json()["plans"]
    assert base64.b64decode(plans[k0]["blob_b64"]) == b0 and base64.b64decode(plans[k1]["blob_b64"]) == b1
    reasons = api.store.explain_misses(gpu_env, [missing_key], resolving=True)
    expected = ResolveResponse(plans={k: ResolvedPlan(record=api.store.get_plan(k, gpu_env), blob_b64=b64encode(b))
                                      for k, b in ((k0, b0), (k1, b1))}, missing=[missing_key], reasons=reasons)
    assert ResolveResponse.model_validate_json(r.content) == expected
    assert reasons[missing_key].reason == "not_registered" and "the client that missed it registers it" in (
        reasons[missing_key].message)

    misses = api.client.get("/v1/misses", headers=api.admin).json()["misses"]
    # one caller and process: its second miss of the key does not count (the count is of distinct callers)
    assert [(m["graph_key"], m["env_id"], m["count"]) for m in misses] == [(missing_key, gpu_env.env_id, 1)]
    metrics = api.client.get("/metrics").text
    assert 'plancache_resolve_keys_total{result="hit"} 4.0' in metrics
    assert 'plancache_resolve_keys_total{result="miss"} 2.0' in metrics
    assert f'plancache_blob_bytes_served_total{{route="/v1/plans/resolve"}} {float(len(b0) + len(b1))}' in metrics


def test_resolve_json_chunks_join_to_the_model(api, published, gpu_env, monkeypatch):
    monkeypatch.setattr(plans_routes, "CHUNK_BYTES", 1)
    for include_blobs in (True, False):
        found, missing = stored_plans(api.store, gpu_env, [k for k, _, _ in published] + ["f" * 64],
                                      include_blobs=include_blobs)
        plans = [(plans_routes.answer_head(k, r), r.blob_sha256, b) for k, (r, b) in found.items()]
        reasons = api.store.explain_misses(gpu_env, missing, resolving=True)
        chunks = list(plans_routes.resolve_json(plans, missing, reasons=reasons))
        # one per plan, or with blobs its head then its base64 a piece at a time (one piece here); then the end
        assert len(chunks) == (5 if include_blobs else 3)
        expected = ResolveResponse(plans={k: ResolvedPlan(record=r, blob_b64=None if b is None else b64encode(b),
                                                          blob_url=f"/v1/blobs/{r.blob_sha256}" if b is None else None)
                                          for k, (r, b) in found.items()}, missing=missing, reasons=reasons)
        assert ResolveResponse.model_validate_json(b"".join(chunks)) == expected


@pytest.mark.parametrize("whole", [True, False])
def test_a_small_resolve_answer_is_sent_whole_and_a_large_one_streamed(api, published, gpu_env, monkeypatch, whole):
    """Up to WHOLE_ANSWER_BLOB_BYTES of inline blobs the answer is one body (Content-Length); past it, chunks. Either
    way the same JSON, and the in-flight bytes it held are given back once it is sent."""
    (k0, _, b0), (k1, _, b1) = published
    monkeypatch.setattr(plans_routes, "WHOLE_ANSWER_BLOB_BYTES", len(b0) + len(b1) - (0 if whole else 1))
    monkeypatch.setattr(plans_routes, "CHUNK_BYTES", 64)
    api.app.state.settings.presign_blobs = False
    body = {"environment": gpu_env.model_dump(), "graph_keys": [k0, k1], "include_blobs": True}
    r = api.client.post("/v1/plans/resolve", json=body, headers=api.reader)
    assert r.status_code == 200, r.text
    assert ("content-length" in r.headers) is whole  # a streamed answer has none
    plans = ResolveResponse.model_validate_json(r.content).plans
    assert (base64.b64decode(plans[k0].blob_b64 or ""), base64.b64decode(plans[k1].blob_b64 or "")) == (b0, b1)
    assert api.app.state.inflight.used == 0


def test_resolve_inlines_blobs_up_to_the_budget(api, published, gpu_env, monkeypatch):
    (k0, _, b0), (k1, _, b1) = published
    monkeypatch.setattr(plans_routes, "MAX_INLINE_BLOB_BYTES", len(b0) + len(b1) - 1)
    api.app.state.settings.presign_blobs = False
    body = {"environment": gpu_env.model_dump(), "graph_keys": [k1, k0], "include_blobs": True}
    plans = api.client.post("/v1/plans/resolve", json=body, headers=api.reader).json()["plans"]
    assert base64.b64decode(plans[k1]["blob_b64"]) == b1 and plans[k0]["blob_b64"] is None
    assert plans[k0]["blob_url"] == f"/v1/blobs/{sha(b0)}" and plans[k1]["blob_url"] is None
    assert plans[k0]["record"]["blob_sha256"] == sha(b0)
    assert api.store.list_misses() == []  # looking the blobs up again records no miss


def test_resolve_matches_the_environment_exactly(api, published, gpu_env):
    keys = [k for k, _, _ in published]
    other = gpu_env.model_copy(update={"cudnn_version": gpu_env.cudnn_version + 1})
    r = api.client.post("/v1/plans/resolve", json={"environment": other.model_dump(), "graph_keys": keys}, headers=api.reader)
    answer = r.json()
    assert answer["plans"] == {} and answer["missing"] == keys
    assert {k: (r["reason"], r["differs"]) for k, r in answer["reasons"].items()} == dict.fromkeys(
        keys, ("other_environments", ["cudnn_version"]))


def test_resolve_limits_and_validation(store, gpu_env):
    with open_api(store, max_resolve_keys=3) as api:
        env = gpu_env.model_dump()
        r = api.client.post("/v1/plans/resolve", json={"environment": env, "graph_keys": ["0" * 64] * 4}, headers=api.reader)
        assert r.status_code == 413 and "limit is 3" in r.json()["error"]["message"]
        r = api.client.post("/v1/plans/resolve", json={"environment": env, "graph_keys": ["xyz"]}, headers=api.reader)
        assert r.status_code == 422 and "graph_keys" in r.json()["error"]["message"]
        r = api.client.post("/v1/plans/resolve", json={"environment": env, "graph_keys": []}, headers=api.reader)
        assert r.status_code == 422
        r = api.client.post("/v1/plans/resolve", json={"graph_keys": ["0" * 64]}, headers=api.reader)
        assert r.status_code == 422 and "body.environment" in r.json()["error"]["message"]


def test_plan_lookup_by_environment_query(api, published, gpu_env):
    key, meta, _ = published[0]
    r = api.client.get(f"/v1/plans/{key}", params=env_query(gpu_env), headers=api.reader)
    assert r.status_code == 200 and r.json()["blob_sha256"] == meta.blob_sha256 and r.json()["env_id"] == gpu_env.env_id
    other = {**env_query(gpu_env), "sm_count": 114}
    r = api.client.get(f"/v1/plans/{key}", params=other, headers=api.reader)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    partial = env_query(gpu_env)
    del partial["driver_version"]
    r = api.client.get(f"/v1/plans/{key}", params=partial, headers=api.reader)
    assert r.status_code == 422 and "driver_version" in r.json()["error"]["message"]


def test_a_signed_record_s_native_timings_come_back_unchanged(api, make_spec, gpu_env):
    """A record with native kernel timings, published, is answered by the upload, resolve and the record lookup as
    it was signed: read as a client reads an answer, it holds the same fields, and its signature verifies."""
    signer = new_signer()
    key, spec = make_spec(0)
    blob = b"an attention plan"
    native = {"flash": 0.354, "cudnn_aten": 0.261}
    meta = make_meta(key, gpu_env, blob, signer, native_median_ms=native)
    r = upload(api.client, meta, blob, spec, headers=api.admin)
    assert r.status_code == 201, r.text
    body = {"environment": gpu_env.model_dump(), "graph_keys": [key]}
    resolved = api.client.post("/v1/plans/resolve", json=body, headers=api.reader)
    assert resolved.json()["plans"][key]["record"]["native_median_ms"] == native
    looked_up = api.client.get(f"/v1/plans/{key}", params=env_query(gpu_env), headers=api.reader)
    for record in (from_answer(PlanRecord, r.content), from_answer(ResolveResponse, resolved.content).plans[key].record,
                   from_answer(PlanRecord, looked_up.content)):
        assert PlanMeta.model_validate(record.model_dump(include=set(PlanMeta.model_fields))) == meta
        trusted(signer).verify(record)


# ------------------------------------------------------------------ blobs


def test_blob_get_etag_and_immutable_caching(api, published):
    _, _, blob = published[0]
    digest = sha(blob)
    r = api.client.get(f"/v1/blobs/{digest}", headers=api.reader)
    assert r.status_code == 200 and r.content == blob
    assert r.headers["content-type"] == "application/octet-stream"
    assert r.headers["etag"] == f'"{digest}"'
    assert r.headers["cache-control"] == "public, max-age=31536000, immutable"
    for inm in (f'"{digest}"', f'W/"{digest}"', f'"{"0" * 64}", "{digest}"', "*"):
        r = api.client.get(f"/v1/blobs/{digest}", headers={**api.reader, "If-None-Match": inm})
        assert r.status_code == 304 and r.content == b"" and r.headers["etag"] == f'"{digest}"', inm
    r = api.client.get(f"/v1/blobs/{digest}", headers={**api.reader, "If-None-Match": '"something-else"'})
    assert r.status_code == 200 and r.content == blob
    served = f'plancache_blob_bytes_served_total{{route="/v1/blobs/{{sha256}}"}} {float(2 * len(blob))}'
    assert served in api.client.get("/metrics").text


def test_blob_unknown_or_malformed(api):
    unknown = "ab" * 32
    assert api.client.get(f"/v1/blobs/{unknown}", headers=api.reader).status_code == 404
    r = api.client.get(f"/v1/blobs/{unknown}", headers={**api.reader, "If-None-Match": "*"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = api.client.get("/v1/blobs/ABC", headers=api.reader)
    assert r.status_code == 422 and "sha256" in r.json()["error"]["message"]


# ------------------------------------------------------------------ siblings


def test_siblings_answers_the_specs_of_a_graph_s_other_shapes_and_refuses_bad_asks(api, gpu_env):
    """``POST /v1/plans/siblings``: the canonical specs of the plans of the asked graphs' other shapes on the
    environment, newest first, ``limit`` per key; a key without a spec has none; too many keys or too large a limit
    is 422 naming it; a reader's token is enough, none is 401."""
    from examples.generate import sdpa_causal

    shapes = [sdpa_causal(batch=b, heads=16, seq=s, d=128) for b, s in ((2, 512), (2, 1024), (8, 256))]
    for i, spec in enumerate(shapes):
        api.store.put_spec(spec.graph_key, spec.to_json())
        api.store.publish_plan(make_meta(spec.graph_key, gpu_env, b"plan%d" % i), b"plan%d" % i)
    env = gpu_env.model_dump(mode="json")

    def ask(keys, headers=api.reader, **extra):
        return api.client.post("/v1/plans/siblings", json={"environment": env, "graph_keys": keys, **extra},
                               headers=headers)

    r = ask([shapes[0].graph_key])
    assert r.status_code == 200, r.text
    specs = r.json()["specs"]
    assert list(specs) == [shapes[2].graph_key, shapes[1].graph_key]
    assert specs[shapes[1].graph_key] == shapes[1].canonical_document().to_json()
    assert list(ask([shapes[0].graph_key], limit=1).json()["specs"]) == [shapes[2].graph_key]
    assert ask(["ab" * 32]).json() == {"specs": {}}
    r = ask(["ab" * 32] * 17)
    assert r.status_code == 422 and "graph_keys" in r.json()["error"]["message"]
    r = ask([shapes[0].graph_key], limit=65)
    assert r.status_code == 422 and "limit" in r.json()["error"]["message"]
    assert ask([shapes[0].graph_key], headers={}).status_code == 401
