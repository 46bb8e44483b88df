"""HTTP API: admin tuning, misses, job listing and the worker job protocol, on SQLite and Postgres."""

from __future__ import annotations

import base64
import json
from datetime import datetime, timedelta

import pytest

from plancache.protocol import TargetEnvironment
from plancache.server.routes import admin as admin_routes
from tests.server_util import api, put_blob, upload, upload_json  # noqa: F401


def _tune(api, **body):
    return api.client.post("/v1/admin/tune", json=body, headers=api.admin)


@pytest.fixture
def spec0(make_spec):
    return make_spec(0)


# ------------------------------------------------------------------ admin: tune


def test_tune_by_spec_and_key_for_several_targets_deduplicated(api, make_spec, gpu_env):
    k0, s0 = make_spec(0)
    k1, s1 = make_spec(1)
    api.store.put_spec(k1, s1)
    targets = [{"sm": 90}, TargetEnvironment.exactly(gpu_env).model_dump(), {"sm": 90}]
    r = _tune(api, specs=[s0], graph_keys=[k1], targets=targets, priority=5)
    assert r.status_code == 200, r.text
    jobs = r.json()["jobs"]
    assert len(jobs) == 4  # 2 keys × 2 distinct targets
    assert {(j["graph_key"], j["target"]["sm_count"]) for j in jobs} == {(k0, None), (k0, 132), (k1, None), (k1, 132)}
    assert all(j["status"] == "queued" and j["priority"] == 5 for j in jobs)
    assert api.store.get_spec(k0) is not None
    again = _tune(api, graph_keys=[k0, k1], targets=targets).json()["jobs"]
    assert sorted(j["id"] for j in again) == sorted(j["id"] for j in jobs)


def test_tune_refusals_create_nothing(api, make_spec, monkeypatch):
    k0, s0 = make_spec(0)
    unknown, _ = make_spec(1)
    r = _tune(api, specs=[s0], graph_keys=[unknown], targets=[{}])
    assert r.status_code == 404 and unknown in r.json()["error"]["message"]
    bad = {**s0, "nodes": [{**s0["nodes"][0], "type": "FROBNICATE"}]}
    r = _tune(api, specs=[s0, bad], targets=[{}])
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_spec"
    assert r.json()["error"]["message"].startswith("specs[1]:") and "FROBNICATE" in r.json()["error"]["message"]
    r = _tune(api, targets=[{}])
    assert r.status_code == 422 and "graph_keys or specs" in r.json()["error"]["message"]
    r = _tune(api, specs=[s0], targets=[])
    assert r.status_code == 422 and "targets" in r.json()["error"]["message"]
    monkeypatch.setattr(admin_routes, "MAX_TUNE_JOBS", 1)
    r = _tune(api, specs=[s0], targets=[{"sm": 90}, {"sm": 100}])
    assert r.status_code == 413
    assert api.store.list_jobs() == [] and api.store.get_spec(k0) is None


def test_jobs_listing_filters_and_detail(api, make_spec):
    k0, s0 = make_spec(0)
    k1, s1 = make_spec(1)
    ids = [j["id"] for j in _tune(api, specs=[s0, s1], targets=[{}]).json()["jobs"]]
    listed = api.client.get("/v1/jobs", headers=api.admin).json()["jobs"]
    assert [j["id"] for j in listed] == sorted(ids, reverse=True)
    jobs = api.client.get("/v1/jobs", params={"graph_key": k1}, headers=api.admin).json()["jobs"]
    assert [j["graph_key"] for j in jobs] == [k1]
    assert len(api.client.get("/v1/jobs", params={"limit": 1, "offset": 1}, headers=api.admin).json()["jobs"]) == 1
    assert api.client.get("/v1/jobs", params={"status": "running"}, headers=api.admin).json()["jobs"] == []
    r = api.client.get("/v1/jobs", params={"status": "bogus"}, headers=api.admin)
    assert r.status_code == 422 and "status" in r.json()["error"]["message"]
    assert api.client.get("/v1/jobs", params={"limit": 0}, headers=api.admin).status_code == 422
    r = api.client.get(f"/v1/jobs/{ids[0]}", headers=api.worker)
    assert r.status_code == 200 and r.json()["graph_key"] == k0
    r = api.client.get("/v1/jobs/999999", headers=api.admin)
    assert r.status_code == 404 and "999999" in r.json()["error"]["message"]
    assert api.client.get("/v1/jobs/0", headers=api.admin).status_code == 422
    metrics = api.client.get("/metrics").text
    assert 'plancache_jobs{status="queued"} 2.0' in metrics and 'plancache_jobs{status="running"} 0.0' in metrics


# ------------------------------------------------------------------ misses


def test_misses_listing_and_enqueue_top_misses(api, make_spec, gpu_env):
    keys = []
    for i in range(4):
        key, spec = make_spec(i)
        if i < 3:
            api.store.put_spec(key, spec)
        keys.append(key)
    env = gpu_env.model_dump()
    for n_asked in (4, 3, 2, 1):  # misses: keys[0] ×4, keys[1] ×3, keys[2] ×2, keys[3] (no spec) ×1
        # each from another client process: one process's misses of a key count once
        r = api.client.post("/v1/plans/resolve", json={"environment": env, "graph_keys": keys[:n_asked]},
                            headers={**api.reader, "X-Plancache-Process": f"p{n_asked}"})
        assert r.status_code == 200
    misses = api.client.get("/v1/misses", headers=api.admin).json()["misses"]
    assert [(m["graph_key"], m["count"]) for m in misses] == list(zip(keys, [4, 3, 2, 1]))
    assert api.client.get("/v1/misses", params={"env_id": "0" * 32}, headers=api.admin).json()["misses"] == []
    misses = api.client.get("/v1/misses", params={"env_id": gpu_env.env_id, "limit": 2}, headers=api.admin).json()["misses"]
    assert len(misses) == 2
    assert api.client.get("/v1/misses", params={"env_id": "nope"}, headers=api.admin).status_code == 422

    r = api.client.post("/v1/admin/tune/misses", json={"environment": env, "top": 2, "priority": 3}, headers=api.admin)
    assert r.status_code == 200
    jobs = r.json()["jobs"]
    assert [j["graph_key"] for j in jobs] == keys[:2]
    assert all(j["target"] == TargetEnvironment.exactly(gpu_env).model_dump() and j["priority"] == 3 for j in jobs)
    r = api.client.post("/v1/admin/tune/misses", json={"environment": env, "top": 10}, headers=api.admin)
    assert sorted(j["graph_key"] for j in r.json()["jobs"]) == sorted(keys[:3])  # keys[3] has no spec to tune


# ------------------------------------------------------------------ worker protocol


def _claim(api, env, worker_id="w1", headers=None):
    return api.client.post("/v1/jobs/claim", json={"environment": env.model_dump(), "worker_id": worker_id},
                           headers=headers or api.worker)


def _lease(worker_id, token):
    return {"worker_id": worker_id, "lease_token": token}


def test_claim_heartbeat_complete_round_trip(api, spec0, gpu_env, make_plan, clock):
    key, spec = spec0
    assert _claim(api, gpu_env).status_code == 204
    job = _tune(api, specs=[spec], targets=[{"sm": gpu_env.sm}]).json()["jobs"][0]
    r = _claim(api, gpu_env)
    assert r.status_code == 200
    claim = r.json()
    token = claim["lease_token"]
    assert claim["job"]["id"] == job["id"] and claim["job"]["status"] == "running" and claim["job"]["lease_owner"] == "w1"
    assert claim["spec"] == api.store.get_spec(key) and isinstance(token, str) and len(token) >= 40
    assert "fencing_token" not in claim["job"] and token not in json.dumps(claim["job"])
    assert datetime.fromisoformat(claim["lease_expires_at"]) == clock.now + timedelta(seconds=120)
    assert _claim(api, gpu_env, "w2").status_code == 204  # leased

    clock.advance(60)
    r = api.client.post(f"/v1/jobs/{job['id']}/heartbeat", json=_lease("w1", token), headers=api.worker)
    assert r.status_code == 200 and datetime.fromisoformat(r.json()["lease_expires_at"]) == clock.now + timedelta(seconds=120)
    assert r.json()["lease_owner"] == "w1" and token not in r.text

    meta, blob = make_plan(key, gpu_env, tuning_seconds=3.5)
    put_blob(api.client, blob, api.worker, job=(job["id"], "w1", token))  # the blob raw, then the record alone
    body = {**_lease("w1", token), "plan": upload_json(meta)}
    r = api.client.post(f"/v1/jobs/{job['id']}/complete", json=body, headers=api.worker)
    assert r.status_code == 200, r.text
    assert r.json()["job_id"] == job["id"] and r.json()["blob_sha256"] == meta.blob_sha256
    assert api.store.get_job(job["id"]).status == "succeeded"
    again = api.client.post(f"/v1/jobs/{job['id']}/complete", json=body, headers=api.worker)  # a retried completion
    assert again.status_code == 200 and again.json() == r.json()
    resolved = api.client.post("/v1/plans/resolve", json={"environment": gpu_env.model_dump(), "graph_keys": [key]},
                               headers=api.reader).json()
    assert resolved["missing"] == [] and resolved["plans"][key]["record"]["job_id"] == job["id"]
    metrics = api.client.get("/metrics").text
    assert "plancache_tuning_seconds_count 1.0" in metrics and "plancache_tuning_seconds_sum 3.5" in metrics
    assert 'plancache_jobs{status="succeeded"} 1.0' in metrics


def test_a_fenced_worker_is_refused(api, spec0, gpu_env, make_plan, clock):
    key, spec = spec0
    job_id = _tune(api, specs=[spec], targets=[{}]).json()["jobs"][0]["id"]
    first = _claim(api, gpu_env, "w1").json()["lease_token"]
    clock.advance(121)
    second = _claim(api, gpu_env, "w2").json()  # took the expired lease over
    assert second["job"]["attempts"] == 2 and second["lease_token"] != first
    meta, blob = make_plan(key, gpu_env, worker_id="w1")
    r = put_blob(api.client, blob, api.worker, job=(job_id, "w1", first), check=False)
    assert r.status_code == 409 and r.json()["error"]["code"] == "lease_lost"
    put_blob(api.client, blob, api.admin)  # so that completing is refused for the lease, not for a missing blob
    for path, body in ((f"/v1/jobs/{job_id}/heartbeat", _lease("w1", first)),
                       (f"/v1/jobs/{job_id}/fail", {**_lease("w1", first), "error": "boom"}),
                       (f"/v1/jobs/{job_id}/complete", {**_lease("w1", first), "plan": upload_json(meta)})):
        r = api.client.post(path, json=body, headers=api.worker)
        assert r.status_code == 409 and r.json()["error"]["code"] == "lease_lost", path
        assert "w2" not in r.text and second["lease_token"] not in r.text  # a refusal names no holder and no token
    assert api.store.get_plan(key, gpu_env) is None
    meta2, blob2 = make_plan(key, gpu_env, blob=b"w2's plan", worker_id="w2")
    put_blob(api.client, blob2, api.worker, job=(job_id, "w2", second["lease_token"]))
    r = api.client.post(f"/v1/jobs/{job_id}/complete",
                        json={**_lease("w2", second["lease_token"]), "plan": upload_json(meta2)}, headers=api.worker)
    assert r.status_code == 200 and r.json()["worker_id"] == "w2"
    # the fenced worker repeating its completion is still refused, even though the job is done now
    r = api.client.post(f"/v1/jobs/{job_id}/complete", json={**_lease("w1", first), "plan": upload_json(meta)},
                        headers=api.worker)
    assert r.status_code == 409 and r.json()["error"]["code"] == "lease_lost"


def test_complete_checks_the_plan_against_the_job(api, make_spec, gpu_env, make_plan):
    key, spec = make_spec(0)
    other, other_spec = make_spec(1)
    api.store.put_spec(other, other_spec)
    job_id = _tune(api, specs=[spec], targets=[{"sm": gpu_env.sm}]).json()["jobs"][0]["id"]
    lease = _lease("w1", _claim(api, gpu_env).json()["lease_token"])
    job = (job_id, "w1", lease["lease_token"])
    meta, blob = make_plan(other, gpu_env)
    put_blob(api.client, blob, api.worker, job=job)
    r = api.client.post(f"/v1/jobs/{job_id}/complete", json={**lease, "plan": upload_json(meta)}, headers=api.worker)
    assert r.status_code == 409 and r.json()["error"]["code"] == "conflict"
    meta, blob = make_plan(key, gpu_env.model_copy(update={"sm": 100}))
    put_blob(api.client, blob, api.worker, job=job)
    r = api.client.post(f"/v1/jobs/{job_id}/complete", json={**lease, "plan": upload_json(meta)}, headers=api.worker)
    assert r.status_code == 409 and r.json()["error"]["code"] == "environment_mismatch"
    meta, blob = make_plan(key, gpu_env, blob=b"not uploaded")
    r = api.client.post(f"/v1/jobs/{job_id}/complete", json={**lease, "plan": upload_json(meta)}, headers=api.worker)
    assert r.status_code == 404 and "PUT /v1/blobs/{sha256}" in r.json()["error"]["message"]  # its blob first
    put_blob(api.client, blob, api.worker, job=job)
    inline = upload_json(meta, blob_b64=base64.b64encode(blob).decode())  # a worker that still sends the blob inline
    r = api.client.post(f"/v1/jobs/{job_id}/complete", json={**lease, "plan": inline}, headers=api.worker)
    assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error"
    message = r.json()["error"]["message"]
    assert message.startswith("body.plan:") and "PUT /v1/blobs/{sha256} first" in message and "upgraded" in message
    assert api.store.get_job(job_id).status == "running"


def test_fail_requeues_then_fails_for_good(api, spec0, gpu_env):
    _, spec = spec0
    job_id = _tune(api, specs=[spec], targets=[{}], max_attempts=2).json()["jobs"][0]["id"]
    first = _claim(api, gpu_env).json()["lease_token"]
    r = api.client.post(f"/v1/jobs/{job_id}/fail", json={**_lease("w1", first), "error": "numerics"}, headers=api.worker)
    assert r.status_code == 200 and r.json()["status"] == "queued" and r.json()["error"] == "numerics"
    second = _claim(api, gpu_env).json()
    assert second["job"]["attempts"] == 2 and second["lease_token"] != first
    r = api.client.post(f"/v1/jobs/{job_id}/fail", json={**_lease("w1", second["lease_token"]), "error": "again",
                                                         "retryable": True}, headers=api.worker)
    assert r.status_code == 200 and r.json()["status"] == "failed" and r.json()["attempts"] == 2
    assert api.client.get("/v1/jobs", params={"status": "failed"}, headers=api.admin).json()["jobs"][0]["id"] == job_id


# ------------------------------------------------------------------ leases are bound to their holder


@pytest.fixture
def intruder(api):
    """``Authorization`` headers of a second worker token (another worker, or someone who stole one)."""
    token, _ = api.store.create_token("test-worker-2", "worker")
    return {"Authorization": f"Bearer {token}"}


def _held_job(api, make_spec, gpu_env, i=0):
    """A job claimed by worker ``w1`` with ``api.worker``: (job id, graph key, lease token)."""
    key, spec = make_spec(i)
    _tune(api, specs=[spec], targets=[{}])
    claim = _claim(api, gpu_env, "w1").json()
    return claim["job"]["id"], key, str(claim["lease_token"])


def test_another_worker_token_cannot_heartbeat_complete_or_fail_a_claimed_job(api, intruder, make_spec, gpu_env,
                                                                               make_plan):
    """Even with the lease token itself (leaked), a second worker token is refused 403 ``not_lease_holder`` and
    changes nothing; the real holder then completes (before: 200 for the intruder, 409 for the holder)."""
    job_id, key, token = _held_job(api, make_spec, gpu_env)
    meta, blob = make_plan(key, gpu_env, blob=b"the intruder's blob", worker_id="w1")
    r = put_blob(api.client, blob, intruder, job=(job_id, "w1", token), check=False)
    assert r.status_code == 403 and r.json()["error"]["code"] == "not_lease_holder"
    assert api.store.get_blob(meta.blob_sha256) is None
    put_blob(api.client, blob, api.admin)  # so that completing is refused for the lease, not for a missing blob
    for path, body in ((f"/v1/jobs/{job_id}/heartbeat", _lease("w1", token)),
                       (f"/v1/jobs/{job_id}/complete", {**_lease("w1", token), "plan": upload_json(meta)}),
                       (f"/v1/jobs/{job_id}/fail", {**_lease("w1", token), "error": "sabotage", "retryable": False})):
        r = api.client.post(path, json=body, headers=intruder)
        assert r.status_code == 403, (path, r.text)
        assert r.json()["error"]["code"] == "not_lease_holder" and "only the token that claimed" in r.json()["error"]["message"]
    job = api.store.get_job(job_id)
    assert job.status == "running" and job.attempts == 1 and job.error is None
    assert api.store.get_plan(key, gpu_env) is None
    good, good_blob = make_plan(key, gpu_env, blob=b"the holder's blob", worker_id="w1")
    put_blob(api.client, good_blob, api.worker, job=(job_id, "w1", token))
    r = api.client.post(f"/v1/jobs/{job_id}/complete", json={**_lease("w1", token), "plan": upload_json(good)},
                        headers=api.worker)
    assert r.status_code == 200 and r.json()["blob_sha256"] == good.blob_sha256


def test_job_detail_shows_no_lease_token_and_the_owner_only_to_admins_and_the_holder(api, intruder, make_spec, gpu_env):
    """GET /v1/jobs/{id}: before, any worker token read the owner and the (counter) fencing token."""
    job_id, _, token = _held_job(api, make_spec, gpu_env)
    views = {who: api.client.get(f"/v1/jobs/{job_id}", headers=h) for who, h in
             (("intruder", intruder), ("holder", api.worker), ("admin", api.admin))}
    for who, r in views.items():
        assert r.status_code == 200 and r.json()["status"] == "running", who
        assert "fencing_token" not in r.json() and "lease_token" not in r.json() and token not in r.text, who
    assert views["intruder"].json()["lease_owner"] is None and views["intruder"].json()["lease_holder"] is None
    assert views["holder"].json()["lease_owner"] == "w1" and views["holder"].json()["lease_holder"] is None
    worker_id = api.store.authenticate(api.worker["Authorization"].split()[1]).id
    assert views["admin"].json()["lease_owner"] == "w1" and views["admin"].json()["lease_holder"] == f"token:{worker_id}"
    listed = api.client.get("/v1/jobs", headers=api.admin).json()["jobs"][0]
    assert listed["lease_owner"] == "w1" and token not in json.dumps(listed)


def test_lease_tokens_cannot_be_guessed(api, intruder, make_spec, gpu_env, clock):
    """Small numbers (before: the fencing token was a counter, 1 for a first claim, and worked from any worker
    token), another job's token and near misses all answer 409 ``lease_lost`` and change nothing."""
    job_id, _, token = _held_job(api, make_spec, gpu_env, 0)
    _, _, other_token = _held_job(api, make_spec, gpu_env, 1)
    expires = api.store.get_job(job_id).lease_expires_at
    clock.advance(5)  # a heartbeat that got through would move the expiry
    guesses = [str(n) for n in range(200)] + [other_token, token[:-1], token + "A", token.swapcase(), " " + token]
    for headers in (intruder, api.worker):
        for guess in guesses:
            r = api.client.post(f"/v1/jobs/{job_id}/heartbeat", json=_lease("w1", guess), headers=headers)
            assert r.status_code == 409 and r.json()["error"]["code"] == "lease_lost", guess
    assert api.store.get_job(job_id).lease_expires_at == expires
    assert api.client.post(f"/v1/jobs/{job_id}/heartbeat", json=_lease("w1", token), headers=api.worker).status_code == 200


# ------------------------------------------------------------------ one completion route; PUT /v1/plans is an admin's


def test_a_worker_token_cannot_put_a_plan(api, intruder, make_spec, gpu_env, make_plan):
    """A squatter's plan for a key and environment would make the legitimate completion a 409: a worker publishes
    only through the completion of a job it holds."""
    key, spec = make_spec(0)
    squat, squat_blob = make_plan(key, gpu_env, blob=b"squatter", worker_id="w2")
    put_blob(api.client, squat_blob, api.admin)  # refused for the token, not for a missing blob
    r = api.client.put("/v1/plans", json=upload_json(squat, spec), headers=intruder)
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    assert "this route needs admin" in r.json()["error"]["message"]
    assert api.store.get_plan(key, gpu_env) is None and api.store.get_spec(key) is None  # nothing stored
    job_id, _, token = _held_job(api, make_spec, gpu_env)
    meta, blob = make_plan(key, gpu_env, blob=b"legit", worker_id="w1")
    put_blob(api.client, blob, api.worker, job=(job_id, "w1", token))
    r = api.client.post(f"/v1/jobs/{job_id}/complete", json={**_lease("w1", token), "plan": upload_json(meta)},
                        headers=api.worker)
    assert r.status_code == 200 and api.store.get_plan(key, gpu_env).blob_sha256 == meta.blob_sha256


@pytest.mark.parametrize("named", [{"job_id": 1, "lease_token": "x" * 43}, {"job_id": 1}, {"lease_token": "x"}])
def test_a_plan_upload_naming_a_job_points_at_the_completion_route(api, make_spec, gpu_env, make_plan, named):
    job_id, key, token = _held_job(api, make_spec, gpu_env)
    meta, blob = make_plan(key, gpu_env, worker_id="w1")
    put_blob(api.client, blob, api.worker, job=(job_id, "w1", token))
    named = {**named, **({"job_id": job_id} if "job_id" in named else {})}
    r = api.client.put("/v1/plans", json=upload_json(meta, **named), headers=api.admin)
    assert r.status_code == 422 and "POST /v1/jobs/{id}/complete" in r.json()["error"]["message"], r.text
    assert api.client.put("/v1/plans", json=upload_json(meta, **named), headers=api.worker).status_code == 403
    r = api.client.post(f"/v1/jobs/{job_id}/complete", json={**_lease("w1", token), "plan": upload_json(meta, **named)},
                        headers=api.worker)  # the job is the path's: not again in the plan
    assert r.status_code == 422 and "POST /v1/jobs/{id}/complete" in r.json()["error"]["message"]
    assert api.store.get_plan(key, gpu_env) is None and api.store.get_job(job_id).status == "running"


def test_an_admin_still_uploads_plans_directly(api, make_spec, gpu_env, make_plan):
    key, spec = make_spec(0)
    r = upload(api.client, *make_plan(key, gpu_env), spec, headers=api.admin)
    assert r.status_code == 201 and r.json()["job_id"] is None


# ------------------------------------------------------------------ worker ids, lost claim answers, cancelling


@pytest.mark.parametrize("worker_id", ["w1 ", " w1", "gpu-é", "w\t1", "a" * 257, ""])
def test_a_worker_id_that_cannot_travel_in_a_header_is_refused_at_the_claim(api, spec0, gpu_env, worker_id):
    """Before: claimed with such an id, the worker could not send its blob (X-Plancache-Worker: the header cannot
    carry it) and retried for ever, the job leased until it ran out. After: the claim is 422, naming the field."""
    _tune(api, specs=[spec0[1]], targets=[{}])
    r = _claim(api, gpu_env, worker_id)
    assert r.status_code == 422 and "worker_id" in r.json()["error"]["message"]
    assert api.store.job_counts()["running"] == 0
    assert _claim(api, gpu_env, "gpu-node-7.example/0 (H200)").status_code == 200  # printable ASCII, inner spaces


def test_a_claim_sent_again_with_its_lease_token_gets_the_same_job(api, make_spec, gpu_env):
    for i in range(2):
        _tune(api, specs=[make_spec(i)[1]], targets=[{}])
    body = {"environment": gpu_env.model_dump(), "worker_id": "w1", "lease_token": "L" * 43}
    first = api.client.post("/v1/jobs/claim", json=body, headers=api.worker)
    again = api.client.post("/v1/jobs/claim", json=body, headers=api.worker)  # its first answer was lost
    assert first.status_code == again.status_code == 200
    assert first.json()["job"]["id"] == again.json()["job"]["id"] and again.json()["lease_token"] == "L" * 43
    assert api.store.job_counts() == {"queued": 1, "running": 1, "succeeded": 0, "failed": 0}
    assert "min_revision" not in first.json()  # none to name: a worker of an earlier release reads the answer
    for bad in ("short", "L" * 42 + "!", "L" * 129):
        r = api.client.post("/v1/jobs/claim", json={**body, "lease_token": bad}, headers=api.worker)
        assert r.status_code == 422 and "lease_token" in r.json()["error"]["message"]


def test_the_claim_names_the_revision_a_withdrawn_plans_successor_must_pass(api, spec0, gpu_env, make_plan, tmp_path):
    from plancache.protocol import Withdrawal
    from plancache.signing import Signer, TrustedKeys, keygen

    key, spec = spec0
    r = upload(api.client, *make_plan(key, gpu_env), spec, headers=api.admin)
    record = r.json()
    private, public, _ = keygen(tmp_path, "admin")
    signer = Signer.from_file(private)
    api.app.state.trusted_keys = TrustedKeys.from_files([public])  # the server stores withdrawals its keys verify
    ahead = datetime.fromtimestamp(record["revision"] / 1000 + 3600)  # the admin's clock runs an hour ahead
    w = signer.sign_withdrawal(Withdrawal(graph_key=key, environment=gpu_env, blob_sha256=record["blob_sha256"],
                                          withdrawn_revision=record["revision"], reason="bad numerics"), now=ahead)
    assert api.client.post("/v1/admin/withdrawals", json=w.model_dump(mode="json"), headers=api.admin).status_code == 201
    _tune(api, graph_keys=[key], targets=[{}])
    claim = _claim(api, gpu_env).json()
    assert claim["min_revision"] == w.revision > record["revision"]


def test_an_admin_cancels_jobs_over_http(api, make_spec, gpu_env):
    ids = [_tune(api, specs=[make_spec(i)[1]], targets=[{}]).json()["jobs"][0]["id"] for i in range(2)]
    claim = _claim(api, gpu_env).json()
    r = api.client.post(f"/v1/admin/jobs/{claim['job']['id']}/cancel", json={"reason": "GPU retired"},
                        headers=api.admin)
    assert r.status_code == 200 and r.json()["status"] == "failed"
    assert r.json()["error"] == "cancelled by test-admin: GPU retired"
    r = api.client.post(f"/v1/jobs/{claim['job']['id']}/heartbeat", json=_lease("w1", claim["lease_token"]),
                        headers=api.worker)
    assert r.status_code == 409 and r.json()["error"]["code"] == "lease_lost"
    queued = next(i for i in ids if i != claim["job"]["id"])
    r = api.client.post(f"/v1/admin/jobs/{queued}/cancel", headers=api.admin)  # the body is optional
    assert r.status_code == 200 and r.json()["error"] == "cancelled by test-admin"
    r = api.client.post(f"/v1/admin/jobs/{queued}/cancel", headers=api.admin)
    assert r.status_code == 409 and "ended already" in r.json()["error"]["message"]
    assert api.client.post("/v1/admin/jobs/99999/cancel", headers=api.admin).status_code == 404
    assert api.client.post(f"/v1/admin/jobs/{queued}/cancel", headers=api.worker).status_code == 403
    r = api.client.post(f"/v1/admin/jobs/{queued}/cancel", json={"reason": "two\nlines"}, headers=api.admin)
    assert r.status_code == 422 and "reason" in r.json()["error"]["message"]


def test_a_completion_from_a_non_holder_stores_not_even_its_spec(api, intruder, make_spec, gpu_env, make_plan):
    """Before: the spec of a completion was registered before its lease was checked, so any worker token could store
    specs through a job it does not hold. After: the lease is checked first."""
    job_id, key, token = _held_job(api, make_spec, gpu_env)
    other, other_spec = make_spec(5)
    meta, blob = make_plan(other, gpu_env, worker_id="w1")
    put_blob(api.client, blob, api.admin)
    r = api.client.post(f"/v1/jobs/{job_id}/complete", json={**_lease("w1", token), "plan": upload_json(meta, other_spec)},
                        headers=intruder)
    assert r.status_code == 403 and api.store.get_spec(other) is None
    r = api.client.post(f"/v1/jobs/{job_id}/complete", json={**_lease("w1", "x" * 43), "plan": upload_json(meta, other_spec)},
                        headers=api.worker)
    assert r.status_code == 409 and api.store.get_spec(other) is None


@pytest.mark.parametrize("header", ["2147483648", "99999999999", "0"])
def test_a_blob_upload_naming_a_job_id_out_of_range_is_refused_clearly(api, make_plan, make_spec, gpu_env, header):
    meta, blob = make_plan(make_spec(0)[0], gpu_env)
    r = api.client.put(f"/v1/blobs/{meta.blob_sha256}", content=blob,
                       headers={**api.worker, "X-Plancache-Job": header, "X-Plancache-Worker": "w1",
                                "X-Plancache-Lease": "x" * 43, "Content-Type": "application/octet-stream"})
    assert r.status_code == 403 and "X-Plancache-Job" in r.json()["error"]["message"]
    r = api.client.put(f"/v1/blobs/{meta.blob_sha256}", content=blob,
                       headers={**api.worker, "X-Plancache-Job": "2147483647", "X-Plancache-Worker": "w1",
                                "X-Plancache-Lease": "x" * 43, "Content-Type": "application/octet-stream"})
    assert r.status_code == 404  # a ten-digit id in range is looked up
