"""``POST /v1/admin/campaigns``: every known graph key is enqueued for the new environment, once."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import sqlalchemy as sa

from plancache.environment import Environment
from plancache.protocol import TargetEnvironment
from plancache.store import campaigns, open_store
from plancache.store.autotune import _PG_AUTOTUNE_LOCK
from plancache.store.campaigns import CampaignResult, run_campaign
from plancache.store.jobs import insert_job, insert_jobs
from tests.server_util import api  # noqa: F401

URL = "/v1/admin/campaigns"


def _specs(api: Any, make_spec: Any, n: int) -> list[str]:
    return _stored_specs(api.store, make_spec, n)


def _stored_specs(store: Any, make_spec: Any, n: int) -> list[str]:
    """``n`` stored specs' graph keys, ascending."""
    keys = []
    for i in range(n):
        key, spec = make_spec(i)
        store.put_spec(key, spec)
        keys.append(key)
    return sorted(keys)


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


def test_campaign_in_pages_counts_as_one_and_is_idempotent(store, make_spec, make_plan, gpu_env):
    keys = _stored_specs(store, make_spec, 7)
    target = TargetEnvironment.exactly(_new_env(gpu_env))
    store.publish_plan(*make_plan(keys[3], _new_env(gpu_env)))
    store.enqueue(keys[5], target)
    assert run_campaign(store, target, page_keys=2) == CampaignResult(known=7, already_planned=1, enqueued=5,
                                                                      already_queued=1)
    for page_keys in (1, 3, 7, 500):  # 7: the last page is full, an empty one follows
        assert run_campaign(store, target, page_keys=page_keys) == CampaignResult(7, 1, 0, 6)
    jobs = store.list_jobs()
    assert sorted(j.graph_key for j in jobs) == [k for k in keys if k != keys[3]]
    assert {j.source for j in jobs if j.graph_key != keys[5]} == {"campaign"}


def test_concurrent_campaigns_and_enqueues_queue_each_key_once(store, make_spec):
    keys = _stored_specs(store, make_spec, 30)
    target = TargetEnvironment(cudnn_version=92000)
    start = threading.Barrier(4)

    def campaign() -> int:
        start.wait()
        result = run_campaign(store, target, page_keys=4)
        assert (result.known, result.already_planned) == (30, 0)
        assert result.enqueued + result.already_queued == 30
        return result.enqueued

    def enqueue_one_by_one() -> int:
        start.wait()
        return sum(store.enqueue(key, target)[1] for key in reversed(keys))

    with ThreadPoolExecutor(4) as pool:
        created = [f.result() for f in [pool.submit(campaign) for _ in range(3)] + [pool.submit(enqueue_one_by_one)]]
    assert sum(created) == 30
    assert sorted(j.graph_key for j in store.list_jobs(limit=1000)) == keys


def test_writers_go_on_between_the_pages_of_a_campaign(store, make_spec, gpu_env, monkeypatch):
    """A claim that waits for SQLite's write lock while a page is enqueued gets it before the next page."""
    if not store.db.is_sqlite:
        pytest.skip("Postgres locks rows, not the database: a claim does not wait for a campaign")
    _stored_specs(store, make_spec, 3)
    claimed = threading.Event()
    pages: list[bool] = []

    def claim() -> None:
        store.claim(gpu_env, "w1", lease_seconds=60)
        claimed.set()

    def insert_page(*args: Any, **kwargs: Any) -> int:
        pages.append(claimed.is_set())
        if len(pages) == 1:
            threading.Thread(target=claim).start()  # waits for this page's transaction
        return insert_jobs(*args, **kwargs)

    monkeypatch.setattr(campaigns, "insert_jobs", insert_page)
    assert run_campaign(store, TargetEnvironment(cudnn_version=92000), page_keys=1).enqueued == 3
    assert pages == [False, True, True, True]  # the last page is empty


def _lock_waiters(store: Any) -> int:
    with store.db.read() as conn:  # a transaction of its own: pg_stat_activity is read once per transaction
        return int(conn.execute(sa.text("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                        "AND datname = current_database()")).scalar_one())


@pytest.mark.postgres
def test_exact_campaign_waits_for_an_autotune_step(postgres_url, make_spec, gpu_env):
    """The autotune step enqueues most missed first (here the last key, then the first); a campaign that inserted the
    first key and waited for the last would deadlock with it: it waits for the step to end instead."""
    store = open_store(postgres_url, create=True)
    try:
        keys = _stored_specs(store, make_spec, 3)
        target = TargetEnvironment.exactly(gpu_env)
        with ThreadPoolExecutor(1) as pool, store.db.write() as step:
            step.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_AUTOTUNE_LOCK})
            insert_job(step, keys[2], target, now=store.db.now(step), priority=0, max_attempts=3, source="auto")
            campaign = pool.submit(run_campaign, store, target)
            deadline = time.monotonic() + 10
            while not _lock_waiters(store):  # until the campaign waits for a lock the step holds
                assert time.monotonic() < deadline, "the campaign did not wait for the autotune step"
                time.sleep(0.02)
            insert_job(step, keys[0], target, now=store.db.now(step), priority=0, max_attempts=3, source="auto")
        assert campaign.result(timeout=30) == CampaignResult(known=3, already_planned=0, enqueued=1, already_queued=2)
    finally:
        store.close()
