"""HTTP API: admin tuning, misses, job listing and the worker job protocol, on SQLite and Postgres."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from plancache.protocol import TargetEnvironment
from plancache.server.routes import admin as admin_routes

from .server_util import api, upload_json  # noqa: F401


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
    assert [j["graph_key"] for j in api.client.get("/v1/jobs", params={"graph_key": k1}, headers=api.admin).json()["jobs"]] == [k1]
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
        r = api.client.post("/v1/plans/resolve", json={"environment": env, "graph_keys": keys[:n_asked]}, headers=api.reader)
        assert r.status_code == 200
    misses = api.client.get("/v1/misses", headers=api.admin).json()["misses"]
    assert [(m["graph_key"], m["count"]) for m in misses] == list(zip(keys, [4, 3, 2, 1]))
    assert api.client.get("/v1/misses", params={"env_id": "0" * 32}, headers=api.admin).json()["misses"] == []
    assert len(api.client.get("/v1/misses", params={"env_id": gpu_env.env_id, "limit": 2}, headers=api.admin).json()["misses"]) == 2
    assert api.client.get("/v1/misses", params={"env_id": "nope"}, headers=api.admin).status_code == 422

    r = api.client.post("/v1/admin/tune/misses", json={"environment": env, "top": 2, "priority": 3}, headers=api.admin)
    assert r.status_code == 200
    jobs = r.json()["jobs"]
    assert [j["graph_key"] for j in jobs] == keys[:2]
    assert all(j["target"] == TargetEnvironment.exactly(gpu_env).model_dump() and j["priority"] == 3 for j in jobs)
    r = api.client.post("/v1/admin/tune/misses", json={"environment": env, "top": 10}, headers=api.admin)
    assert sorted(j["graph_key"] for j in r.json()["jobs"]) == sorted(keys[:3])  # keys[3] has no spec to tune


# ------------------------------------------------------------------ worker protocol


def _claim(api, env, worker_id="w1"):
    return api.client.post("/v1/jobs/claim", json={"environment": env.model_dump(), "worker_id": worker_id}, headers=api.worker)


def _lease(worker_id, token):
    return {"worker_id": worker_id, "lease_token": token}


def test_claim_heartbeat_complete_round_trip(api, spec0, gpu_env, make_plan, clock):
    key, spec = spec0
    assert _claim(api, gpu_env).status_code == 204
    job = _tune(api, specs=[spec], targets=[{"sm": gpu_env.sm}]).json()["jobs"][0]
    r = _claim(api, gpu_env)
    assert r.status_code == 200
    claim = r.json()
    assert claim["job"]["id"] == job["id"] and claim["job"]["status"] == "running"
    assert claim["spec"] == api.store.get_spec(key) and claim["lease_token"] == claim["job"]["fencing_token"] == 1
    assert datetime.fromisoformat(claim["lease_expires_at"]) == clock.now + timedelta(seconds=120)
    assert _claim(api, gpu_env, "w2").status_code == 204  # leased

    clock.advance(60)
    r = api.client.post(f"/v1/jobs/{job['id']}/heartbeat", json=_lease("w1", 1), headers=api.worker)
    assert r.status_code == 200 and datetime.fromisoformat(r.json()["lease_expires_at"]) == clock.now + timedelta(seconds=120)

    meta, blob = make_plan(key, gpu_env, tuning_seconds=3.5)
    body = {**_lease("w1", 1), "plan": upload_json(meta, blob)}
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
    assert _claim(api, gpu_env, "w1").json()["lease_token"] == 1
    clock.advance(121)
    assert _claim(api, gpu_env, "w2").json()["lease_token"] == 2  # took the expired lease over
    meta, blob = make_plan(key, gpu_env, worker_id="w1")
    for path, body in ((f"/v1/jobs/{job_id}/heartbeat", _lease("w1", 1)),
                       (f"/v1/jobs/{job_id}/fail", {**_lease("w1", 1), "error": "boom"}),
                       (f"/v1/jobs/{job_id}/complete", {**_lease("w1", 1), "plan": upload_json(meta, blob)})):
        r = api.client.post(path, json=body, headers=api.worker)
        assert r.status_code == 409 and r.json()["error"]["code"] == "lease_lost", path
    assert api.store.get_plan(key, gpu_env) is None
    meta2, blob2 = make_plan(key, gpu_env, blob=b"w2's plan", worker_id="w2")
    r = api.client.post(f"/v1/jobs/{job_id}/complete", json={**_lease("w2", 2), "plan": upload_json(meta2, blob2)},
                        headers=api.worker)
    assert r.status_code == 200 and r.json()["worker_id"] == "w2"
    # the fenced worker repeating its completion is still refused, even though the job is done now
    r = api.client.post(f"/v1/jobs/{job_id}/complete", json={**_lease("w1", 1), "plan": upload_json(meta, blob)},
                        headers=api.worker)
    assert r.status_code == 409 and r.json()["error"]["code"] == "lease_lost"


def test_complete_checks_the_plan_against_the_job(api, make_spec, gpu_env, make_plan):
    key, spec = make_spec(0)
    other, other_spec = make_spec(1)
    api.store.put_spec(other, other_spec)
    job_id = _tune(api, specs=[spec], targets=[{"sm": gpu_env.sm}]).json()["jobs"][0]["id"]
    _claim(api, gpu_env)
    wrong_key = upload_json(*make_plan(other, gpu_env))
    r = api.client.post(f"/v1/jobs/{job_id}/complete", json={**_lease("w1", 1), "plan": wrong_key}, headers=api.worker)
    assert r.status_code == 409 and r.json()["error"]["code"] == "conflict"
    wrong_env = upload_json(*make_plan(key, gpu_env.model_copy(update={"sm": 100})))
    r = api.client.post(f"/v1/jobs/{job_id}/complete", json={**_lease("w1", 1), "plan": wrong_env}, headers=api.worker)
    assert r.status_code == 409 and r.json()["error"]["code"] == "environment_mismatch"
    bad_b64 = {**upload_json(*make_plan(key, gpu_env)), "blob_b64": "%%%"}
    r = api.client.post(f"/v1/jobs/{job_id}/complete", json={**_lease("w1", 1), "plan": bad_b64}, headers=api.worker)
    assert r.status_code == 422 and "plan.blob_b64" in r.json()["error"]["message"]
    assert api.store.get_job(job_id).status == "running"


def test_fail_requeues_then_fails_for_good(api, spec0, gpu_env):
    _, spec = spec0
    job_id = _tune(api, specs=[spec], targets=[{}], max_attempts=2).json()["jobs"][0]["id"]
    _claim(api, gpu_env)
    r = api.client.post(f"/v1/jobs/{job_id}/fail", json={**_lease("w1", 1), "error": "numerics"}, headers=api.worker)
    assert r.status_code == 200 and r.json()["status"] == "queued" and r.json()["error"] == "numerics"
    assert _claim(api, gpu_env).json()["lease_token"] == 2
    r = api.client.post(f"/v1/jobs/{job_id}/fail", json={**_lease("w1", 2), "error": "again", "retryable": True},
                        headers=api.worker)
    assert r.status_code == 200 and r.json()["status"] == "failed" and r.json()["attempts"] == 2
    assert api.client.get("/v1/jobs", params={"status": "failed"}, headers=api.admin).json()["jobs"][0]["id"] == job_id
