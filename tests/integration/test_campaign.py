"""``POST /v1/admin/campaigns``: every known graph key is enqueued for the new environment, once."""

from __future__ import annotations

from typing import Any

from plancache.environment import Environment
from plancache.protocol import TargetEnvironment
from tests.server_util import api  # noqa: F401

URL = "/v1/admin/campaigns"


def _specs(api: Any, make_spec: Any, n: int) -> list[str]:
    keys = []
    for i in range(n):
        key, spec = make_spec(i)
        api.store.put_spec(key, spec)
        keys.append(key)
    return keys


def _new_env(gpu_env: Environment) -> Environment:
    return gpu_env.model_copy(update={"cudnn_version": 92000})


def test_campaign_fans_out_to_every_known_key_once(api, make_spec, make_plan, gpu_env):
    keys = _specs(api, make_spec, 5)
    new = _new_env(gpu_env)
    for key in keys[:2]:  # tuned already on the old environment: they need the new one too
        api.store.publish_plan(*make_plan(key, gpu_env))
    target = {"cudnn_version": 92000}
    r = api.client.post(URL, json={"target": target, "priority": 7}, headers=api.admin)
    assert r.status_code == 200, r.text
    assert r.json() == {"target": {**TargetEnvironment().model_dump(), **target}, "known_graph_keys": 5,
                        "already_planned": 0, "enqueued": 5, "already_queued": 0}
    jobs = api.store.list_jobs(status="queued")
    assert sorted(j.graph_key for j in jobs) == sorted(keys)
    assert all(j.priority == 7 and j.target == TargetEnvironment(**target) for j in jobs)

    # Only a worker on the new environment gets them; the old fleet's workers are not disturbed.
    assert api.store.claim(gpu_env, "old-fleet", lease_seconds=60) is None
    claimed = api.store.claim(new, "new-fleet", lease_seconds=60)
    assert claimed is not None and claimed.job.graph_key in keys

    again = api.client.post(URL, json={"target": target, "priority": 7}, headers=api.admin).json()
    assert (again["enqueued"], again["already_queued"]) == (0, 5)
    assert len(api.store.list_jobs()) == 5


def test_exact_target_skips_keys_already_planned_there(api, make_spec, make_plan, gpu_env):
    keys = _specs(api, make_spec, 4)
    new = _new_env(gpu_env)
    api.store.publish_plan(*make_plan(keys[1], new))
    api.store.publish_plan(*make_plan(keys[2], gpu_env))  # planned elsewhere only: still enqueued
    r = api.client.post(URL, json={"target": TargetEnvironment.exactly(new).model_dump()}, headers=api.admin)
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["known_graph_keys"], body["already_planned"], body["enqueued"]) == (4, 1, 3)
    assert sorted(j.graph_key for j in api.store.list_jobs()) == sorted([keys[0], keys[2], keys[3]])


def test_campaign_counts_jobs_queued_by_tune_requests(api, make_spec):
    keys = _specs(api, make_spec, 3)
    target = {"sm": 100, "driver_version": 13010}
    r = api.client.post("/v1/admin/tune", json={"graph_keys": [keys[0]], "targets": [target]}, headers=api.admin)
    assert r.status_code == 200, r.text
    body = api.client.post(URL, json={"target": target}, headers=api.admin).json()
    assert (body["enqueued"], body["already_queued"]) == (2, 1)
    assert len(api.store.list_jobs()) == 3


def test_campaign_with_no_specs_enqueues_nothing(api):
    r = api.client.post(URL, json={"target": {"cudnn_version": 92000}}, headers=api.admin)
    assert r.status_code == 200
    assert r.json()["known_graph_keys"] == 0 and r.json()["enqueued"] == 0


def test_campaign_needs_an_admin(api, make_spec):
    _specs(api, make_spec, 1)
    body = {"target": {"cudnn_version": 92000}}
    assert api.client.post(URL, json=body).status_code == 401
    for role in (api.reader, api.worker):
        r = api.client.post(URL, json=body, headers=role)
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    assert api.store.list_jobs() == []


def test_campaign_request_is_validated(api, make_spec):
    _specs(api, make_spec, 1)
    for body, needle in (
        ({"target": {}}, "target sets no field"),
        ({"target": {"cudnn_version": None, "sm": None}}, "target sets no field"),
        ({"target": {"cudnn_version": 92000}, "colour": "red"}, "colour"),
        ({"target": {"cudnn_version": 0}}, "cudnn_version"),
        ({"target": {"cudnn_version": 92000}, "max_attempts": 0}, "max_attempts"),
        ({"target": {"cudnn_version": 92000}, "priority": 10**12}, "priority"),
        ({"priority": 1}, "target"),
    ):
        r = api.client.post(URL, json=body, headers=api.admin)
        assert r.status_code == 422, (body, r.text)
        assert r.json()["error"]["code"] == "validation_error" and needle in r.json()["error"]["message"], r.text
    assert api.store.list_jobs() == []


def test_campaign_is_in_the_openapi_document(api):
    paths = api.client.get("/openapi.json").json()["paths"]
    assert "post" in paths[URL]
